"""Item checksums over runs of live tensors, computed where the tensors are, a fixed number of launches per
call whatever the number of runs.

``RunSums.for_device(runs, device)`` picks the implementation once per binding of the live tensors
(``runs``: item -> [(tensor, byte offset within the item)], the copy plan's source side):

* on a GPU with Triton: ``FusedRunSums``, one kernel launch over a table of chunks built once
  (``chunks.ChunkTable``, ``sum64_kernel.py``), whatever the items a call selects;
* on a GPU without Triton: ``StockRunSums``, stock torch operations per run (``sum64.DeviceSums``),
  said once in the log;
* on CPU tensors: ``HostRunSums``, numpy over the tensors' bytes (``sum64.Sum64``, the reference).

``start(items)`` enqueues the sums of ``items`` on the current stream and returns a ``PendingSums``;
its ``digests()`` may be read once that stream's work up to the call is done (the caller's event).
"""

from __future__ import annotations

import torch

from megatron_pec import log
from megatron_pec.chunks import ChunkTable
from megatron_pec.sum64 import DeviceSums, Sum64, digest


class PendingSums:
    def __init__(self, finish):
        self._finish = finish

    def digests(self) -> dict[str, str]:
        """item -> its sum64 (the stream's work must be done)."""
        return self._finish()


class RunSums:
    def __init__(self, runs: dict[str, list[tuple[torch.Tensor, int]]], device):
        self.runs, self.device = runs, device

    @staticmethod
    def for_device(runs: dict, device) -> "RunSums":
        if torch.device(device).type == "cpu":
            return HostRunSums(runs, device)
        try:
            from megatron_pec import sum64_kernel
        except ImportError as exc:  # (torch builds for CUDA ship Triton; a source build may not)
            log.warning(f"Triton is not importable ({exc}): item checksums on the GPU use stock torch "
                        "operations, several launches per run (slower saves); install triton", once=True)
            return StockRunSums(runs, device)
        return FusedRunSums(runs, device, sum64_kernel.chunk_sums)

    def start(self, items) -> PendingSums:
        raise NotImplementedError


class FusedRunSums(RunSums):
    """One launch per call (``kernel``: the compiled kernel, or ``sum64_kernel.interpreted()`` on CPU)."""

    def __init__(self, runs, device, kernel):
        super().__init__(runs, device)
        self.kernel = kernel
        self.table = ChunkTable(runs)
        self._rows = torch.from_numpy(self.table.rows).to(device)
        self._pin = torch.device(device).type == "cuda"

    def start(self, items) -> PendingSums:
        from megatron_pec.sum64_kernel import launch

        index, wanted = self.table.index, list(items)
        selected = torch.zeros(len(index), dtype=torch.uint8, pin_memory=self._pin)
        selected.numpy()[[index[item] for item in wanted]] = 1
        partials = torch.empty((len(self.table), 2), dtype=torch.int64, device=self.device)
        if len(self.table):
            launch(self.kernel, self._rows, partials, selected.to(self.device, non_blocking=True))
        host = torch.empty(partials.shape, dtype=torch.int64, pin_memory=self._pin)
        host.copy_(partials, non_blocking=True)
        table = self.table

        def finish() -> dict[str, str]:
            totals = table.item_totals(host.numpy()).tolist()
            return {item: digest(*totals[table.index[item]]) for item in wanted}

        return PendingSums(finish)


class StockRunSums(RunSums):
    """Stock torch operations, about fifteen launches per run (without Triton)."""

    def start(self, items) -> PendingSums:
        sums = DeviceSums(self.device)
        for item in items:
            for tensor, offset in self.runs[item]:
                sums.add(item, tensor, offset)
        result = sums.result()
        host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
        host.copy_(result, non_blocking=True)
        return PendingSums(lambda: sums.digests(host))


class HostRunSums(RunSums):
    """numpy over CPU tensors, computed by whoever reads the digests (the tensors must not change before)."""

    def start(self, items) -> PendingSums:
        wanted = list(items)

        def finish() -> dict[str, str]:
            out = {}
            for item in wanted:
                acc = Sum64()
                for tensor, _ in self.runs[item]:
                    acc.update(tensor.detach().reshape(-1).view(torch.uint8).numpy())
                out[item] = acc.hexdigest()
            return out

        return PendingSums(finish)


__all__ = ["RunSums", "FusedRunSums", "StockRunSums", "HostRunSums", "PendingSums"]
