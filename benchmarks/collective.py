"""The one collective the benchmark workers time with: the slowest rank's seconds."""

from __future__ import annotations

import torch


def reduce_max(x: float) -> float:
    """``x`` of the rank where it is largest (every rank calls it). On NCCL the value travels in a GPU
    tensor: NCCL reduces no CPU tensors."""
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())
