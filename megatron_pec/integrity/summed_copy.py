"""Host copies that sum what they copy: a restore from node memory into host tensors, checked in one pass.

Summing a slot's bytes and then copying them into the optimizer reads every byte from memory twice. The
compiled kernel sums each word as it copies it (``Sum64.copy``): one pass, at a plain copy's cost; without it,
each piece is summed right after its copy, from the cache. The sums are ``sum64``'s, so an item's pieces may
be summed in any order and added up (``tests/test_summed_copy.py``).
"""

from __future__ import annotations

import numpy
import torch

from megatron_pec.common.coalesce import coalesced_with_starts
from megatron_pec.integrity.sum64 import MASK, Sum64, digest, in_one_pass

PIECE = 1 << 20  # bytes copied, then summed, at a time: about a core's L2 (0.5-2 MiB measured alike)
PIECE_IN_ONE_PASS = 1 << 30  # ... by the kernel: its calls few (pieces of 1 MiB cost 0.3 ms more at 55 MB)


@torch.no_grad()
def summed_copy(dst: list[torch.Tensor], src: list[torch.Tensor], places: list[tuple[str, int]]) -> dict[str, str]:
    """Copy each ``src[i]`` into ``dst[i]`` (contiguous 1-D host tensors of the same size) and return the
    sum64 of each item's bytes copied; ``places[i]``: (the item ``src[i]`` belongs to, its byte offset
    in the item)."""
    totals: dict[str, list[int]] = {}
    for item, offset, target, source in _pieces(dst, src, places):
        acc = Sum64(offset, _torch_row_sums).copy(target, source)
        total = totals.setdefault(item, [0, 0])
        total[0], total[1] = total[0] + acc.a, total[1] + acc.b
    return {item: digest(a & MASK, b & MASK) for item, (a, b) in totals.items()}


def _pieces(dst, src, places):
    """(item, byte offset in the item, destination bytes, source bytes) of at most ``PIECE`` bytes each
    (``PIECE_IN_ONE_PASS`` with the kernel), in copy order: the pairs coalesced into runs contiguous on both
    sides, each run cut where its item changes or its offsets jump, and every so many bytes."""
    runs_dst, runs_src, starts = coalesced_with_starts(dst, src)
    piece = PIECE_IN_ONE_PASS if in_one_pass() else PIECE
    for k, (run_dst, run_src) in enumerate(zip(runs_dst, runs_src)):
        to_bytes, from_bytes = _bytes(run_dst), _bytes(run_src)
        at, end_pair = 0, starts[k + 1] if k + 1 < len(starts) else len(dst)
        for item, offset, size in _stretches(dst, places, starts[k], end_pair):
            for cut in range(0, size, piece):
                n = min(piece, size - cut)
                yield item, offset + cut, to_bytes[at + cut:at + cut + n], from_bytes[at + cut:at + cut + n]
            at += size


def _stretches(dst, places, first: int, end: int):
    """(item, offset, bytes) of pairs ``first``..``end`` - 1 of one run, consecutive pairs of one item whose
    offsets follow on merged."""
    item, offset, size = places[first][0], places[first][1], 0
    for i in range(first, end):
        nbytes = dst[i].numel() * dst[i].element_size()
        if places[i] != (item, offset + size):
            yield item, offset, size
            item, offset, size = places[i][0], places[i][1], 0
        size += nbytes
    yield item, offset, size


def _torch_row_sums(grid: numpy.ndarray) -> numpy.ndarray:
    """Each row's int64 sum (wrapping, as numpy's), by torch's vectorised reduction, faster than numpy's (the
    pieces are copied destinations: writable, so torch shares their memory)."""
    return torch.from_numpy(grid).sum(dim=1).numpy()


def _bytes(tensor: torch.Tensor) -> numpy.ndarray:
    return tensor.view(torch.uint8).numpy()


__all__ = ["summed_copy", "PIECE"]
