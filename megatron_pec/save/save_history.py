"""What this trainer process has saved and restored: what decides the saves a committed iteration never
gets twice the same way, and the save a planned exit still owes.

Identical on every rank: every rank restores the same iteration, makes the same save calls and agrees
on each save's plan (which experts it writes, of the whole model; whether it is skipped), and nothing
here depends on what one rank holds or where it read from - so each decision is the same everywhere
without a collective.
"""

from __future__ import annotations


class SaveHistory:
    def __init__(self, session: str):
        self.session = session               # this launch's id (rank 0's, shared at start-up)
        self.stepped = False                 # an optimizer step since the last save call or restore
        self.last: tuple[int, bool] | None = None  # (iteration, whether it wrote every expert) of the last save call
        self.small = None                    # the small state at the last save call (``small_state_record.Captured``)
        self.restored: int | None = None     # the iteration training resumed at, until a save call
        self.restored_here = False           # ... from the --save directory (or its node memory)
        self._persisted: dict[int, int] = {}  # iteration -> persistent saves of it by this process
        self._held: set[int] = set()          # iterations this process restored or persisted

    # ---- what happened ---------------------------------------------------------------------------
    def step(self) -> None:
        self.stepped = True

    def restore(self, iteration: int, here: bool = True) -> None:
        """Training resumes at ``iteration``; ``here``: restored from the --save directory or its node memory
        (what node memory held is persisted by the node agent where storage lacks it), not from another
        --load directory, which --save does not hold."""
        self.restored, self.restored_here, self.stepped, self.last = iteration, here, False, None
        self._held.add(iteration)

    def called(self, iteration: int, small) -> None:
        """A save of ``iteration`` was asked for (its state is ``small`` and the model's now)."""
        self.small, self.stepped, self.restored = small, False, None
        self.last = (iteration, False)  # nothing written until ``wrote``: a skipped save wrote nothing

    def wrote(self, iteration: int, every_expert: bool) -> None:
        """The save of ``iteration`` was taken; ``every_expert``: its plan wrote every expert of the model."""
        self.last = (iteration, every_expert)

    # ---- what to do --------------------------------------------------------------------------------
    def unchanged_since_restore(self, iteration: int) -> bool:
        """The state is ``iteration`` as restored (a relaunched finished job): storage holds it, or the node
        agent persists the node-memory copy it came from; saving it again would write the same bytes."""
        return not self.stepped and self.restored == iteration and self.restored_here

    def writes_every_expert(self, iteration: int) -> bool:
        """A persistent save of an iteration this process restored or persisted replaces that commit, whose
        experts at the iteration it must not drop: it writes every expert."""
        return iteration in self._held

    def generation(self, iteration: int) -> str:
        """A persistent save's generation (``manifest``): the launch, and which of its saves of the iteration."""
        self._held.add(iteration)
        n = self._persisted[iteration] = self._persisted.get(iteration, 0) + 1
        return self.session if n == 1 else f"{self.session}.{n}"

    def owed_at_exit(self) -> int | None:
        """The iteration a clean exit must save once more with every expert: the last save call's, when
        nothing was trained since and it left experts out - a partial snapshot, or a skipped one."""
        if self.last is None or self.stepped:
            return None
        iteration, every_expert = self.last
        return None if every_expert else iteration

    @property
    def exit_generation(self) -> str:
        return f"{self.session}.exit"


__all__ = ["SaveHistory"]
