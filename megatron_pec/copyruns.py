"""Coalesced snapshot copies: one copy per run of bytes that is contiguous in the live state and in
the slot alike, instead of one per slice.

Megatron lays a bucket's params out back to back in its buffers, so neighbouring slices of an item
are often neighbours in memory on both sides. Every copy is a call (on GPU a ``cudaMemcpyAsync``),
and a large MoE rank holds tens of thousands of slices; joined runs cut that to what the memory
layout allows. Joining only changes how the same bytes are addressed, never which.
"""

from __future__ import annotations

from typing import Callable

import torch


def coalesce(dst: list[torch.Tensor], src: list[torch.Tensor],
             join_dst: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``dst[i] <- src[i]`` as fewer pairs: neighbours joined where both sides continue each other.

    ``join_dst(first, numel)`` views ``numel`` elements of the destination from ``first`` on (the
    destinations are views of one buffer, each its own tensor); sources are joined inside their
    shared storage."""
    out_dst: list[torch.Tensor] = []
    out_src: list[torch.Tensor] = []
    for d, s in zip(dst, src):
        if out_dst and _continues(out_dst[-1], d) and _continues(out_src[-1], s) and _same_storage(out_src[-1], s):
            numel = out_dst[-1].numel() + d.numel()
            out_dst[-1], out_src[-1] = join_dst(out_dst[-1], numel), _join_in_storage(out_src[-1], numel)
        else:
            out_dst.append(d)
            out_src.append(s)
    return out_dst, out_src


def _continues(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b``'s bytes start where ``a``'s end (same dtype and device, both flat and dense)."""
    return (a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim() == 1 and a.numel() > 0
            and b.numel() > 0 and a.is_contiguous() and b.is_contiguous()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _join_in_storage(first: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,))
