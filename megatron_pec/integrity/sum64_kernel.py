"""The sum64 of many items in one Triton launch, over a table of chunks (see ``integrity/chunk_table.py``).

Each program takes chunks: ``nbytes`` bytes at address ``addr`` that are bytes ``pos`` onwards of
an item, read as units of ``2**log2`` bytes (8, 4, 2 or 1: the widest unit that is aligned both in
memory and within the item's words). A unit ``u`` at item byte ``p`` is the value ``u << 8 * (p % 8)``
in word ``p // 8``: the program adds up the values (A) and the values weighted by word index + 1 (B),
wrapping mod 2**64, and writes its two partial sums; the host adds the partials of each item's chunks.
A chunk whose item is not selected writes zeros (its sums are not asked for).

A snapshot's launch also copies: each unit read is stored at its address plus the chunk's delta (its
place in page-locked node memory, which the GPU addresses as the host does), by a few programs that each
loop over chunks. The copy and its checksums then read device memory once, in one launch.

Imported only where Triton is (CUDA builds of torch ship it). With ``TRITON_INTERPRET=1`` set before
Triton is first imported, the same kernel runs on CPU tensors in Triton's interpreter (the tests).
``load`` compiles and loads it at start-up (``run_sums.KernelLoad``, a thread), never in a save or a restore.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024  # units per step of a program
# Programs of a copy: few, so the copy takes a few of the GPU's cores beside training and none of its copy
# engines (the training step's own small device-to-host copies would queue there behind the snapshot). The
# copy's bytes bound its time, not its programs, while more programs slow the step's own kernels; 4 leave
# room in a step for the copy to end (docs/performance.md, "Why the copy runs on 4 of the GPU's cores").
COPY_PROGRAMS = 4


# (the counts are not specialised on: Triton would compile anew for a count of 1 or a multiple of 16)
@triton.jit(do_not_specialize=["rows", "step"])
def chunk_sums(table, partials, selected, deltas, rows, step, BLOCK: tl.constexpr, COPY: tl.constexpr):
    """Program ``p`` takes chunks p, p + step, ... (one each where ``step`` is the number of rows); with
    ``COPY`` it also stores every unit it reads at its address plus the chunk's ``deltas`` entry."""
    k = tl.arange(0, BLOCK).to(tl.int64)
    for c in range(tl.program_id(0).to(tl.int64), rows.to(tl.int64), step.to(tl.int64)):
        row = table + c * 5
        addr = tl.load(row)
        base = addr.to(tl.pointer_type(tl.uint8))
        pos = tl.load(row + 2)
        log2 = tl.load(row + 3)
        on = tl.load(selected + tl.load(row + 4)).to(tl.int64)
        n = (tl.load(row + 1) * on) >> log2  # units
        if COPY:
            dst = (addr + tl.load(deltas + c)).to(tl.pointer_type(tl.uint8))
        a = tl.zeros([BLOCK], dtype=tl.int64)
        b = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            unit = start + k
            inside = unit < n
            at = unit << log2  # byte within the chunk
            # (unsigned units widen with zeros: a unit holds bytes, not a number)
            if log2 == 3:
                unit8 = tl.load((base + at).to(tl.pointer_type(tl.int64)), mask=inside, other=0)
                if COPY:
                    tl.store((dst + at).to(tl.pointer_type(tl.int64)), unit8, mask=inside)
                value = unit8
            elif log2 == 2:
                unit4 = tl.load((base + at).to(tl.pointer_type(tl.uint32)), mask=inside, other=0)
                if COPY:
                    tl.store((dst + at).to(tl.pointer_type(tl.uint32)), unit4, mask=inside)
                value = unit4.to(tl.int64)
            elif log2 == 1:
                unit2 = tl.load((base + at).to(tl.pointer_type(tl.uint16)), mask=inside, other=0)
                if COPY:
                    tl.store((dst + at).to(tl.pointer_type(tl.uint16)), unit2, mask=inside)
                value = unit2.to(tl.int64)
            else:
                unit1 = tl.load(base + at, mask=inside, other=0)
                if COPY:
                    tl.store(dst + at, unit1, mask=inside)
                value = unit1.to(tl.int64)
            byte = pos + at  # within the item
            value = value << ((byte % 8) * 8)
            a += value
            b += (byte // 8 + 1) * value
        tl.store(partials + 2 * c, tl.sum(a, 0))
        tl.store(partials + 2 * c + 1, tl.sum(b, 0))


def launch(kernel, table, partials, selected, deltas=None, programs=None) -> None:
    """One launch over every row of ``table`` ([rows, ROW] int64, on the device of the sums): the sums alone,
    a program per row; or, given ``deltas`` (int64 per row, on that device), also the copy of each selected
    row's bytes to its address plus its delta, by ``programs`` programs (None: ``COPY_PROGRAMS``)."""
    rows = table.shape[0]
    if deltas is None:
        kernel[(rows,)](table, partials, selected, table, rows, rows, BLOCK=BLOCK, COPY=False)
    else:
        programs = min(programs or COPY_PROGRAMS, rows)
        kernel[(programs,)](table, partials, selected, deltas, rows, programs, BLOCK=BLOCK, COPY=True)


def load(device) -> None:
    """Compile the kernel for ``device`` and load it there: a launch of each kind (the sums; the sums and a copy)
    over one word, its sums and its copy checked. Triton
    caches what it compiled per process and device, so later launches with arguments of the same kinds
    (torch-allocated int64 table and partials, uint8 selection) compile nothing. Raises what Triton raises
    when it cannot compile (no C compiler, no writable cache, a driver it does not know) and RuntimeError
    when the sums are wrong. Any thread: the device and the stream are set here."""
    import contextlib

    import torch

    device = torch.device(device)
    on_gpu = device.type == "cuda"
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        stream = torch.cuda.Stream(device) if on_gpu else None
        with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
            word = torch.full((1,), 0x0102030405060708, dtype=torch.int64, device=device)
            twin = torch.zeros((1,), dtype=torch.int64, device=device)
            table = torch.tensor([[word.data_ptr(), 8, 0, 3, 0]], dtype=torch.int64).to(device)
            partials = torch.zeros((1, 2), dtype=torch.int64, device=device)
            selected = torch.ones(1, dtype=torch.uint8, device=device)
            launch(chunk_sums, table, partials, selected)
            got = partials.cpu().tolist()
            deltas = torch.tensor([twin.data_ptr() - word.data_ptr()], dtype=torch.int64).to(device)
            launch(chunk_sums, table, partials, selected, deltas)
            got += partials.cpu().tolist() + [twin.cpu().tolist()]
    if got != [[0x0102030405060708, 0x0102030405060708]] * 2 + [[0x0102030405060708]]:
        raise RuntimeError(f"the compiled checksum kernel gives {got} for a known word")


__all__ = ["BLOCK", "COPY_PROGRAMS", "chunk_sums", "launch", "load"]
