"""Save steps 5 and 6 in the agent: check a snapshot's header (the worker records it) and persist its
persist-level items as a rank file (the writer).

The header (in the snapshot's home slot) carries each written item's checksum, computed by the trainer
where the bytes came from (``sum64``): that is the snapshot's record, and a memory-only snapshot is
recorded without reading its bytes. A persisted item is read once, from the region it lies in, to
write the rank file (a compact safetensors file: the non-expert tensors plus the persist-level experts,
written atomically), and checked against the trainer's checksum on the way: bytes that changed in node
memory never become a rank file. Items are written one after the other, the dense state first, and
each is handed back (``done``) as soon as it is checked, so snapshots may overwrite its region while
the rest is still being written.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from megatron_pec.format.item_names import NON_EXPERT, parse_item
from megatron_pec.format.protocol import JobKey, ProtocolError, SlotHeader
from megatron_pec.format.stformat import encode_header
from megatron_pec.integrity.checksum import accumulator, crc32, item_crc32, mismatch
from megatron_pec.memory.history import header_problem
from megatron_pec.memory.slots import SlotCache
from megatron_pec.store.storage import Storage

# Bytes written (and summed) at a time: each piece is read three times at once (the write's copy, the
# file's crc32, the item's sum64), so it should stay in the CPU's caches: 8 MiB pieces cost the agent
# 3x the CPU of 1 MiB ones in the quick benchmark (writing 123 against 37 ms per K=all save).
CHUNK = 1 << 20


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


def check_snapshot(path: str, iteration: int, run: str, job: JobKey, slots: SlotCache,
                   locate=None) -> CheckedSnapshot:
    """Validate the home slot at ``path`` as holding the complete snapshot ``iteration`` of ``run`` and ``job``;
    reads its header only (a trainer of an older release: its items too, each where ``locate(item)`` says,
    default the home slot). Raises SnapshotMismatch, FormatError or OSError."""
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
    locate = locate or (lambda item: (mapping, header))
    return CheckedSnapshot(path, snapshot, header, {i: item_crc32(*locate(i), {i})[i] for i in written}, False)


def write_rank_file(checked: CheckedSnapshot, keep: set[str], target: str, storage: Storage, locate,
                    cpu=None, done=None) -> dict:
    """Persist the items ``keep`` of ``checked`` to ``target`` (``locate(item)``: the mapping of the file its
    region is in and a header placing it there), the dense state first, each checked against its checksum as
    it is written, before the rename (``cpu``: the agent's ledger, charged for the check). ``done(item)``
    is told as soon as an item's region is read and checked: the region may change from then on.

    Returns the rank file's ``size``, ``crc32``, ``items``, ``header_crc32`` and ``item_sums`` (``item_crc32``
    for a slot of an older trainer). Raises SnapshotMismatch, FormatError or OSError.
    """
    expected = {i: checked.checks[i] for i in keep}
    order = sorted(keep, key=lambda item: (item != NON_EXPERT, parse_item(item) if item != NON_EXPERT else 0))
    where = {item: locate(item) for item in order}
    charged = (lambda: cpu("checking persisted items")) if cpu is not None else contextlib.nullcontext
    file = _write_compact(where, order, checked.snapshot, expected, target, storage, checked.path, charged, done)
    file["item_sums" if checked.summed else "item_crc32"] = expected
    return file


def _write_compact(where: dict, order: list[str], snapshot: SlotHeader, expected: dict, target: str,
                   storage: Storage, home: str, charged, done) -> dict:
    """``where``: item -> (mapping, header placing it) of the file its bytes are in; ``order``: the items in
    file order. Each item's bytes are one run in every file (``memory/slot_map.py``)."""
    entries, offset, runs = [], 0, []
    for item in order:
        header = where[item][1]
        mine = [e for e in header.tensors if e.item == item]
        for e in mine:
            entries.append(type(e)(e.name, e.dtype, e.numel, offset, offset + (e.end - e.begin)))
            offset = entries[-1].end
        runs.append((item, header.data_start + mine[0].begin, header.data_start + mine[-1].end) if mine else
                    (item, 0, 0))
    kept = snapshot.with_items({i: v for i, v in snapshot.items.items() if i in expected},
                               {i: v for i, v in snapshot.sums.items() if i in expected})
    head = encode_header(entries, kept.to_metadata())

    def check(acc, piece) -> None:
        with charged():
            acc.update(piece)

    def chunks(summing: ThreadPoolExecutor):
        yield head
        for item, begin, end in runs:
            view = memoryview(where[item][0])  # zero-copy; dropped before the mapping closes
            acc = accumulator(expected[item])
            for at in range(begin, end, CHUNK):
                piece = view[at:min(at + CHUNK, end)]
                # (summed while written: both release the GIL; the region stays pinned until ``done``)
                summed = summing.submit(check, acc, piece)
                yield piece
                summed.result()
            del view
            if acc.result() != expected[item]:
                raise SnapshotMismatch(mismatch(f"{home} (in node memory)", item, acc.result(), expected[item]))
            if done is not None:
                done(item)

    with ThreadPoolExecutor(1, thread_name_prefix="persist-sums") as summing:
        size, crc = storage.write(target, chunks(summing))
    return {"size": size, "crc32": crc, "items": sorted(expected), "header_crc32": crc32(head)}


__all__ = ["CheckedSnapshot", "check_snapshot", "write_rank_file", "SnapshotMismatch"]
