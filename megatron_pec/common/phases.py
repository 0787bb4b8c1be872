"""Where the time of one save or one restore goes, phase by phase.

The engine hands a ``Phases`` to the code of a save or a restore; each part of it times itself
(``with phases("copy"): ...``, a block's wall time added to its phase). A block inside another
counts only for its own phase: the outer one gets the rest, so the phases add up to the whole. The
engine keeps the latest save's and restore's (``Engine.save_phases``, ``Engine.restore_phases``)
for its restore log line and for the benchmarks' breakdowns. Timing costs two ``perf_counter``
calls per block. While the PyTorch profiler records, each block is also a range in its trace
(``megatron-pec <phase>``), so a trace shows where a save's time goes beside the training step's.
"""

from __future__ import annotations

import contextlib
import time

import torch


def traced(name: str):
    """A range named ``megatron-pec <name>`` in the PyTorch profiler's trace while it records; else nothing."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"megatron-pec {name}")
    return contextlib.nullcontext()


class Phases:
    def __init__(self, clock=time.perf_counter):
        self.seconds: dict[str, float] = {}
        self._clock = clock
        self._open: list[list] = []  # per open block: [name, start, the time of the blocks inside it]

    # A context manager of its own, not @contextmanager: a save times nine blocks, each of which
    # would allocate a generator.
    def __call__(self, name: str) -> "Phases":
        self._open.append([name, 0.0, 0.0, None])
        return self

    def __enter__(self) -> "Phases":
        block = self._open[-1]
        if torch.autograd._profiler_enabled():
            block[3] = traced(block[0])
            block[3].__enter__()
        block[1] = self._clock()
        return self

    def __exit__(self, *exc) -> None:
        name, started, inner, trace = self._open.pop()
        if trace is not None:
            trace.__exit__(*exc)
        elapsed = self._clock() - started
        self.add(name, elapsed - inner)
        if self._open:
            self._open[-1][2] += elapsed

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self, shortest: float = 0.0005) -> str:
        """``"copy 0.004 s, verify 0.003 s, the rest 0.001 s"``: the phases of at least ``shortest``
        seconds in the order they first ended, the others summed."""
        shown = [f"{name} {s:.3f} s" for name, s in self.seconds.items() if s >= shortest]
        rest = sum(s for s in self.seconds.values() if s < shortest)
        return ", ".join(shown + ([f"the rest {rest:.3f} s"] if len(shown) < len(self.seconds) else []))


__all__ = ["Phases", "traced"]
