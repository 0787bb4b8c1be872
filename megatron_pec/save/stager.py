"""Save step 3, snapshot: copying a rank's live optimizer state into a node-memory slot, and its checksums.

One ``Stager`` per trainer owns everything a copy needs and nothing else touches: the copy stream
and its events (GPU), the page-locked node-memory mappings, and the copy plan - per item, the runs of
slices that are contiguous on both sides (``coalesce``), built once per binding of the live views and
viewed in whichever region the item goes to. A snapshot is staged in steps (``begin``, ``copy`` of some
items into the regions chosen for them, ``copy`` of more, ``finish``), and ``finish`` returns a
``StagedCopy``, a future (PyTorch DCP's
``AsyncStager``: "copy started" is the return, "copy safe" is ``done()`` / ``wait()``) that also
yields the items' checksums (``sums()``).

Checksums are computed where the bytes come from: on the GPU, over the live tensors, all items of a
snapshot in one kernel launch (``run_sums``; the kernel compiled and loaded at start-up by
``run_sums.KernelLoad``); two int64 partial sums per chunk travel to the host with the snapshot. Only device
memory goes to the device: runs whose live tensors are in host memory (the stateless views before the first
optimizer step, CPU-offloaded optimizer state) are copied synchronously and summed over their copies in node
memory. On CPU ranks every copy is a synchronous memcpy and the sums are computed over node memory once the
copies are done (``sum64.item_sums``), by whoever asks (the hand-over thread, off the training thread).

On the GPU the same launch also copies (``kernel_copies``, where the slots are page-locked and the GPU
addresses them as the host does): a few of the GPU's cores store every unit they sum into node memory, and
the copy engine carries nothing of a snapshot. Why: a copy engine runs what is queued on it in order, and a
training step makes small device-to-host copies of its own (Megatron's MoE layers read their token counts
on the host, ``nonzero``, ``.item()``): on an H200 each waited behind a K=all snapshot's 1.8 GB (33 ms),
every step, also with the copies issued in waves by a thread, which the training thread's hold on the GIL
starves (``scripts/gpu_copy_probe.py``, the traces of ``scripts/gpu_overhead_probe.py``). Without the kernel
(Triton cannot compile, the slots are not page-locked) the copy engine copies, in waves (``copy_waves.py``).

The training thread enqueues a fixed number of operations per snapshot whatever the number of items
and runs. On the GPU it only records an event on its stream (and, where the kernel copies, pairs none of the
runs it copies: only runs in host memory): the stager's enqueue thread makes the copy
stream wait for it and launches the copy and its sums (or issues the copy engine's copies, one
``cudaMemcpyAsync`` per run, ~8 us each on an H200, then the sums' launch) and their copy to the host, in
order, off the training thread. The training thread never waits for the device on that path: the sums'
tables are uploaded once, from page-locked memory, when a binding is made; every wait for a copy (the
hand-over, ``synchronize``, ``close``, the next optimizer step's stream) first waits for its enqueue, then
blocks on an event without spinning a core.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_pec.common import log
from megatron_pec.common.coalesce import coalesced_with_starts, run_view
from megatron_pec.common.phases import Phases
from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.integrity.checksum import first_mismatch
from megatron_pec.integrity.run_sums import KernelLoad, RunSums, kernel_load, on_device
from megatron_pec.integrity.sum64 import item_sums
from megatron_pec.memory.slot_map import POOL
from megatron_pec.memory.slots import SlotFiles
from megatron_pec.save.copy_waves import copy_in_waves


class StagedCopy:
    """The copies of one snapshot; ``done()`` once they have landed in node memory. ``enqueued``: (GPU) the
    enqueue thread's future of (a blocking event after the copies and the sums, the device's sums on their
    way to the host)."""

    def __init__(self, enqueued: Future | None = None, over_regions=None):
        self._enqueued = enqueued
        # (CPU) a function giving [(mapping, header, item)]: sums computed over node memory, by whoever asks
        self._over_regions = over_regions

    def _event(self):
        return None if self._enqueued is None else self._enqueued.result()[0]

    def done(self) -> bool:
        return self._enqueued is None or (self._enqueued.done() and self._event().query())

    def wait(self) -> None:
        """Block the calling thread until the copies have landed (a blocking event: it sleeps, no spinning)."""
        if self._enqueued is not None:
            self._event().synchronize()

    def before(self, stream) -> None:
        """Make ``stream``'s later work wait for the copies (on the device, the host does not block)."""
        if self._enqueued is not None:
            stream.wait_event(self._event())

    def sums(self) -> dict[str, str]:
        """item -> its sum64 (waits for the copies)."""
        self.wait()
        if self._enqueued is not None:
            return self._enqueued.result()[1].digests()
        out = {}
        for mapping, header, item in self._over_regions() if self._over_regions else ():
            out.update(item_sums(mapping, header, {item}))
        return out


class Staging:
    """One snapshot being copied: ``copy`` items (several times), then ``finish``. On the GPU its device runs
    are copied by the launch that sums them, at ``finish`` (``by_kernel``), or else by the copy engine."""

    def __init__(self, stager: "Stager", live: dict):
        self.stager, self.live = stager, live
        self.placed: dict[str, int] = {}  # item -> the slot it was copied into
        # (a new binding's table uploads on the training stream here, before the event its copy waits for)
        self.by_kernel = bool(stager.stream is not None and stager.kernel_copies and stager.sums(live).copies)
        self._produced = None  # (GPU) an event on the training stream after the state copied was produced

    def copy(self, placement: dict[str, int]) -> None:
        """Start copying the slices of each item of ``placement`` into the slot it names (on the GPU by the
        kernel: at ``finish``)."""
        stager = self.stager
        # (on the kernel's path the launch at ``finish`` copies the device runs: only host runs are paired here)
        paired = {item: slot for item, slot in placement.items() if stager.host_runs(item)} if self.by_kernel \
            else placement
        dst, src, host_dst, host_src = stager.pairs(paired, self.live)
        self.placed.update({item: slot for item, slot in placement.items() if item in stager.bound_items})
        if host_dst:  # (in host memory: copied here, by the host, never by a device kernel)
            with torch.no_grad():
                torch._foreach_copy_(host_dst, host_src)
        if self.by_kernel:
            if self._produced is None and any(stager.device_runs(item) for item in placement):
                self._record_produced()
            return
        if not dst:
            return
        if stager.stream is None:
            with torch.no_grad():  # (main params require grad, and autograd would record every copy)
                torch._foreach_copy_(dst, src)
            return
        if self._produced is None:
            self._record_produced()
        produced = self._produced

        def copy():
            stager.stream.wait_event(produced)
            copy_in_waves(dst, src, record=stager.record)  # (never a whole snapshot queued on the copy engine)

        stager.enqueue(copy)  # (a save skipped after this copy still has it in flight: ``Stager.close`` waits)

    def _record_produced(self) -> None:
        self._produced = torch.cuda.Event()
        self._produced.record()  # (on the training stream, after the optimizer step that produced the state)

    def drop(self, placement: dict[str, int]) -> None:
        """These items were copied for nothing (the save's agreement left them out): not part of it (on the
        GPU with the kernel, never copied)."""
        for item in placement:
            self.placed.pop(item, None)

    def finish(self) -> StagedCopy:
        """The copies started; on the GPU also the sums of every item copied, in one launch behind them (with
        the kernel: the launch that copies them)."""
        stager = self.stager
        if stager.stream is None:  # (the items' headers read by the hand-over thread, not the training thread)
            files, placed = stager.files, dict(self.placed)
            # (one at a time: thousands of experts' headers held at once would outlive the collector's youngest
            # generation and start passes over the whole heap, ~0.8 s each in a 58 x 256-expert trainer)
            return StagedCopy(over_regions=lambda: ((files.mapping(slot), files.item_header(slot, item), item)
                                                    for item, slot in placed.items()))
        landed = stager.landed(self.placed, self.live)  # (host runs: summed over their copies in node memory)
        with torch.no_grad(), torch.cuda.stream(stager.stream):  # (a new binding's table uploads on it, first)
            sums = stager.sums(self.live)
        placed, live, produced = dict(self.placed), self.live, self._produced
        if not self.by_kernel or produced is None:
            return StagedCopy(stager.enqueue(lambda: sums.start(placed, landed or None)))

        def copy_and_sum():
            stager.stream.wait_event(produced)
            destinations = {item: stager.device_destinations(slot, item, live) for item, slot in placed.items()}
            pending = sums.start(placed, landed or None, destinations, stager.copy_programs)
            if pending is None:  # (a destination the kernel cannot store to aligned: the copy engine, once)
                copy_in_waves(*stager.pairs(placed, live)[:2], record=stager.record)
                pending = sums.start(placed, landed or None)
            return pending

        return StagedCopy(stager.enqueue(copy_and_sum))


class Stager:
    """``asynchronous``: copies on a side stream with the sums on the device (default: on a GPU);
    ``kernel``: the checksum kernel's load, started by the engine at start-up (default: started here, with
    the copy stream); ``sums_for``: the item sums over the live runs (default ``RunSums.for_runs``; the
    tests count launches through their own); ``is_device``: whether a live tensor is device memory
    (default ``run_sums.on_device``; the CPU tests mark some CPU tensors as device memory)."""

    def __init__(self, files: SlotFiles, slot_slices, rank: int, asynchronous: bool | None = None,
                 sums_for=None, kernel: KernelLoad | None = None, is_device=None, kernel_copies: bool | None = None,
                 copy_programs: int | None = None):
        self.files, self.slot_slices, self.rank = files, slot_slices, rank
        if asynchronous is None:
            asynchronous = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if asynchronous else None
        self.is_device = is_device or on_device
        if kernel is None and asynchronous and sums_for is None:
            kernel = kernel_load(torch.cuda.current_device())
        self.kernel = kernel
        self._sums_for = sums_for or (lambda runs: RunSums.for_runs(runs, self.kernel, self.is_device))
        self._last = None  # a blocking event after the last work enqueued on the copy stream
        # (the copies' enqueue, in order, off the training thread)
        self._enqueuer = ThreadPoolExecutor(1, "megatron-pec copy enqueue") if asynchronous else None
        self._closed = False
        self.pinning = None
        # whether the checksum kernel also copies (None: ``pin`` decides, where the GPU addresses the
        # page-locked slots as the host does; False: --pec-copy-engine): the copy engine then carries none
        self.kernel_copies = kernel_copies
        self.copy_programs = copy_programs  # (None: the kernel's default)
        self.run_offsets: dict[str, list[int]] = {}  # item -> byte offset of each run within the item
        self._runs: dict[tuple[int, str], list] = {}  # (slot, item) -> views of its runs there (kept: a few per item)
        self._destinations: dict[tuple[int, str], list[int]] = {}  # (slot, item) -> its device runs' copy addresses
        self._runs_of = None     # the live views the runs read
        self._run_starts = None  # item -> (first slice name and size of each run, live views of the runs)
        self._host_runs: dict[str, tuple[int, ...]] = {}  # item -> its runs whose live views are host memory
        self._sums = None        # the item sums over those live views (``RunSums``)

    @property
    def asynchronous(self) -> bool:
        """Whether copies run on a copy stream (a GPU's), not on the thread that makes them."""
        return self.stream is not None

    def pin(self) -> None:
        """Page-lock the node-memory mappings so device-to-host copies run asynchronously at full speed (a
        failure is one warning; copies are then synchronous). GPU only; done at start-up."""
        if self.stream is None or not torch.cuda.is_available():
            return
        from megatron_pec.memory.pinning import SlotPinning, TorchCudart, slot_ranges

        self.pinning = SlotPinning(TorchCudart(), self.rank)
        pinned = self.pinning.pin(slot_ranges(self.files.maps))
        if self.kernel_copies is None or not pinned:  # (the kernel stores only into page-locked memory)
            self.kernel_copies = pinned and self.pinning.device_addressable()
        how = ("the checksum kernel (on a few of the GPU's cores, the copy engine left to training)"
               if self.kernel_copies else "the GPU's copy engine")
        log.info(f"snapshots are copied to node memory by {how}", rank0=True, once=True)

    def begin(self, live: dict) -> Staging:
        """A snapshot from the live views ``live``."""
        return Staging(self, live)

    def enqueue(self, work) -> Future:
        """Run ``work`` on the enqueue thread with the copy stream current, after the work given before; the
        future's result: (a blocking event after it on the copy stream, what ``work`` returned)."""
        stream = self.stream

        def run():
            with torch.no_grad(), torch.cuda.stream(stream):  # (the stream's device becomes this thread's too)
                result = work()
            event = self.record()
            self._last = event
            return event, result

        return self._submit(run)

    def record(self):
        """A blocking event after the work enqueued so far on the copy stream (waiting on it sleeps, no core
        spins)."""
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def _submit(self, run) -> Future:
        """``run`` on the enqueue thread, after the work given before. At the interpreter's exit (a save from an
        exit handler) Python has already joined that thread, every work given before done: ``run`` then runs
        here, in order still. After ``close`` nothing may be enqueued (the slots are unmapped)."""
        if self._closed:
            raise RuntimeError("megatron-pec: the stager is closed; nothing can be copied into its slots")
        if self._enqueuer is not None:
            try:
                return self._enqueuer.submit(run)
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                self._enqueuer = None
        done = Future()
        done.set_result(run())
        return done

    def synchronize(self) -> None:
        """Wait for every copy started so far (blocking, not spinning); nothing once closed (close waited)."""
        if self._closed:
            return
        self._submit(lambda: None).result()  # (what was given before has been enqueued)
        if self._last is not None:
            self._last.synchronize()

    def prepare(self, live: dict) -> None:
        """Bind ``live``: each item's runs (coalesced once) and their sums, before the first save."""
        self._bind(live)
        self.sums(live)

    @property
    def bound_items(self):
        """The items this rank holds (once bound)."""
        return self._run_starts or {}

    def pairs(self, placement: dict[str, int], live: dict) -> tuple[list, list, list, list]:
        """(destinations, sources) of the runs of ``placement``'s items in device memory, then those in host
        memory (on CPU ranks all are the first)."""
        dst, src, host_dst, host_src = [], [], [], []
        for item, slot in placement.items():
            runs = self.runs(slot, item, live)
            if runs is None:
                continue
            host = self.host_runs(item) if self.stream is not None else ()
            for i, (d, s) in enumerate(zip(*runs)):
                (host_dst if i in host else dst).append(d)
                (host_src if i in host else src).append(s)
        return dst, src, host_dst, host_src

    def device_destinations(self, slot: int, item: str, live: dict) -> list[int]:
        """The address of each of ``item``'s device runs' copy in ``slot`` (what the kernel stores to)."""
        key = (slot, item)
        addresses = self._destinations.get(key)
        if addresses is None:
            dst = self.runs(slot, item, live)[0]
            host = self.host_runs(item)
            addresses = self._destinations[key] = [t.data_ptr() for i, t in enumerate(dst) if i not in host]
        return addresses

    def device_runs(self, item: str) -> int:
        """How many of ``item``'s runs are in device memory (once bound; 0 for an item the rank does not hold)."""
        starts = self.bound_items.get(item)
        return 0 if starts is None else len(starts[0]) - len(self.host_runs(item))

    def host_runs(self, item: str) -> tuple[int, ...]:
        """Indices of ``item``'s runs whose live tensors are in host memory (once bound; mostly none)."""
        return self._host_runs.get(item, ())

    def landed(self, placed: dict[str, int], live: dict) -> dict[str, list]:
        """item -> [(its copy in node memory, byte offset within the item)] of each host run of the ``placed``
        items (what the host sums, rather than the live tensors a later optimizer step may change)."""
        out = {}
        for item, slot in placed.items():
            host = self.host_runs(item)
            if host:
                dst = self.runs(slot, item, live)[0]
                out[item] = [(dst[i], self.run_offsets[item][i]) for i in host]
        return out

    def runs(self, slot: int, item: str, live: dict) -> tuple[list, list] | None:
        """(views in ``slot``, live views) of ``item``'s runs; None for an item the rank does not hold."""
        self._bind(live)
        starts = self._run_starts.get(item)
        if starts is None:
            return None
        key = (slot, item)
        dst = self._runs.get(key)
        if dst is None:
            if len(self._runs) > 4 * len(self._run_starts):
                self._runs.clear()  # (regions move between items: keep the recent pairs only)
                self._destinations.clear()
            views = self.files.item_views(slot, item)
            names, numels, _ = starts
            dst = self._runs[key] = [run_view(views[name], numel) for name, numel in zip(names, numels)]
        return dst, starts[2]

    def _bind(self, live: dict) -> None:
        """Coalesce every item's slices once per binding of the live views (none is kept of an old
        binding: it would keep the replaced tensors alive). Runs are the same in every region an item may
        be in (its bytes are laid out alike everywhere): coalesced in one, viewed in any."""
        if self._runs_of is live:
            return
        self._runs, self._destinations, self._runs_of, self._sums = {}, {}, live, None
        first_region = {}
        pairs: dict[str, tuple[list, list, list]] = {}
        for s in self.slot_slices:
            if s.item not in first_region:
                first_region[s.item] = self.files.item_views(0 if s.item == NON_EXPERT else POOL, s.item)
            dst, src, names = pairs.setdefault(s.item, ([], [], []))
            dst.append(first_region[s.item][s.name])
            src.append(live[s.name])
            names.append(s.name)
        self._run_starts, self.run_offsets, self._host_runs = {}, {}, {}
        for item, (dst, src, names) in pairs.items():
            run_dst, run_src, starts = coalesced_with_starts(dst, src)
            self._run_starts[item] = ([names[i] for i in starts], [t.numel() for t in run_dst], run_src)
            host = tuple(i for i, t in enumerate(run_src) if not self.is_device(t))
            if host:
                self._host_runs[item] = host
            offsets, at = [], 0
            for t in run_dst:
                offsets.append(at)
                at += t.numel() * t.element_size()
            self.run_offsets[item] = offsets

    def sums(self, live: dict) -> RunSums:
        """The item sums over the runs of ``live`` (built once per binding, as the runs; a new binding's table
        uploads on the current stream)."""
        self._bind(live)
        if self._sums is None:
            self._sums = self._sums_for({item: list(zip(src, self.run_offsets[item]))
                                         for item, (_, _, src) in self._run_starts.items()})
        return self._sums

    def bind_sums(self, live: dict, phases: Phases) -> RunSums:
        """``sums(live)``, timed (the kernel's load and the chunk table: built once per binding)."""
        with phases("binding the device sums"):
            return self.sums(live)

    def checked(self, live: dict, expected: dict[str, tuple[str, str]], phases: Phases) -> str | None:
        """Items restored into ``live``, checked where they landed: their sums equal ``expected`` (item ->
        (sum64, where it was read)); else what does not."""
        pending = self.bind_sums(live, phases).start(expected)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return first_mismatch(expected, pending.digests(), "checked on the device after the copy")

    def runs_of(self, item: str) -> list | None:
        """The runs ``item`` coalesced into (their first slices' names), once bound (tests look)."""
        return None if self._run_starts is None or item not in self._run_starts else self._run_starts[item][0]

    def close(self) -> None:
        """Wait for every copy enqueued (a skipped save's too: no snapshot waits for it), forget the copy plan
        (it holds views of the slots) and unpin: before the slots are unmapped."""
        self.synchronize()
        self._last = None
        if self._enqueuer is not None:
            self._enqueuer.shutdown()
            self._enqueuer = None
        self._closed = True
        self._runs, self._destinations, self._runs_of, self._run_starts, self._sums = {}, {}, None, None, None
        if self.pinning is not None:
            self.pinning.unpin_all()
            self.pinning = None
