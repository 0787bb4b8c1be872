"""Load steps 3 (list) and 4 (read): where each rank can read a version of its state - node memory or
storage - and each read, verified.

Runs on every rank, for its own rank only; no communication. A source is
trusted only after its checksums match (memory: the per-item checksums the
agent recorded, which the trainer computed where the bytes came from; storage:
the manifest's per-item checksums for the items read from an older version's
file, else the whole-file crc32), and only if it belongs to this job and this
configuration. Which memory slots may serve a restore is the node agent's
decision (``NodeMemory.restorable``), never this module's.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from megatron_pec.common import log
from megatron_pec.format.protocol import JobKey, Manifest, ProtocolError, RankFile, SlotHeader
from megatron_pec.format.stformat import FormatError, Header, decode_header, read_header, tensor_at, tensor_views
from megatron_pec.integrity.byteruns import byte_runs
from megatron_pec.integrity.checksum import CHUNK, accumulator, crc32, item_checks, mismatch
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.slot_map import SlotMap, is_pool
from megatron_pec.memory.slots import open_slot
from megatron_pec.restore.landing import LandingError, land_rank_file
from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError
from megatron_pec.store.storage import Storage, prefetch


class SourceError(RuntimeError):
    """A source that failed validation; the message says which file and why."""


@dataclass
class Source:
    kind: str                 # "memory" or "storage"
    iteration: int            # the snapshot whose dense state it holds (memory: -1 for regions of others only)
    items: dict[str, int]     # item -> iteration of the version it holds
    where: str                # path, for messages
    item_checks: dict            # item -> its recorded checksum (sum64, or the CRC-32 of an older record)
    rank_file: RankFile | None = None       # storage: the manifest's entry
    header: SlotHeader | None = None        # memory: known up front; storage: once read
    carried_tokens: dict[str, int] = field(default_factory=dict)  # memory: experts carried forward
    origin: int | None = None               # memory pulled from that node's replica
    mapping: object = field(default=None, repr=False)  # memory: the trainer's own mapping of the slot, if any
    known_table: tuple | None = field(default=None, repr=False)  # memory: the table the trainer writes
    known_views: tuple | None = field(default=None, repr=False)  # memory: (data start, views) of that mapping
    checked_after_copy: bool = False        # memory: checksums verified where the bytes land (``Loader``)
    region: Header | None = field(default=None, repr=False)  # memory, a pool region: where its expert lies
    _buffer: object = field(default=None, repr=False)
    _layout: Header | None = field(default=None, repr=False)
    _verified: set[str] = field(default_factory=set, repr=False)
    _pieces: dict[str, tuple[object, int]] = field(default_factory=dict, repr=False)  # name -> (buffer, offset)
    read_later: bool = False                # storage, read whole: only its header is read yet (``read_into``)

    def open(self, storage: Storage, items: set[str] | None = None, read_later: bool = False) -> None:
        """Make ``items`` (None: everything the source holds) readable, each verified against its
        checksum (a memory slot ``checked_after_copy``: by the restore, once the bytes are on the device).
        A memory slot is mapped; of a storage file only the header and those items are read when the
        manifest has per-item checksums. Repeated calls read only what is new. ``read_later``: a storage
        file wanted whole has its header read and checked now, its data by the restore (``read_into``)."""
        wanted = set(self.items) if items is None else set(items)
        if wanted <= self._verified and self._layout is not None:
            return
        with self._reading():
            if self.kind == "memory":
                self._map_slot()
                expected = self._expected(wanted - self._verified)
                if self.checked_after_copy:
                    self._verified |= expected.keys()
                else:
                    self._check(item_checks(self._buffer, self._layout, expected))
            elif items is None and read_later:
                self._layout = read_checked_header(self.where, self.rank_file, storage)
                self.read_later = True
                self._verified = set(self.items)  # (its data is checked as the restore reads it)
            elif items is None:
                self._buffer, self._layout = read_rank_file(self.where, self.rank_file, storage)
                self._pieces.clear()
                self._verified = set(self.items)
            else:
                self._read_items(storage, wanted - self._verified)
            if self.header is None and self.kind == "storage":
                self.header = SlotHeader.from_metadata(self._layout.metadata)

    def fetch_ahead(self, storage: Storage) -> None:
        """A source opened ``read_later`` in a plan every rank agreed on: the storage starts fetching its file,
        which the restore reads whole once the optimizer's state is allocated (not before the agreement:
        one rank's fetch would queue ahead of another's header reads on a shared disk)."""
        if self.read_later:
            prefetch(storage, self.where)

    def read_into(self, storage: Storage, targets: dict, names: set[str], staging=None) -> dict:
        """A source opened ``read_later``: its whole file read now, each of ``names`` straight into its
        tensor in ``targets`` where it fits (``restore/landing.py``; device tensors through ``staging``, a
        ``restore.read_ring.DeviceReadRing``), the file checked as it is read; returns the tensors of those that
        did not land (read into buffers). Raises SourceError."""
        with self._reading():
            _, kept = land_rank_file(self.where, self.rank_file, self._layout, storage,
                                     {n: targets[n] for n in names if n in targets}, staging)
        by_name = {e.name: e for e in self._layout.tensors}
        return {n: tensor_at(kept[n][0], by_name[n], kept[n][1]) for n in names if n in kept}

    @contextmanager
    def _reading(self):
        """What goes wrong reading it, as a SourceError that says which file and why."""
        try:
            yield
        except FileNotFoundError:
            raise SourceError(f"{self.where} is missing") from None
        except LandingError as exc:
            raise SourceError(str(exc)) from None
        except (OSError, FormatError, ProtocolError) as exc:
            raise SourceError(f"{self.where} is unreadable: {exc}") from None

    def _map_slot(self) -> None:
        if self._layout is not None:
            return
        if self.region is not None:  # (the pool, mapped once for all its regions)
            self._buffer, self._layout = self.mapping, self.region
            return
        mapping, layout = open_slot(self.where, self.mapping, self.known_table)
        if self.header is not None and layout.metadata.get("iteration") != str(self.iteration):
            if mapping is not self.mapping:
                mapping.close()
            raise SourceError(f"{self.where} was overwritten (holds iteration {layout.metadata.get('iteration')})")
        self._buffer, self._layout = mapping, layout

    def _expected(self, items: set[str]) -> dict:
        missing = sorted(items - self.item_checks.keys())
        if missing:
            raise SourceError(f"{self.where} has no recorded checksum for {', '.join(missing[:3])}")
        return {i: self.item_checks[i] for i in items}

    def _check(self, actual: dict) -> None:
        for item in sorted(actual):
            if actual[item] != self.item_checks.get(item):
                raise SourceError(mismatch(self.where, item, actual[item], self.item_checks.get(item)))
        self._verified |= actual.keys()

    def _read_items(self, storage: Storage, items: set[str]) -> None:
        """An older version's file, of which a restore needs a few experts: read the header and
        those experts' byte ranges only, each checked against its own crc."""
        entry = self.rank_file
        if self._layout is None:
            actual_size = storage.size(self.where)
            if actual_size != entry.size:
                raise SourceError(f"{self.where} is {actual_size} bytes, the manifest says {entry.size} (truncated?)")
            head, self._layout = read_header(lambda o, n: storage.read_range(self.where, o, n), entry.size)
            if crc32(head) != entry.header_crc32:
                raise SourceError(f"{self.where} fails its header checksum: the file is corrupt")
        layout = self._layout
        for run in byte_runs([e for e in layout.tensors if e.item in items]):
            begin, end = run[0].begin, run[-1].end
            buffer = storage.read_range(self.where, layout.data_start + begin, end - begin)
            for e in run:
                self._pieces[e.name] = (buffer, e.begin - begin)
        accs = {item: accumulator(like) for item, like in self._expected(items).items()}
        for e in layout.tensors:  # header order, as the checksums were computed
            if e.item in items:
                buffer, offset = self._pieces[e.name]
                accs[e.item].update(memoryview(buffer)[offset:offset + e.end - e.begin])
        self._check({item: acc.result() for item, acc in accs.items()})

    @property
    def described(self) -> str:
        """Where it comes from, as the restore log says it."""
        return f"peer memory (node {self.origin})" if self.origin is not None else self.kind

    def tokens_at_version(self, item: str) -> int:
        """Cumulative tokens ``item`` had processed at the version this source holds."""
        if item in self.carried_tokens:
            return self.carried_tokens[item]
        return self.header.tokens[item]

    def tensors(self, names: set[str]) -> dict:
        by_name = {e.name: e for e in self._layout.tensors}
        missing = names - by_name.keys()
        if missing:
            raise SourceError(f"{self.where} lacks {len(missing)} tensors this run needs "
                              f"(e.g. {sorted(missing)[0]}): saved by a different model configuration")
        unverified = {by_name[n].item for n in names} - self._verified
        if unverified:
            raise SourceError(f"{self.where}: {sorted(unverified)} requested before being read and verified")
        pieces = [n for n in names if n in self._pieces]  # read on their own (a few experts of a file)
        out = {n: tensor_at(self._pieces[n][0], by_name[n], self._pieces[n][1]) for n in pieces}
        whole = [n for n in names if n not in self._pieces]
        views = self._trainers_views()
        if views is not None:
            out.update((n, views[n]) for n in whole)
        else:
            out.update(zip(whole, tensor_views(self._buffer, self._layout, [by_name[n] for n in whole])))
        return out

    def item_offsets(self, names: set[str]) -> dict[str, tuple[str, int]]:
        """Name -> (its item, its byte offset in the item's bytes as they are summed: the item's tensors
        in header order), for ``names``."""
        out, length = {}, {}
        for e in self._layout.tensors:
            at = length.get(e.item, 0)
            if e.name in names:
                out[e.name] = (e.item, at)
            length[e.item] = at + e.end - e.begin
        return out

    def _trainers_views(self) -> dict | None:
        """The trainer's own views of this slot when they view exactly these bytes: read through its
        mapping, with its tensor table, its data at the same offset."""
        if self.known_views is None or self.mapping is None or self._buffer is not self.mapping:
            return None
        data_start, views = self.known_views
        if self.known_table is None or self._layout.tensors is not self.known_table[1] \
                or self._layout.data_start != data_start:
            return None
        return views


def read_rank_file(path: str, entry: RankFile, storage: Storage,
                   deep: bool = False) -> tuple[memoryview, Header]:
    """A whole persisted rank file, checked against its manifest entry (size, crc32; ``deep`` also
    the header and per-item crc32s that partial restores rely on); raises SourceError (what is
    wrong, in words) or OSError."""
    buffer, actual = storage.read_checked(path)
    if len(buffer) != entry.size:
        raise SourceError(f"{path} is {len(buffer)} bytes, the manifest says {entry.size} (truncated?)")
    if actual != entry.crc32:
        raise SourceError(f"{path} fails its checksum (crc32 {actual:08x}, recorded {entry.crc32:08x}): "
                          "the file is corrupt")
    try:
        layout = decode_header(memoryview(buffer)[: min(len(buffer), 8 + (64 << 20))], file_len=len(buffer))
    except FormatError as exc:
        raise SourceError(f"{path} is unreadable: {exc}") from None
    if deep and (crc32(memoryview(buffer)[:layout.data_start]) != entry.header_crc32
                 or item_checks(buffer, layout, entry.item_checks) != entry.item_checks):
        raise SourceError(f"{path} header or per-expert checksums differ from the recorded ones (corrupt)")
    return buffer, layout


def read_checked_header(path: str, entry: RankFile, storage: Storage) -> Header:
    """The header of a committed rank file, checked against its manifest entry (size, header crc32);
    raises SourceError."""
    try:
        size = storage.size(path)
        if size != entry.size:
            raise SourceError(f"{path} is {size} bytes, the manifest says {entry.size} (truncated?)")
        head, header = read_header(lambda offset, n: storage.read_range(path, offset, n), size)
    except FileNotFoundError:
        raise SourceError(f"{path} is missing") from None
    except (OSError, FormatError) as exc:
        raise SourceError(f"{path} is unreadable: {exc}") from None
    if crc32(head) != entry.header_crc32:
        raise SourceError(f"{path} fails its header checksum: the file is corrupt")
    return header


def verify_items(path: str, header: Header, items: set[str], expected: dict, storage: Storage,
                 chunk: int = CHUNK) -> None:
    """Stream ``items`` of a file (a bounded buffer at a time, one ranged read per buffer of adjacent
    tensors) and compare each one's checksum with ``expected`` (item -> recorded checksum); raises
    SourceError."""
    missing = sorted(items - expected.keys())
    if missing:
        raise SourceError(f"{path} has no recorded checksum for {', '.join(missing[:3])}")
    accs = {item: accumulator(expected[item]) for item in items}
    try:
        for run in byte_runs([e for e in header.tensors if e.item in accs]):  # header order, as summed
            at = 0  # the first entry of the run not yet wholly fed
            for start in range(run[0].begin, run[-1].end, chunk):
                end = min(start + chunk, run[-1].end)
                data = memoryview(storage.read_range(path, header.data_start + start, end - start))
                while at < len(run) and run[at].begin < end:
                    e = run[at]
                    accs[e.item].update(data[max(e.begin, start) - start:min(e.end, end) - start])
                    if e.end > end:
                        break  # it goes on in the next buffer
                    at += 1
    except OSError as exc:
        raise SourceError(f"{path} is unreadable: {exc.strerror or exc}") from None
    for item in sorted(items):
        if accs[item].result() != expected[item]:
            raise SourceError(mismatch(path, item, accs[item].result(), expected[item]))


def memory_sources(node_dir: str, rank: int, job: JobKey, slots=None, checked_after_copy: bool = False) -> list[Source]:
    """The slots of this rank that node memory's owner (the agent's index) says may serve a
    restore of ``job`` (same job, configuration and --load as --save). ``slots``: the trainer's own
    ``SlotFiles``, if mapped: a slot file it maps is read through its mapping (its pages already
    mapped, its tensor table and views already built) instead of mapping it anew.
    ``checked_after_copy``: the restore verifies the bytes once they are on the device."""
    mapped = slots.mapped() if slots is not None else {}
    views = slots.mapped_views() if slots is not None else {}
    table = slots.table if slots is not None else None
    restorable, foreign = NodeMemory.read(node_dir, rank).restorable(rank, job)
    for reason in foreign:
        log.warning(f"ignoring node-memory slot {reason}", rank=rank)
    out, pool = [], None
    for slot, path, record, header in restorable:
        region = None
        if is_pool(slot):
            pool = pool or _pool(path, mapped.get(path), slots)
            if pool is None:
                continue  # (no readable pool: its experts come from storage)
            [item] = record.items
            try:
                region = pool[1].item_header(slot, item, None, pool[2])
            except FormatError:
                continue
        out.append(Source("memory", record.iteration, record.items, path, record.checks, header=header,
                          carried_tokens=record.tokens, origin=record.origin,
                          mapping=pool[0] if region is not None else mapped.get(path), known_table=table,
                          known_views=views.get(path), checked_after_copy=checked_after_copy, region=region))
    return out


def _pool(path: str, mapping, slots) -> tuple | None:
    """(mapping, ``SlotMap``, header) of a rank's expert pool, mapped once; None when unreadable."""
    try:
        mapping, header = open_slot(path, mapping)
        own_pool = slots is not None and mapping is slots.pool
        layout = slots.layout if own_pool else SlotMap.from_headers(None, header)
        return mapping, layout, header
    except (OSError, FormatError) as exc:
        log.warning(f"ignoring node memory's expert pool {path}: {exc}")
        return None


def storage_source(directory: CheckpointDir, iteration: int, entry: RankFile) -> Source:
    return Source("storage", iteration, {i: iteration for i in entry.items}, directory.path(entry.file),
                  entry.item_checks, rank_file=entry)


def storage_sources(directory: CheckpointDir, rank: int, fingerprint: str, topology: dict,
                    known: dict[int, Manifest] | None = None) -> tuple[dict[int, Source], dict[int, Manifest]]:
    """Committed iterations readable by this rank: (iteration -> source, iteration -> manifest);
    ``known``: manifests the caller has read already.

    Raises SourceError when the directory holds checkpoints that are not ours or
    were saved with a different topology (saying what differs).
    """
    committed = directory.committed_iterations()
    if not committed:
        _refuse_foreign(directory)
        return {}, {}
    sources, manifests = {}, {}
    for i in committed:
        try:
            m = (known or {}).get(i) or directory.read_manifest(i)
        except ManifestError as exc:
            log.warning(f"skipping iteration {i}: {exc}", rank=rank)
            continue
        if m.fingerprint != fingerprint:
            if i == committed[0]:
                raise SourceError(_mismatch(directory.root, i, m.topology, topology))
            continue
        entry = m.ranks.get(str(rank))
        if entry is None:
            continue
        sources[i], manifests[i] = storage_source(directory, i, entry), m
    return sources, manifests


def _refuse_foreign(directory: CheckpointDir) -> None:
    found = directory.megatron_format()
    if found is not None:
        raise SourceError(
            f"--load {directory.root} holds {found}: it is not a megatron-pec checkpoint. megatron-pec switches to "
            "its own format from it only inside Megatron-LM (its own loader reads it); otherwise point --load "
            "elsewhere.")


def _mismatch(root: str, iteration: int, saved: dict, current: dict) -> str:
    diffs = [f"{k} {saved.get(k)} -> {current.get(k)}" for k in sorted(current) if saved.get(k) != current.get(k)]
    what = ", ".join(diffs) if diffs else "the model's parameter layout differs"
    return (f"checkpoint {root} iteration {iteration} was saved with a different configuration ({what}). "
            "Restart with the saved model shape; a restore onto other data-parallel sizes reads storage and needs "
            "node memory of this configuration cleared (--pec-shm-dir).")


def expert_source_for(item: str, version: int, memory: list[Source], stored: dict[int, Source],
                      directory: CheckpointDir, rank: int, manifest_at_target: Manifest | None) -> Source | None:
    """The source holding ``item`` at exactly ``version``: node memory first, else storage."""
    for s in memory:
        if s.items.get(item) == version:
            return s
    if version in stored and item in stored[version].items:
        return stored[version]
    if manifest_at_target is not None:
        older = manifest_at_target.file_of(version, rank)
        if older is not None and item in older.items:
            return storage_source(directory, version, older)
    return None
