"""The one checkpoint schedule every method of ``benchmarks.gpu`` follows, as data.

A method with a node-memory tier (megatron-pec, DLRover) checkpoints every iteration and persists every
``PERSIST_EVERY``-th of those checkpoints; a method whose only tier is storage (``torch_dist`` async) is run
twice, checkpointing every iteration and every ``PERSIST_EVERY`` iterations (each checkpoint a persist).
The example trainer's Megatron flags and the benchmark worker's loop are both derived from here, so
neither can drift from the other.
"""

from __future__ import annotations

from dataclasses import dataclass

PERSIST_EVERY = 20

MEMORY, PERSIST = "memory", "persist"  # what a checkpoint writes: node memory only, or also storage


@dataclass(frozen=True)
class Schedule:
    """A checkpoint every ``checkpoint_every`` iterations; every ``persist_every``-th iteration's is persisted
    (Megatron's ``--non-persistent-save-interval`` and ``--save-interval``)."""

    checkpoint_every: int
    persist_every: int

    def action(self, iteration: int) -> str | None:
        """What iteration ``iteration`` (counted from 1) saves: ``PERSIST``, ``MEMORY`` or None."""
        if iteration % self.persist_every == 0:
            return PERSIST
        if iteration % self.checkpoint_every == 0:
            return MEMORY
        return None

    def plan(self, iterations: int) -> list[tuple[int, str]]:
        """(iteration, action) of every checkpoint in ``iterations`` iterations."""
        return [(i, a) for i in range(1, iterations + 1) if (a := self.action(i)) is not None]

    @property
    def label(self) -> str:
        if self.checkpoint_every == self.persist_every:
            return "every iteration" if self.checkpoint_every == 1 else f"every {self.checkpoint_every}"
        return f"every iteration, persist every {self.persist_every}"

    def megatron_flags(self) -> list[str]:
        """The flags that make Megatron's (and the example trainer's) loop save on this schedule."""
        return ["--non-persistent-save-interval", str(self.checkpoint_every), "--save-interval",
                str(self.persist_every)]


def schedules(has_memory: bool) -> list[Schedule]:
    """The schedules a method runs: one with a memory tier, two for storage alone."""
    if has_memory:
        return [Schedule(1, PERSIST_EVERY)]
    return [Schedule(1, 1), Schedule(PERSIST_EVERY, PERSIST_EVERY)]
