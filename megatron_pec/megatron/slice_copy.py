"""Load step 6's copy of the saved slices into the live tensors, ordered so that on a GPU the copy runs beside
the CPU's part of the restore.

A relaunched trainer's restore from node memory is mostly its host-to-device copy. Before it the optimizer's
state is allocated (a fresh optimizer's moments); after it the device sums are bound, the params synced and
the small state restored: CPU work that need not wait for the copy. So the copies are enqueued without
waiting (from page-locked node memory they run on the device while the CPU goes on), the main params' first,
since they exist before the optimizer's state does, and the restore waits once, before it returns.
"""

from __future__ import annotations

import torch

from megatron_pec.megatron import restore


class SliceCopy:
    """One restore's copies, enqueued in two parts and waited for once. ``order``: the slice names in slot
    order (runs of slices that follow each other in both coalesce)."""

    def __init__(self, order: list[str]):
        self.order = order
        self.early: dict[str, torch.Tensor] = {}  # slice -> the target its copy was enqueued into first
        self.devices: set[torch.device] = set()   # where copies were enqueued without waiting

    def first(self, targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
        """Enqueue the slices of ``targets`` (the main params, before the optimizer's state exists) now."""
        names = [n for n in self.order if n in targets and n in tensors]
        self._enqueue([targets[n] for n in names], [tensors[n] for n in names], None)
        self.early = {n: targets[n] for n in names}

    def rest(self, targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
             places: dict[str, tuple[str, int]] | None) -> dict[str, str] | None:
        """Enqueue every other slice of ``targets``, and an early one whose target moved since (an optimizer
        that replaced its main params while loading its state). ``places``: ``restore.copy_slices``'
        summed host copies. Returns their sums (None without ``places``)."""
        names = [n for n in self.order if n in targets and n in tensors and not self._landed(n, targets[n])]
        return self._enqueue([targets[n] for n in names], [tensors[n] for n in names],
                             [places.get(n) for n in names] if places else None)

    def wait(self) -> None:
        """Until every copy enqueued has landed (its sources may change or go once the restore returns)."""
        for device in self.devices:
            torch.cuda.current_stream(device).synchronize()
        self.devices = set()

    def _landed(self, name: str, target: torch.Tensor) -> bool:
        early = self.early.get(name)
        return early is not None and early.data_ptr() == target.data_ptr() and early.device == target.device \
            and early.numel() == target.numel() and early.dtype == target.dtype

    def _enqueue(self, live: list, saved: list, places: list | None) -> dict[str, str] | None:
        self.devices |= {t.device for t in live if t.device.type == "cuda"}
        return restore.copy_slices(live, saved, places)


__all__ = ["SliceCopy"]
