"""Phase 3, snapshot: copying a rank's live optimizer state into a node-memory slot.

One ``Stager`` per trainer owns everything a copy needs and nothing else touches: the copy stream
and its events (GPU), the page-locked slot mappings, and the copy plan - per slot and item, the
runs of slices that are contiguous on both sides (``coalesce``), built once per slot and binding
of the live views. ``stage`` starts the copies of some items into a slot and returns a
``StagedCopy``, a future that says when the bytes are in the slot (PyTorch DCP's ``AsyncStager``:
"copy started" is the return, "copy safe" is ``done()`` / ``wait()``). On CPU the copies are
synchronous memcpys and the future is done at once.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_pec.coalesce import coalesced_with_starts, run_view
from megatron_pec.slots import SlotFiles


class StagedCopy:
    """The copies ``Stager.stage`` started; ``done()`` once they have landed in the slot."""

    def __init__(self, event=None):
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block the calling thread until the copies have landed."""
        if self._event is not None:
            self._event.synchronize()

    def before(self, stream) -> None:
        """Make ``stream``'s later work wait for the copies (on the device, the host does not block)."""
        if self._event is not None:
            stream.wait_event(self._event)


DONE = StagedCopy()


class Stager:
    def __init__(self, files: SlotFiles, slot_slices, rank: int):
        self.files, self.slot_slices, self.rank = files, slot_slices, rank
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.pinning = None
        self._runs: dict[int, dict[str, tuple[list, list]]] = {}  # slot -> item -> (slot views, live views)
        self._runs_of = None     # the live views those runs read
        self._run_starts = None  # item -> (first slice name and size of each run, live views of the runs)

    def pin(self) -> None:
        """Page-lock the slot mappings so device-to-host copies run asynchronously at full speed (a
        failure is one warning; copies are then synchronous). GPU only; done at start-up."""
        if self.stream is None:
            return
        from megatron_pec.pinning import SlotPinning, TorchCudart, slot_ranges

        self.pinning = SlotPinning(TorchCudart(), self.rank)
        self.pinning.pin(slot_ranges(self.files.maps))

    def stage(self, slot: int, live: dict, items) -> StagedCopy:
        """Start copying the slices of ``items`` from ``live`` into ``slot``; the returned future
        covers these copies and every earlier one into any slot."""
        dst, src = self._copy_lists(slot, live, items)
        if not dst:
            return DONE
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # the optimizer step that produced the state
        # (no_grad: main params require grad, and autograd would record every copy)
        with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            torch._foreach_copy_(dst, src, non_blocking=True)  # one call: a large rank has 10^4-10^5 slices
        if stream is None:
            return DONE
        event = torch.cuda.Event()
        event.record(stream)
        return StagedCopy(event)

    def synchronize(self) -> None:
        """Wait for every copy started so far."""
        if self.stream is not None:
            self.stream.synchronize()

    def _copy_lists(self, slot: int, live: dict, items) -> tuple[list, list]:
        """(slot views, live views) of ``items``, item by item; none is kept of an old binding of the
        live views (it would keep the replaced tensors alive)."""
        if self._runs_of is not live:
            self._runs, self._runs_of, self._run_starts = {}, live, None
        runs = self._runs.get(slot)
        if runs is None:
            runs = self._runs[slot] = self._slot_runs(slot, live)
        picked = [item for item in items if item in runs]  # (a few of the rank's thousands)
        return [v for item in picked for v in runs[item][0]], [v for item in picked for v in runs[item][1]]

    def _slot_runs(self, slot: int, live: dict) -> dict[str, tuple[list, list]]:
        """Per item, (slot views, live views) of its runs. The first slot coalesces its slices; the
        others take the same runs at the same offsets of their own mapping (every slot has one
        layout): a view per run, not a walk over every slice."""
        views = self.files.views[slot]
        if self._run_starts is not None:
            return {item: ([run_view(views[name], numel) for name, numel in zip(names, numels)], src)
                    for item, (names, numels, src) in self._run_starts.items()}
        pairs: dict[str, tuple[list, list, list]] = {}
        for s in self.slot_slices:
            dst, src, names = pairs.setdefault(s.item, ([], [], []))
            dst.append(views[s.name])
            src.append(live[s.name])
            names.append(s.name)
        runs, self._run_starts = {}, {}
        for item, (dst, src, names) in pairs.items():
            run_dst, run_src, starts = coalesced_with_starts(dst, src)
            runs[item] = (run_dst, run_src)
            self._run_starts[item] = ([names[i] for i in starts], [t.numel() for t in run_dst], run_src)
        return runs

    def runs_of(self, slot: int) -> dict[str, tuple[list, list]] | None:
        """The copy plan of ``slot`` built so far (tests look at how the slices coalesced)."""
        return self._runs.get(slot)

    def close(self) -> None:
        """Forget the copy plan (it holds views of the slots) and unpin (before the slots are unmapped)."""
        self._runs, self._runs_of, self._run_starts = {}, None, None
        if self.pinning is not None:
            self.pinning.unpin_all()
            self.pinning = None
