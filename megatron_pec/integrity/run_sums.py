"""Item checksums over runs of live tensors, computed where the tensors are, a fixed number of launches per
call whatever the number of runs.

``RunSums.for_runs(runs, kernel)`` picks the implementation once per binding of the live tensors
(``runs``: item -> [(tensor, byte offset within the item)], the copy plan's source side), by each run's
device, not the caller's: only device memory goes to a device kernel.

* runs in device memory, with the one-launch kernel loaded (``KernelLoad``): ``FusedRunSums``, one kernel
  launch over a table of chunks built once (``chunk_table.ChunkTable``, ``integrity/sum64_kernel.py``), whatever the
  items a call selects;
* runs in device memory, where Triton gave no kernel (not importable, or it cannot compile: said once, at
  start-up): ``StockRunSums``, stock torch operations per run (``sum64.DeviceSums``);
* runs in host memory (the stateless views before the first optimizer step, CPU-offloaded optimizer
  state): ``HostRunSums``, numpy over the bytes (``sum64.Sum64``, the reference).

A binding with both is a ``SplitRunSums``: an item's sums are its device runs' plus its host runs' (the
sums of an item split exactly over its runs, mod 2**64).

``start(items)`` enqueues the sums of ``items`` on the current stream and returns a ``PendingSums``;
its ``digests()`` may be read once that stream's work up to the call is done (the caller's event).
"""

from __future__ import annotations

import threading
import time

import torch

from megatron_pec.common import log
from megatron_pec.integrity.chunk_table import ChunkTable
from megatron_pec.integrity.sum64 import MASK, DeviceSums, Sum64, digest

Runs = dict  # item -> [(tensor, byte offset within the item)]


def on_device(tensor) -> bool:
    """Whether ``tensor`` is device memory, which the device path copies and sums (the rest: the host's)."""
    return tensor.device.type == "cuda"


def split_runs(runs: Runs, is_device=on_device) -> tuple[Runs, Runs]:
    """(device runs, host runs) of every item of ``runs``, by each run's tensor; both keep every item (an
    item may have runs on both sides, or none on one)."""
    device, host = {}, {}
    for item, pairs in runs.items():
        device[item] = [pair for pair in pairs if is_device(pair[0])]
        host[item] = [pair for pair in pairs if not is_device(pair[0])]
    return device, host


class PendingSums:
    def __init__(self, totals):
        self._totals = totals

    def totals(self) -> dict[str, tuple[int, int]]:
        """item -> its two sums (A, B) mod 2**64 (the stream's work must be done)."""
        return self._totals()

    def digests(self) -> dict[str, str]:
        """item -> its sum64 (the stream's work must be done)."""
        return {item: digest(a, b) for item, (a, b) in self.totals().items()}


class KernelLoad:
    """The one-launch kernel, compiled and loaded on ``device`` by a thread started here (at the engine's
    start-up, beside Megatron's), so that neither a save nor a restore compiles. ``kernel()`` waits for it
    and gives the kernel, or None where Triton cannot give one (not importable; importable but unable to
    compile: no C compiler, no writable cache, a driver it does not know): the stock-operation sums then,
    said in one log line. Never raises. ``load``: the loader (default: ``sum64_kernel.load``)."""

    def __init__(self, device, load=None):
        self.device = device
        self._load = load or _load_triton
        self._kernel = None
        self.failure: str | None = None  # why there is no kernel
        self._thread = threading.Thread(target=self._run, name="megatron-pec kernel load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._kernel = self._load(self.device)
            log.info(f"checksum kernel loaded on device {self.device} in {time.perf_counter() - started:.2f} s",
                     once=True)
        except Exception as exc:  # (whatever Triton raises: its errors have no common base)
            text = str(exc).strip()
            self.failure = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
            fix = ("install triton" if isinstance(exc, ImportError) else
                   "give Triton a C compiler (CC), a writable cache (TRITON_CACHE_DIR) and a driver it knows")
            log.warning(f"the checksum kernel cannot be compiled here ({self.failure}): item checksums on the GPU "
                        f"use stock torch operations, several launches per run (slower saves); {fix}", once=True)

    def kernel(self):
        self._thread.join()
        return self._kernel


_loads: dict[int, KernelLoad] = {}  # device index -> this process's load of the kernel there
_loads_lock = threading.Lock()


def kernel_load(device: int) -> KernelLoad:
    """This process's load of the kernel on CUDA device ``device``: started on the first ask, shared after."""
    with _loads_lock:
        if device not in _loads:
            _loads[device] = KernelLoad(device)
        return _loads[device]


def preload(local_rank: int) -> None:
    """Start the kernel's load on the device this rank will train on (Megatron takes the local rank's, modulo
    the devices seen) when the trainer imports megatron-pec's entry points: Megatron's start-up (distributed
    set-up, model, optimizer) takes seconds, the compile ~0.7 s, so a relaunched trainer's restore, the first
    thing after that start-up, finds the kernel ready instead of waiting for it. Nothing without CUDA."""
    if not torch.cuda.is_available():
        return
    kernel_load(local_rank % torch.cuda.device_count())


def _load_triton(device):
    from megatron_pec.integrity import sum64_kernel  # (ImportError without Triton: the fallback, as a failed compile)

    sum64_kernel.load(device)
    return sum64_kernel.chunk_sums


class RunSums:
    copies = False  # whether ``start`` can also copy the runs (``destinations``)

    def __init__(self, runs: Runs, device):
        self.runs, self.device = runs, device

    @staticmethod
    def for_runs(runs: Runs, kernel: KernelLoad | None, is_device=on_device) -> "RunSums":
        """The sums of ``runs``, each run where its tensor is (``kernel``: the device kernel's load; None:
        the stock operations on the device)."""
        device_runs, host_runs = split_runs(runs, is_device)
        parts = []
        first = next((t for pairs in device_runs.values() for t, _ in pairs), None)
        if first is not None:
            loaded = kernel.kernel() if kernel is not None else None
            parts.append(FusedRunSums(device_runs, first.device, loaded) if loaded is not None
                         else StockRunSums(device_runs, first.device))
        if first is None or any(host_runs.values()):
            parts.append(HostRunSums(host_runs, "cpu"))
        return parts[0] if len(parts) == 1 else SplitRunSums(runs, parts)

    def start(self, items, landed: Runs | None = None, destinations: dict | None = None,
              programs: int | None = None) -> PendingSums | None:
        """The sums of ``items``; ``landed``: item -> host runs to sum instead of this binding's (a snapshot's
        copies of them in node memory, which stay as they are until handed over); ``destinations`` (where
        ``copies``): item -> the address of each of its device runs' copy, copied by the same launch (None
        returned, nothing started, where the kernel cannot store there: misaligned), by ``programs`` of the
        kernel (None: its default)."""
        raise NotImplementedError


class FusedRunSums(RunSums):
    """One launch per call (``kernel``: the compiled kernel, or ``sum64_kernel.chunk_sums`` interpreted on
    CPU), which also copies the runs where given ``destinations``. The table is built and uploaded once,
    from page-locked memory without waiting, on the stream current at construction (a later call's stream
    orders after it: the copy stream waits for the training stream before the first copy of a save); a
    copy's offsets (a few bytes per chunk) are uploaded by the call, from page-locked memory."""

    copies = True

    def __init__(self, runs, device, kernel):
        super().__init__(runs, device)
        self.kernel = kernel
        self.table = ChunkTable(runs)
        self._pin = torch.device(device).type == "cuda"
        rows = torch.from_numpy(self.table.rows)
        self._staged = rows.pin_memory() if self._pin else rows  # (kept: the upload reads it after this returns)
        self._rows = torch.empty(rows.shape, dtype=torch.int64, device=device)
        self._rows.copy_(self._staged, non_blocking=True)

    def start(self, items, landed=None, destinations=None, programs=None) -> PendingSums | None:
        from megatron_pec.integrity.sum64_kernel import launch

        index, wanted = self.table.index, list(items)
        deltas = None
        if destinations is not None:
            offsets = self.table.deltas(destinations)
            if offsets is None:
                return None
            offsets = torch.from_numpy(offsets)
            deltas = (offsets.pin_memory() if self._pin else offsets).to(self.device, non_blocking=True)
        # (page-locked from torch's caching host allocator: reused only once the upload reading it is done)
        selected = torch.zeros(len(index), dtype=torch.uint8, pin_memory=self._pin)
        selected.numpy()[[index[item] for item in wanted]] = 1
        partials = torch.empty((len(self.table), 2), dtype=torch.int64, device=self.device)
        if len(self.table):
            launch(self.kernel, self._rows, partials, selected.to(self.device, non_blocking=True), deltas, programs)
        host = torch.empty(partials.shape, dtype=torch.int64, pin_memory=self._pin)
        host.copy_(partials, non_blocking=True)
        table = self.table

        def totals() -> dict[str, tuple[int, int]]:
            values = table.item_totals(host.numpy()).tolist()
            return {item: (values[table.index[item]][0] & MASK, values[table.index[item]][1] & MASK)
                    for item in wanted}

        return PendingSums(totals)


class StockRunSums(RunSums):
    """Stock torch operations, about fifteen launches per run (where Triton gives no kernel); the
    constants they read are uploaded once."""

    def __init__(self, runs, device):
        super().__init__(runs, device)
        self._constants = DeviceSums.constants(device)

    def start(self, items, landed=None, destinations=None, programs=None) -> PendingSums:
        wanted = list(items)
        sums = DeviceSums(self.device, self._constants)
        for item in wanted:
            for tensor, offset in self.runs[item]:
                sums.add(item, tensor, offset)
        result = sums.result()
        host = torch.empty(result.shape, dtype=result.dtype, pin_memory=torch.device(self.device).type == "cuda")
        host.copy_(result, non_blocking=True)

        def totals() -> dict[str, tuple[int, int]]:
            values = host.tolist()
            # (an item without runs here sums to zero, as in the reference)
            return {item: tuple(v & MASK for v in values[sums.items[item]]) if item in sums.items else (0, 0)
                    for item in wanted}

        return PendingSums(totals)


class HostRunSums(RunSums):
    """numpy over host tensors, computed by whoever reads the digests (the tensors must not change before:
    a snapshot passes its copies in node memory as ``landed``)."""

    def start(self, items, landed=None, destinations=None, programs=None) -> PendingSums:
        wanted = list(items)
        runs = {**self.runs, **(landed or {})}

        def totals() -> dict[str, tuple[int, int]]:
            return {item: host_totals(runs.get(item, ())) for item in wanted}

        return PendingSums(totals)


def host_totals(pairs) -> tuple[int, int]:
    """(A, B) of an item's runs ``[(host tensor, byte offset within the item)]``."""
    a = b = 0
    for tensor, offset in pairs:
        acc = Sum64(offset).update(tensor.detach().reshape(-1).view(torch.uint8).numpy())
        a, b = a + acc.a, b + acc.b
    return a & MASK, b & MASK


class SplitRunSums(RunSums):
    """A binding with runs in device and in host memory: each part sums its runs, an item's sums add up."""

    def __init__(self, runs, parts: list[RunSums]):
        super().__init__(runs, None)
        self.parts = parts
        self.copies = any(part.copies for part in parts)  # (the device part's: host runs are the host's to copy)

    def start(self, items, landed=None, destinations=None, programs=None) -> PendingSums | None:
        wanted = list(items)
        pending = [part.start(wanted, landed, destinations if part.copies else None, programs)
                   for part in self.parts]
        if None in pending:
            return None

        def totals() -> dict[str, tuple[int, int]]:
            out = dict.fromkeys(wanted, (0, 0))
            for part in pending:
                for item, (a, b) in part.totals().items():
                    out[item] = ((out[item][0] + a) & MASK, (out[item][1] + b) & MASK)
            return out

        return PendingSums(totals)


__all__ = ["RunSums", "FusedRunSums", "StockRunSums", "HostRunSums", "SplitRunSums", "PendingSums", "KernelLoad",
           "on_device", "split_runs", "host_totals"]
