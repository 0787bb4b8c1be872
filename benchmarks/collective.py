"""Every collective the benchmarks make goes through here, with its tensors on the backend's device: NCCL
takes no CPU tensors ("No backend type associated with device type cpu"), gloo no GPU ones.
``tests/test_benchmarks_smoke.py`` fails if another module under ``benchmarks/`` calls one directly."""

from __future__ import annotations

import torch


def backend_device() -> torch.device:
    """The device this process group's collectives take their tensors on."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=device)


def reduce_max(x: float) -> float:
    """``x`` of the rank where it is largest (every rank calls it)."""
    t = _tensor([float(x)], backend_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def broadcast_value(x: float, src: int = 0) -> float:
    """Rank ``src``'s ``x`` on every rank (every rank calls it)."""
    t = _tensor([float(x)], backend_device())
    torch.distributed.broadcast(t, src)
    return float(t.item())


def gather_objects(x) -> list:
    """Every rank's ``x`` (picklable), in rank order, on every rank. (torch moves the pickles to the current
    GPU itself on NCCL: the process sets its device before.)"""
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out
