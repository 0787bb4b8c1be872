"""The few small collectives the engine and the loader agree with, on CPU tensors over gloo.

Every rank calls the same method in the same order (they are collectives). The
group is created once per trainer by the Megatron adapter, whatever backend
training uses, so agreement never touches the GPU. No rank hangs because another
failed: a failure travels as a flag in the same collective and every rank raises
the same ``CheckpointError`` (PyTorch DCP's ``_DistWrapper`` idea).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pec.common.errors import CheckpointError

ANOTHER_RANK_FAILED = "another rank failed; see its log for the reason"
_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class Collectives:
    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._first = None  # what each collective waits for first (``first_wait_for``)

    def first_wait_for(self, wait) -> None:
        """Every collective calls ``wait()`` before it starts: the saver's hand-over thread makes a save's
        all-reduce (``save/saver.py``), and every rank must make its collectives in the same order, so one
        the training thread makes waits for the hand-over's (``wait`` returns at once on that thread)."""
        self._first = wait

    @classmethod
    def over_all_ranks(cls) -> "Collectives":
        """A gloo group over every rank (collective: every rank calls it once)."""
        return cls(dist.new_group(backend="gloo"))

    def reduce(self, values: list[int], op: str) -> list[int]:
        """Element-wise ``op`` (sum, min, max) of int64 ``values`` over all ranks."""
        return self.start_reduce(values, op).result() if values else []

    def start_reduce(self, values: list[int] | torch.Tensor, op: str) -> "PendingReduce":
        """``reduce`` of non-empty ``values`` (a list, or an int64 tensor reduced in place) started in
        the background; ``result()`` (or ``reduced()``, the tensor) waits for it."""
        tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
        self._in_order()
        if self.world_size == 1:  # (nothing to agree on: one rank's values are the result)
            return PendingReduce(None, tensor)
        return PendingReduce(dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True), tensor)

    def gather(self, values: list[int], width: int, pad: int = -1) -> list[list[int]]:
        """Every rank's ``values`` (at most ``width`` ints, padded with ``pad``), in rank order."""
        if len(values) > width:
            raise ValueError(f"cannot gather {len(values)} values in a width of {width}")
        mine = torch.full((width,), pad, dtype=torch.int64)
        mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._in_order()
        dist.all_gather(every, mine, group=self.group)
        return [t.tolist() for t in every]

    def _in_order(self) -> None:
        if self._first is not None:
            self._first()

    def all_ok(self, ok: bool) -> bool:
        """True on every rank iff ``ok`` on every rank."""
        return bool(self.reduce([1 if ok else 0], "min")[0])

    def raise_if_any(self, error: str | None) -> None:
        """Every rank raises (the same way) if any rank failed - no rank is left hanging."""
        if not self.all_ok(error is None):
            raise CheckpointError(error or ANOTHER_RANK_FAILED)


class PendingReduce:
    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def result(self) -> list[int]:
        return self.reduced().tolist()

    def reduced(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.tensor
