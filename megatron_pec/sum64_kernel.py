"""The sum64 of many items in one Triton launch, over a table of chunks (see ``chunks.py``).

Each program takes one chunk: ``nbytes`` bytes at address ``addr`` that are bytes ``pos`` onwards of
an item, read as units of ``2**log2`` bytes (8, 4, 2 or 1: the widest unit that is aligned both in
memory and within the item's words). A unit ``u`` at item byte ``p`` is the value ``u << 8 * (p % 8)``
in word ``p // 8``: the program adds up the values (A) and the values weighted by word index + 1 (B),
wrapping mod 2**64, and writes its two partial sums; the host adds the partials of each item's chunks.
A chunk whose item is not selected writes zeros (its sums are not asked for).

Imported only where Triton is (CUDA builds of torch ship it). With ``TRITON_INTERPRET=1`` set before
Triton is first imported, the same kernel runs on CPU tensors in Triton's interpreter (the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # units per step of a program


@triton.jit
def chunk_sums(table, partials, selected, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    row = table + c * 5
    base = tl.load(row).to(tl.pointer_type(tl.uint8))
    pos = tl.load(row + 2)
    log2 = tl.load(row + 3)
    on = tl.load(selected + tl.load(row + 4)).to(tl.int64)
    n = (tl.load(row + 1) * on) >> log2  # units
    k = tl.arange(0, BLOCK).to(tl.int64)
    a = tl.zeros([BLOCK], dtype=tl.int64)
    b = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        unit = start + k
        inside = unit < n
        at = unit << log2  # byte within the chunk
        # (unsigned units widen with zeros: a unit holds bytes, not a number)
        if log2 == 3:
            value = tl.load((base + at).to(tl.pointer_type(tl.int64)), mask=inside, other=0)
        elif log2 == 2:
            value = tl.load((base + at).to(tl.pointer_type(tl.uint32)), mask=inside, other=0).to(tl.int64)
        elif log2 == 1:
            value = tl.load((base + at).to(tl.pointer_type(tl.uint16)), mask=inside, other=0).to(tl.int64)
        else:
            value = tl.load(base + at, mask=inside, other=0).to(tl.int64)
        byte = pos + at  # within the item
        value = value << ((byte % 8) * 8)
        a += value
        b += (byte // 8 + 1) * value
    tl.store(partials + 2 * c, tl.sum(a, 0))
    tl.store(partials + 2 * c + 1, tl.sum(b, 0))


def launch(kernel, table, partials, selected) -> None:
    """One launch over every row of ``table`` ([rows, ROW] int64, on the device of the sums)."""
    kernel[(table.shape[0],)](table, partials, selected, BLOCK=BLOCK)


__all__ = ["BLOCK", "chunk_sums", "launch"]
