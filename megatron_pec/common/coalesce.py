"""Copies coalesced: one copy per run of bytes that is contiguous on both sides, not one per slice.

A snapshot copies each rank's slices between the optimizer's tensors and a slot (and a restore
back). Slices that follow each other in the slot often follow each other in the optimizer's memory
too: the main params of one bucket lie in Megatron's contiguous param buffer, and the moments in one
tensor per bucket (``megatron/contiguous.py``). Each run of them becomes one copy: on CPU one
memcpy instead of thousands of small ones, on GPU one ``cudaMemcpyAsync`` instead of one launch per
slice. Used on every rank by the engine (save) and the adapter (restore).
"""

from __future__ import annotations

import torch


def coalesced(dst: list[torch.Tensor], src: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dst, src)``, equal-length lists of contiguous 1-D tensors to copy pairwise, with each
    stretch of pairs where the next pair continues the previous one in memory on both sides (same
    storage, same dtype) merged into one pair of views spanning the stretch. Copying the result
    copies exactly the same bytes."""
    out_dst, out_src, _ = coalesced_with_starts(dst, src)
    return out_dst, out_src


def coalesced_with_starts(dst: list[torch.Tensor], src: list[torch.Tensor]) -> tuple[list, list, list[int]]:
    """``coalesced``, and the index in ``dst`` of each run's first pair."""
    out_dst, out_src, starts = [], [], []
    i, n = 0, len(dst)
    while i < n:
        d0, s0 = dst[i], src[i]
        d_end, s_end = _end(d0), _end(s0)
        j = i + 1
        if _flat(d0) and _flat(s0):
            while j < n and _continues(d0, d_end, dst[j]) and _continues(s0, s_end, src[j]):
                d_end, s_end = _end(dst[j]), _end(src[j])
                j += 1
        starts.append(i)
        if j == i + 1:
            out_dst.append(d0)
            out_src.append(s0)
        else:
            numel = (d_end - d0.data_ptr()) // d0.element_size()
            out_dst.append(d0.as_strided((numel,), (1,), d0.storage_offset()))
            out_src.append(s0.as_strided((numel,), (1,), s0.storage_offset()))
        i = j
    return out_dst, out_src, starts


def run_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """The view of a run of ``numel`` elements that starts at the 1-D view ``first``."""
    return first if first.numel() == numel else first.as_strided((numel,), (1,), first.storage_offset())


def _continues(first: torch.Tensor, end: int, t: torch.Tensor) -> bool:
    """``t`` starts at ``end`` in ``first``'s storage, with its dtype, and is flat."""
    return (t.data_ptr() == end and t.dtype == first.dtype and _flat(t)
            and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())


def _end(t: torch.Tensor) -> int:
    return t.data_ptr() + t.numel() * t.element_size()


def _flat(t: torch.Tensor) -> bool:
    return t.dim() == 1 and t.is_contiguous()


__all__ = ["coalesced", "coalesced_with_starts", "run_view"]
