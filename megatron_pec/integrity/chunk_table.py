"""The table the one-launch checksum kernel reads (``integrity/sum64_kernel.py``): every item's runs cut into chunks.

A run is a contiguous tensor whose bytes are bytes ``offset`` onwards of an item (the item's bytes are
its runs one after the other, as in a slot). Each run becomes a few rows ``(addr, nbytes, pos, log2,
item)``: a head of single bytes up to the first unit boundary, a body of units of ``2**log2`` bytes cut
into chunks of at most ``CHUNK_BYTES``, a tail of single bytes. The unit is the widest of 8, 4, 2, 1
bytes that lies on the same boundary in memory and within the item's words, so an 8-aligned run reads
whole words and a run of odd-sized tensors still reads each byte once.

Built on the host once per binding of the live tensors (numpy over every run at once); rows are
grouped by item so that the partial sums of an item are one slice of the kernel's output.
"""

from __future__ import annotations

import numpy

CHUNK_BYTES = 256 << 10
ROW = 5  # (addr, nbytes, pos, log2 of the unit, item index)


def unit_log2(addr: int, pos: int) -> int:
    """log2 of the widest unit (<= 8 bytes) aligned both at ``addr`` in memory and at ``pos`` in the item."""
    delta = (addr - pos) % 8
    return 3 if delta == 0 else (delta & -delta).bit_length() - 1


def run_rows(addr: int, nbytes: int, pos: int, item: int) -> list[tuple[int, int, int, int, int]]:
    """The rows of one run: ``nbytes`` at ``addr``, bytes ``pos`` onwards of item number ``item``."""
    log2 = unit_log2(addr, pos)
    unit = 1 << log2
    head = min((-pos) % unit, nbytes)
    body = (nbytes - head) // unit * unit
    rows = []
    if head:
        rows.append((addr, head, pos, 0, item))
    for start in range(head, head + body, CHUNK_BYTES):
        rows.append((addr + start, min(CHUNK_BYTES, head + body - start), pos + start, log2, item))
    if head + body < nbytes:
        start = head + body
        rows.append((addr + start, nbytes - start, pos + start, 0, item))
    return rows


def _cut(addrs, sizes, positions):
    """Per run: (unit log2, head bytes, body bytes, tail bytes, body chunks, has a head, has a tail, rows)."""
    log2 = _LOG2[(addrs - positions) % 8]
    unit = numpy.left_shift(1, log2)
    head = numpy.minimum((-positions) % unit, sizes)
    body = (sizes - head) // unit * unit
    tail = sizes - head - body
    chunks = -(-body // CHUNK_BYTES)
    has_head, has_tail = (head > 0).astype(numpy.int64), (tail > 0).astype(numpy.int64)
    return log2, head, body, tail, chunks, has_head, has_tail, has_head + chunks + has_tail


def table_rows(addrs, sizes, positions, owners) -> numpy.ndarray:
    """[rows, ROW] int64: ``run_rows`` of every run (int64 arrays, one entry per run, non-empty runs) one
    after the other, computed with numpy: a binding of 10^5 runs costs milliseconds, not a second."""
    log2, head, body, tail, chunks, has_head, has_tail, counts = _cut(addrs, sizes, positions)
    first = numpy.cumsum(counts) - counts  # each run's first row
    rows = numpy.empty((int(counts.sum()), ROW), dtype=numpy.int64)
    at = first[has_head > 0]
    rows[at] = numpy.stack([addrs, head, positions, numpy.zeros_like(log2), owners], axis=1)[has_head > 0]
    run = numpy.repeat(numpy.arange(len(sizes)), chunks)
    k = numpy.arange(len(run)) - numpy.repeat(numpy.cumsum(chunks) - chunks, chunks)  # chunk number in its run
    start = head[run] + k * CHUNK_BYTES
    rows[first[run] + has_head[run] + k] = numpy.stack(
        [addrs[run] + start, numpy.minimum(CHUNK_BYTES, head[run] + body[run] - start), positions[run] + start,
         log2[run], owners[run]], axis=1)
    last = has_tail > 0
    start = (head + body)[last]
    rows[(first + counts - 1)[last]] = numpy.stack(
        [addrs[last] + start, tail[last], positions[last] + start, numpy.zeros(int(last.sum()), dtype=numpy.int64),
         owners[last]], axis=1)
    return rows


_LOG2 = numpy.array([3, 0, 1, 0, 2, 0, 1, 0], dtype=numpy.int64)  # unit_log2 by (addr - pos) % 8


class ChunkTable:
    """Rows for every item of ``runs`` (item -> [(tensor, byte offset within the item)], in item order)."""

    def __init__(self, runs: dict[str, list[tuple[object, int]]]):
        self.items = list(runs)
        self.index = {item: i for i, item in enumerate(self.items)}
        addrs, sizes, positions, owners = [], [], [], []
        self._kept: dict[str, list[int]] = {}  # item -> its runs that have rows (the non-empty ones)
        for i, item in enumerate(self.items):
            kept = self._kept[item] = []
            for r, (tensor, offset) in enumerate(runs[item]):
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    kept.append(r)
                    addrs.append(tensor.data_ptr())
                    sizes.append(nbytes)
                    positions.append(offset)
                    owners.append(i)
        columns = [numpy.asarray(v, dtype=numpy.int64) for v in (addrs, sizes, positions, owners)]
        self.rows = table_rows(*columns)
        cut = _cut(*columns[:3])
        self._addrs, self._units, self._row_counts = columns[0], numpy.left_shift(1, cut[0]), cut[-1]
        first_run = numpy.cumsum([0] + [len(self._kept[item]) for item in self.items]).tolist()
        self._first_run = dict(zip(self.items, first_run))  # item -> its first non-empty run's number
        # (rows are grouped by item: each item's first row, and one past the last item's)
        self.first_row = numpy.searchsorted(self.rows[:, 4], numpy.arange(len(self.items) + 1)).tolist()
        self.sources = [t for item in self.items for t, _ in runs[item]]  # (kept alive while the table is)

    def __len__(self) -> int:
        return len(self.rows)

    def deltas(self, destinations: dict[str, list[int]]) -> numpy.ndarray | None:
        """int64 per row: where its bytes go, as an offset from where they are (0 for items not given);
        ``destinations``: item -> the address of each of its runs' copy (every run, in order). None where a
        destination is not aligned as its source for the units its run is read in (a store would be misaligned:
        none is where the items of a slot start 8-aligned, as they do)."""
        per_run = numpy.zeros(len(self._addrs), dtype=numpy.int64)
        for item, addresses in destinations.items():
            kept, first = self._kept[item], self._first_run[item]
            if kept:
                span = slice(first, first + len(kept))
                per_run[span] = numpy.asarray(addresses, dtype=numpy.int64)[kept] - self._addrs[span]
        if (per_run % self._units).any():
            return None
        return numpy.repeat(per_run, self._row_counts)

    def item_totals(self, partials: numpy.ndarray) -> numpy.ndarray:
        """[items, 2] int64: the partial sums of each item's rows added up (wrapping mod 2**64)."""
        starts = numpy.asarray(self.first_row[:-1], dtype=numpy.int64)
        padded = numpy.concatenate([partials, numpy.zeros((1, 2), dtype=numpy.int64)])  # (items without rows)
        totals = numpy.add.reduceat(padded, numpy.minimum(starts, len(partials)), axis=0)
        empty = numpy.diff(numpy.asarray(self.first_row)) == 0
        totals[empty] = 0
        return totals


__all__ = ["ChunkTable", "CHUNK_BYTES", "ROW", "run_rows", "table_rows", "unit_log2"]
