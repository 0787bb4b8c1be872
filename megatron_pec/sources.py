"""Phase 8, source: where each rank can read a version of its state - node memory or storage.

Runs on every rank, for its own rank only; no communication. A source is
trusted only after its checksum matches (memory: the crc the agent recorded
in ``slots.json``; storage: the crc in the manifest), and only if it belongs
to this job and this configuration.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from megatron_pec import manifest
from megatron_pec.agent.persist import slot_crc
from megatron_pec.slots import open_slot, read_index, slot_path
from megatron_pec.stformat import FormatError, Header, decode_header, tensor_view
from megatron_pec.storage import PosixStorage, crc32_of


class SourceError(RuntimeError):
    """A source that failed validation; the message says which file and why."""


@dataclass
class Source:
    kind: str                 # "memory" or "storage"
    iteration: int
    items: dict[str, int]     # item -> iteration of the version it holds
    where: str                # path, for messages
    expected_crc: int
    manifest_entry: dict | None = None
    carried_tokens: dict[str, int] = field(default_factory=dict)  # memory: experts carried forward
    _buffer: object = field(default=None, repr=False)
    _header: Header | None = field(default=None, repr=False)

    def open(self, storage: PosixStorage) -> Header:
        """Read (storage) or map (memory) the source and verify its checksum; cached."""
        if self._header is not None:
            return self._header
        try:
            if self.kind == "memory":
                mapping, header = open_slot(self.where)
                if header.metadata.get("iteration") != str(self.iteration):
                    mapping.close()
                    raise SourceError(f"{self.where} was overwritten (holds iteration "
                                      f"{header.metadata.get('iteration')})")
                actual = slot_crc(mapping, header, set(self.items))
                buffer = mapping
            else:
                buffer = storage.read_into(self.where)
                size = self.manifest_entry["size"]
                if len(buffer) != size:
                    raise SourceError(f"{self.where} is {len(buffer)} bytes, the manifest says {size} (truncated?)")
                actual = crc32_of(buffer)
                header = decode_header(memoryview(buffer)[: min(len(buffer), 64 << 20)], file_len=len(buffer))
        except FileNotFoundError:
            raise SourceError(f"{self.where} is missing") from None
        except (OSError, FormatError) as exc:
            raise SourceError(f"{self.where} is unreadable: {exc}") from None
        if actual != self.expected_crc:
            raise SourceError(f"{self.where} fails its checksum (crc32 {actual:08x}, recorded "
                              f"{self.expected_crc:08x}): the file is corrupt")
        self._buffer, self._header = buffer, header
        return header

    @property
    def metadata(self) -> dict[str, str]:
        return self._header.metadata

    def tokens_at_version(self, item: str) -> int:
        """Cumulative tokens ``item`` had processed at the version this source holds."""
        if item in self.carried_tokens:
            return self.carried_tokens[item]
        return json.loads(self.metadata["tokens"])[item]

    def tensors(self, names: set[str]) -> dict:
        by_name = {e.name: e for e in self._header.tensors}
        missing = names - by_name.keys()
        if missing:
            raise SourceError(f"{self.where} lacks {len(missing)} tensors this run needs "
                              f"(e.g. {sorted(missing)[0]}): saved by a different model configuration")
        return {n: tensor_view(self._buffer, self._header, by_name[n]) for n in names}


def memory_sources(node_dir: str, rank: int, job_id: str, fingerprint: str, load_root: str) -> list[Source]:
    """Complete slots of this rank in node memory that belong to this job, config and --load."""
    sources = []
    for slot, record in sorted(read_index(node_dir).get(str(rank), {}).items()):
        path = slot_path(node_dir, rank, int(slot))
        try:
            mapping, header = open_slot(path)
        except (OSError, FormatError):
            continue
        meta = header.metadata
        mapping.close()
        if meta.get("state") != "complete" or meta.get("iteration") != str(record["iteration"]):
            continue  # rewritten after the agent recorded it (e.g. a kill mid-copy)
        if meta.get("job_id") != job_id or meta.get("fingerprint") != fingerprint:
            print(f"megatron-pec: rank {rank}: ignoring node-memory slot {path}: it belongs to job "
                  f"{meta.get('job_id')!r} with configuration {meta.get('fingerprint')}, this run is job "
                  f"{job_id!r} with configuration {fingerprint}", file=sys.stderr, flush=True)
            continue
        if os.path.abspath(meta.get("save", "")) != os.path.abspath(load_root):
            continue  # snapshots of another --save directory
        sources.append(Source("memory", record["iteration"], record["items"], path, record["crc32"],
                              carried_tokens=record.get("tokens", {})))
    return sources


def storage_source(root: str, iteration: int, rank: int, entry: dict) -> Source:
    return Source("storage", iteration, {i: iteration for i in entry["items"]},
                  os.path.join(root, entry["file"]), entry["crc32"], manifest_entry=entry)


def storage_sources(root: str, rank: int, fingerprint: str, topology: dict,
                    storage: PosixStorage) -> tuple[dict[int, Source], dict[int, dict]]:
    """Committed iterations readable by this rank: (iteration -> source, iteration -> manifest).

    Raises SourceError when the directory holds checkpoints that are not ours or
    were saved with a different topology (saying what differs).
    """
    committed = manifest.committed_iterations(root, storage)
    if not committed:
        _refuse_foreign(root, storage)
        return {}, {}
    sources, manifests = {}, {}
    for i in committed:
        try:
            m = manifest.read_manifest(root, i, storage)
        except manifest.ManifestError as exc:
            print(f"megatron-pec: rank {rank}: skipping iteration {i}: {exc}", file=sys.stderr, flush=True)
            continue
        if m["fingerprint"] != fingerprint:
            if i == committed[0]:
                raise SourceError(_mismatch(root, i, m["topology"], topology))
            continue
        entry = m["ranks"].get(str(rank))
        if entry is None:
            continue
        sources[i], manifests[i] = storage_source(root, i, rank, entry), m
    return sources, manifests


def _refuse_foreign(root: str, storage: PosixStorage) -> None:
    for i in manifest.iterations_on_disk(root, storage):
        names = storage.listdir(manifest.iter_dir(root, i))
        if names and "pec" not in names:
            raise SourceError(
                f"--load {root} holds iteration {i} in another format ({', '.join(names[:3])}): it is not a "
                "megatron-pec checkpoint. Load it with Megatron's own checkpointing, or point --load elsewhere.")


def _mismatch(root: str, iteration: int, saved: dict, current: dict) -> str:
    diffs = [f"{k} {saved.get(k)} -> {current.get(k)}" for k in sorted(current) if saved.get(k) != current.get(k)]
    what = ", ".join(diffs) if diffs else "the model's parameter layout differs"
    return (f"checkpoint {root} iteration {iteration} was saved with a different configuration ({what}). "
            "Resharding restore is not supported yet: restart with the saved parallel sizes and model shape.")


def expert_source_for(item: str, version: int, memory: list[Source], storage: dict[int, Source],
                      root: str, rank: int, manifest_at_target: dict | None) -> Source | None:
    """The source holding ``item`` at exactly ``version``: node memory first, else storage."""
    for s in memory:
        if s.items.get(item) == version:
            return s
    if version in storage and item in storage[version].items:
        return storage[version]
    if manifest_at_target is not None:
        older = manifest_at_target["sources"].get(str(version), {}).get(str(rank))
        if older is not None and item in older["items"]:
            return storage_source(root, version, rank, older)
    return None


