"""Phase 8, source: where each rank can read a version of its state - node memory or storage.

Runs on every rank, for its own rank only; no communication. A source is
trusted only after its checksums match (memory: the per-item crcs the agent
recorded in ``slots.json``; storage: the manifest's per-item crcs for the items
read from an older version's file, else the whole-file crc), and only if it
belongs to this job and this configuration.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass, field

from megatron_pec import manifest
from megatron_pec.agent.persist import item_checksums
from megatron_pec.slots import open_slot, read_index, slot_path
from megatron_pec.stformat import FormatError, Header, decode_header, tensor_at
from megatron_pec.storage import PosixStorage, crc32_of


class SourceError(RuntimeError):
    """A source that failed validation; the message says which file and why."""


@dataclass
class Source:
    kind: str                 # "memory" or "storage"
    iteration: int
    items: dict[str, int]     # item -> iteration of the version it holds
    where: str                # path, for messages
    item_crcs: dict[str, int] | None   # crc32 per item; None: a storage file with only a whole-file crc
    manifest_entry: dict | None = None
    carried_tokens: dict[str, int] = field(default_factory=dict)  # memory: experts carried forward
    _buffer: object = field(default=None, repr=False)
    _header: Header | None = field(default=None, repr=False)
    _verified: set[str] = field(default_factory=set, repr=False)
    _pieces: dict[str, tuple[object, int]] = field(default_factory=dict, repr=False)  # name -> (buffer, offset)

    def open(self, storage: PosixStorage, items: set[str] | None = None) -> Header:
        """Make ``items`` (None: everything the source holds) readable, each verified against its
        checksum. A memory slot is mapped; of a storage file only the header and those items are
        read when the manifest has per-item checksums. Repeated calls read only what is new."""
        wanted = set(self.items) if items is None else set(items)
        if wanted <= self._verified and self._header is not None:
            return self._header
        try:
            if self.kind == "memory":
                self._map_slot()
                self._check(item_checksums(self._buffer, self._header, wanted - self._verified))
            elif items is None or self.item_crcs is None:  # written with item_crc32 and header_crc32
                self._read_whole_file(storage)
            else:
                self._read_items(storage, wanted - self._verified)
        except FileNotFoundError:
            raise SourceError(f"{self.where} is missing") from None
        except (OSError, FormatError) as exc:
            raise SourceError(f"{self.where} is unreadable: {exc}") from None
        return self._header

    def _map_slot(self) -> None:
        if self._header is not None:
            return
        mapping, header = open_slot(self.where)
        if header.metadata.get("iteration") != str(self.iteration):
            mapping.close()
            raise SourceError(f"{self.where} was overwritten (holds iteration {header.metadata.get('iteration')})")
        self._buffer, self._header = mapping, header

    def _check(self, actual: dict[str, int]) -> None:
        for item in sorted(actual):
            if actual[item] != self.item_crcs.get(item):
                raise SourceError(f"{self.where} fails its checksum for {item} (crc32 {actual[item]:08x}, recorded "
                                  f"{self.item_crcs.get(item, 0):08x}): the file is corrupt")
        self._verified |= actual.keys()

    def _read_whole_file(self, storage: PosixStorage) -> None:
        buffer = storage.read_into(self.where)
        size = self.manifest_entry["size"]
        if len(buffer) != size:
            raise SourceError(f"{self.where} is {len(buffer)} bytes, the manifest says {size} (truncated?)")
        actual = crc32_of(buffer)
        if actual != self.manifest_entry["crc32"]:
            raise SourceError(f"{self.where} fails its checksum (crc32 {actual:08x}, recorded "
                              f"{self.manifest_entry['crc32']:08x}): the file is corrupt")
        self._buffer = buffer
        self._header = decode_header(memoryview(buffer)[: min(len(buffer), 64 << 20)], file_len=len(buffer))
        self._pieces.clear()
        self._verified = set(self.items)

    def _read_items(self, storage: PosixStorage, items: set[str]) -> None:
        """An older version's file, of which a restore needs a few experts: read the header and
        those experts' byte ranges only, each checked against its own crc."""
        size = self.manifest_entry["size"]
        if self._header is None:
            actual_size = storage.size(self.where)
            if actual_size != size:
                raise SourceError(f"{self.where} is {actual_size} bytes, the manifest says {size} (truncated?)")
            head = storage.read_range(self.where, 0, 8)
            head += storage.read_range(self.where, 8, min(int.from_bytes(head, "little"), size - 8))
            if zlib.crc32(head) != self.manifest_entry["header_crc32"]:
                raise SourceError(f"{self.where} fails its header checksum: the file is corrupt")
            self._header = decode_header(head, file_len=size)
        header = self._header
        for run in _runs([e for e in header.tensors if e.item in items]):
            begin, end = run[0].begin, run[-1].end
            buffer = storage.read_range(self.where, header.data_start + begin, end - begin)
            for e in run:
                self._pieces[e.name] = (buffer, e.begin - begin)
        crcs = dict.fromkeys(items, 0)
        for e in header.tensors:  # header order, as the agent computed them
            if e.item in items:
                buffer, offset = self._pieces[e.name]
                crcs[e.item] = zlib.crc32(memoryview(buffer)[offset:offset + e.end - e.begin], crcs[e.item])
        self._check(crcs)

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
        unverified = {by_name[n].item for n in names} - self._verified
        if unverified:
            raise SourceError(f"{self.where}: {sorted(unverified)} requested before being read and verified")
        out = {}
        for n in names:
            buffer, offset = self._pieces.get(n) or (self._buffer, self._header.data_start + by_name[n].begin)
            out[n] = tensor_at(buffer, by_name[n], offset)
        return out


def _runs(entries):
    """Entries (in header order) grouped into runs of adjacent byte ranges: one read per run."""
    runs = []
    for e in entries:
        if runs and runs[-1][-1].end == e.begin:
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


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
        if "crcs" not in record:
            continue  # recorded by an agent of an older megatron-pec
        sources.append(Source("memory", record["iteration"], record["items"], path, record["crcs"],
                              carried_tokens=record.get("tokens", {})))
    return sources


def storage_source(root: str, iteration: int, rank: int, entry: dict) -> Source:
    return Source("storage", iteration, {i: iteration for i in entry["items"]},
                  os.path.join(root, entry["file"]), entry.get("item_crc32"), manifest_entry=entry)


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


