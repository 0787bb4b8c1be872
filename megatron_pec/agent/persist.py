"""Save steps 5 and 6 in the agent: check a snapshot's header (the worker records it) and persist its
persist-level items as a rank file (the writer).

The header (in the snapshot's home slot) carries each written item's checksum, computed by the trainer
where the bytes came from (``sum64``): that is the snapshot's record, and a memory-only snapshot is
recorded without reading its bytes. A persisted item is read once, from the slot its region is in, to
write the rank file (a compact safetensors file: the non-expert tensors plus the persist-level experts,
written atomically), and checked against the trainer's checksum on the way: bytes that changed in node
memory never become a rank file.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_pec.agent.memory import header_problem
from megatron_pec.checksum import crc32, item_checks, item_crc32, mismatch
from megatron_pec.items import NON_EXPERT
from megatron_pec.protocol import JobKey, ProtocolError, SlotHeader
from megatron_pec.slots import SlotCache
from megatron_pec.stformat import encode_header
from megatron_pec.storage import Storage


class SnapshotMismatch(RuntimeError):
    """The slot's header or bytes do not hold the snapshot the trainer announced."""


@dataclass(frozen=True)
class CheckedSnapshot:
    """A snapshot whose header was checked: what the agent records, and what a persist reads."""

    path: str                 # its home slot
    snapshot: SlotHeader      # its header's metadata
    layout: object            # the slot's tensor table (``stformat.Header``; every slot of the rank shares it)
    checks: dict              # item -> its checksum (the trainer's sums; crc32 for a trainer of an older release)
    summed: bool              # ``checks`` are the trainer's sums

    def kept(self, persist_items: set[str] | None) -> set[str]:
        """What a rank file of it holds: the dense state and ``persist_items`` (None: all it wrote)."""
        written = set(self.snapshot.items)
        return written if persist_items is None else {i for i in written if i == NON_EXPERT or i in persist_items}


def check_snapshot(path: str, iteration: int, run: str, job: JobKey, slots: SlotCache) -> CheckedSnapshot:
    """Validate the home slot at ``path`` as holding the complete snapshot ``iteration`` of ``run`` and ``job``;
    reads its header only (a trainer of an older release: its items too). Raises SnapshotMismatch,
    FormatError or OSError."""
    mapping, header = slots.open(path)
    try:
        snapshot = SlotHeader.from_metadata(header.metadata)
    except ProtocolError as exc:
        snapshot = str(exc)
    problem = header_problem(snapshot, iteration, run, job)
    if problem is not None:
        raise SnapshotMismatch(f"{path} {problem}")
    written = snapshot.items
    if snapshot.sums:
        unsummed = sorted(set(written) - set(snapshot.sums))
        if unsummed:
            raise SnapshotMismatch(f"{path} has no checksum for {', '.join(unsummed[:3])}")
        return CheckedSnapshot(path, snapshot, header, {i: snapshot.sums[i] for i in written}, True)
    # a trainer of an older release: its bytes are checked here, as it did
    return CheckedSnapshot(path, snapshot, header, item_crc32(mapping, header, set(written)), False)


def write_rank_file(checked: CheckedSnapshot, keep: set[str], target: str, storage: Storage, slots: SlotCache,
                    elsewhere: dict[str, str] | None = None, cpu=None) -> dict:
    """Persist the items ``keep`` of ``checked`` to ``target`` (``elsewhere``: item -> the slot file its region is
    in, if not the home), each checked against its checksum before the rename (``cpu``: the agent's ledger,
    charged for the check).

    Returns the rank file's ``size``, ``crc32``, ``items``, ``header_crc32`` and ``item_sums`` (``item_crc32``
    for a slot of an older trainer). Raises SnapshotMismatch, FormatError or OSError.
    """
    elsewhere = elsewhere or {}
    path, header = checked.path, checked.layout
    expected = {i: checked.checks[i] for i in keep}
    mappings = {p: slots.open(p)[0] for p in {path, *elsewhere.values()}}
    where = {i: mappings[elsewhere.get(i, path)] for i in keep}
    charged = cpu("checking persisted items") if cpu is not None else contextlib.nullcontext()

    def checks() -> dict:
        with charged:
            return _checks_in(mappings, elsewhere, path, header, expected)

    # The persisted items are checked beside the write (both release the GIL), before the rename.
    with ThreadPoolExecutor(1) as pool:
        computing = pool.submit(checks)
        file = _write_compact(where, header, checked.snapshot, keep, target, storage,
                              lambda: _check(path, computing.result(), expected))
    file["item_sums" if checked.summed else "item_crc32"] = expected
    return file


def _checks_in(mappings: dict, elsewhere: dict[str, str], home: str, header, expected: dict) -> dict:
    """``item_checks`` of items spread over several slot files (one layout)."""
    out = {}
    for path, mapping in mappings.items():
        here = {i: v for i, v in expected.items() if elsewhere.get(i, home) == path}
        if here:
            out.update(item_checks(mapping, header, here))
    return out


def _check(path: str, actual: dict, expected: dict) -> None:
    for item in sorted(expected):
        if actual[item] != expected[item]:
            raise SnapshotMismatch(mismatch(f"{path} (in node memory)", item, actual[item], expected[item]))


def _write_compact(where: dict, header, snapshot: SlotHeader, keep: set[str], target: str, storage: Storage,
                   before_rename) -> dict:
    """``where``: item -> the mapping of the slot file its bytes are in (all slots share ``header``'s layout)."""
    entries, offset = [], 0
    chosen = [e for e in header.tensors if e.item in keep]
    for e in chosen:
        entries.append(type(e)(e.name, e.dtype, e.numel, offset, offset + (e.end - e.begin)))
        offset = entries[-1].end
    kept = snapshot.with_items({i: v for i, v in snapshot.items.items() if i in keep},
                               {i: v for i, v in snapshot.sums.items() if i in keep})
    head = encode_header(entries, kept.to_metadata())

    def chunks():
        yield head
        views = {id(m): memoryview(m) for m in where.values()}  # zero-copy; dropped before the mappings close
        for e in chosen:
            yield views[id(where[e.item])][header.data_start + e.begin: header.data_start + e.end]

    size, crc = storage.write_atomic(target, chunks(), before_rename)
    return {"size": size, "crc32": crc, "items": sorted(keep), "header_crc32": crc32(head)}


__all__ = ["CheckedSnapshot", "check_snapshot", "write_rank_file", "SnapshotMismatch"]
