"""Checkpoint paths (--save, --load, a command's DIR): a local or shared file system's, or a storage URL
(``scheme://...``, Megatron's ``msc://<profile>/<path>`` among them), which is no local path; and the
names inside a checkpoint directory (``store/checkpoint_dir.py`` lays them out). Pure: configuration and
storage read them alike."""

from __future__ import annotations

import os
import re

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's tracker
MANIFEST = "manifest.json"  # an iteration's commit marker
ITER_DIR = re.compile(r"^iter_(\d{7})$")
NODE_MARKER = re.compile(r"^node_\d{4}(\.[0-9A-Za-z._-]+)?\.json$")


def is_url(path: str) -> bool:
    """Whether a checkpoint path is a storage URL (``scheme://...``), no local path."""
    return "://" in path


def absolute(path: str) -> str:
    """A checkpoint path made absolute; a URL stays as it is."""
    return path if is_url(path) else os.path.abspath(path)


def storage_spec_for(explicit: str, *paths: str | None) -> str:
    """The job's storage description: ``explicit`` (--pec-storage, --storage) when given, else the one its
    checkpoint paths imply - "<scheme>://<first component>" for a URL (``msc://<profile>`` for Megatron's
    MSC paths; ``store.storage.open_storage`` refuses a scheme it does not know), POSIX ("") otherwise."""
    if explicit:
        return explicit
    for path in paths:
        scheme, sep, rest = (path or "").partition("://")
        if sep and scheme:
            return f"{scheme}://{rest.split('/', 1)[0]}"
    return ""


__all__ = ["ITER_DIR", "MANIFEST", "NODE_MARKER", "TRACKER", "absolute", "is_url", "storage_spec_for"]
