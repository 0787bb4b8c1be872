"""The table the one-launch checksum kernel reads (``sum64_kernel.py``): every item's runs cut into chunks.

A run is a contiguous tensor whose bytes are bytes ``offset`` onwards of an item (the item's bytes are
its runs one after the other, as in a slot). Each run becomes a few rows ``(addr, nbytes, pos, log2,
item)``: a head of single bytes up to the first unit boundary, a body of units of ``2**log2`` bytes cut
into chunks of at most ``CHUNK_BYTES``, a tail of single bytes. The unit is the widest of 8, 4, 2, 1
bytes that lies on the same boundary in memory and within the item's words, so an 8-aligned run reads
whole words and a run of odd-sized tensors still reads each byte once.

Built on the host once per binding of the live tensors; rows are grouped by item so that the partial
sums of an item are one slice of the kernel's output.
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


class ChunkTable:
    """Rows for every item of ``runs`` (item -> [(tensor, byte offset within the item)], in item order)."""

    def __init__(self, runs: dict[str, list[tuple[object, int]]]):
        self.items = list(runs)
        self.index = {item: i for i, item in enumerate(self.items)}
        rows, self.first_row = [], []
        for i, item in enumerate(self.items):
            self.first_row.append(len(rows))
            for tensor, offset in runs[item]:
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    rows += run_rows(tensor.data_ptr(), nbytes, offset, i)
        self.first_row.append(len(rows))
        self.rows = numpy.array(rows, dtype=numpy.int64).reshape(-1, ROW)
        self.sources = [t for item in self.items for t, _ in runs[item]]  # (kept alive while the table is)

    def __len__(self) -> int:
        return len(self.rows)

    def item_totals(self, partials: numpy.ndarray) -> numpy.ndarray:
        """[items, 2] int64: the partial sums of each item's rows added up (wrapping mod 2**64)."""
        starts = numpy.asarray(self.first_row[:-1], dtype=numpy.int64)
        padded = numpy.concatenate([partials, numpy.zeros((1, 2), dtype=numpy.int64)])  # (items without rows)
        totals = numpy.add.reduceat(padded, numpy.minimum(starts, len(partials)), axis=0)
        empty = numpy.diff(numpy.asarray(self.first_row)) == 0
        totals[empty] = 0
        return totals


__all__ = ["ChunkTable", "CHUNK_BYTES", "ROW", "run_rows", "unit_log2"]
