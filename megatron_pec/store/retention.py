"""Retention and retirement of a checkpoint directory's iterations (``store/checkpoint_dir.py``).

Retention (after a commit, by the committing agent, possibly in another thread: off the commit) keeps the
newest iterations and whatever of older ones a retained manifest still references for expert versions; a
commit that replaced another's drops the replaced files no manifest references. Retirement (load step 7,
by the engine after a restore) de-commits the iterations an abandoned run left after the one training
resumes from. Every rule reads and writes through the directory's storage; a manifest always goes before
the files it names. ``directory``: the ``CheckpointDir`` (which calls these; importing it here would close
a cycle).
"""

from __future__ import annotations

import os

from megatron_pec.common.errors import ManifestError
from megatron_pec.format.checkpoint_paths import MANIFEST, NODE_MARKER
from megatron_pec.format.protocol import Manifest


def drop_unreferenced(directory, iteration: int, replaced: Manifest) -> None:
    """Once another save's commit replaced ``replaced``: its rank files and node markers that no
    committed manifest references any more."""
    referenced = set()
    for i in directory.committed_iterations():
        try:
            m = directory.read_manifest(i)
        except ManifestError:
            continue
        referenced.update(e.file for e in m.ranks.values())
        referenced.update(e.file for files in m.sources.values() for e in files.values())
    for entry in replaced.ranks.values():
        if entry.file not in referenced:
            directory.storage.delete(directory.path(entry.file))
    for path in directory.node_markers(iteration):
        if directory.generation_of(path) == replaced.generation:
            directory.storage.delete(path)


def apply_retention(directory, keep: int) -> list[int]:
    """Keep the newest ``keep`` committed iterations. An older one whose rank files a retained
    manifest still references for expert versions keeps those files but stops being committed (its
    own references may go); every other older one is deleted. Returns the iterations deleted."""
    committed = directory.committed_iterations()
    if len(committed) <= keep:
        return []
    retained = committed[:keep]
    referenced: set[int] = set(retained)
    for i in retained:
        referenced.update(int(k) for k in directory.read_manifest(i).sources)
    removed = []
    oldest_retained = retained[-1]
    for i in directory.iterations_on_disk():
        if i >= oldest_retained:
            continue
        pec = directory.pec_dir(i)
        names = directory.storage.list(pec)
        # The manifest goes first: the iteration stops being valid before its files vanish.
        doomed = [MANIFEST] + [n for n in names if i not in referenced or NODE_MARKER.match(n)]
        for name in doomed:
            directory.storage.delete(os.path.join(pec, name))
        if i not in referenced:
            directory.storage.delete_prefix(pec)  # what is left there: partial writes
            if not directory.storage.list(directory.iter_dir(i)):  # (anything else in the iteration stays)
                directory.storage.delete_prefix(directory.iter_dir(i))
            removed.append(i)
    return removed

def retire_after(directory, iteration: int) -> list[int]:
    """De-commit every iteration after ``iteration``, where training resumes and will write them again.

    An abandoned run may have left manifests and node markers there; a stale
    marker would otherwise be combined with the new run's rank files into a
    manifest whose checksums no longer match (and a stale manifest would feed
    the next commit's expert versions). The manifest goes first, then the node
    markers; the tracker moves back to the newest committed iteration <= ``iteration``.
    Partial writes are discarded where their writer is gone (a killed agent's: the storage
    tells), and in the retired iterations whoever writes them; an agent of this host still
    persisting an earlier iteration while its trainer restarts keeps its file.
    Returns the iterations that lost a manifest or marker. Raises OSError.
    """
    retired = []
    if not directory.storage.exists(directory.root):
        return retired  # nothing saved yet (the first save creates the directory)
    for i in directory.iterations_on_disk():
        pec = directory.pec_dir(i)
        directory.storage.discard_partial(pec, live_too=i > iteration)
        if i > iteration:
            names = directory.storage.list(pec)
            stale = [n for n in names if n == MANIFEST] + [n for n in names if NODE_MARKER.match(n)]
            for name in stale:
                directory.storage.delete(os.path.join(pec, name))
            if stale:
                retired.append(i)
    for _ in range(16):
        try:
            current = directory.storage.read(directory.tracker_path)
        except FileNotFoundError:
            return retired
        text = current.decode(errors="replace").strip()
        if not text.isdigit() or int(text) <= iteration:
            return retired
        previous = [i for i in directory.committed_iterations() if i <= iteration]
        if not previous:
            directory.storage.delete(directory.tracker_path)
            return retired
        if directory.storage.commit(directory.tracker_path, str(previous[0]).encode(), expected=current):
            return retired
    raise OSError(f"{directory.tracker_path}: other commits kept replacing it")


__all__ = ["apply_retention", "drop_unreferenced", "retire_after"]
