"""Which bytes of node memory a trainer may overwrite: the regions of its slot files, item by item.

Each of a rank's three slot files has a region for every item (the dense state, each expert the rank
holds). A snapshot writes its header and dense state into one slot (its home) and each expert it
writes into a region of its choice, so a partial snapshot moves only what it wrote and nothing is
copied between slots afterwards. A region may be overwritten unless it holds something still
needed: the item's newest recorded version (what a restore reads), a version being written or
announced and not yet recorded (the agent may be reading it), or a version the agent pinned (being
sent to a peer; the newest persisted dense state, which survivors of a node loss restore). The agent
records and pins (``agent/memory.py``, ``agent/pins.py``); this book, on the trainer, follows what it
was told and chooses the regions. Per-item state is kept as arrays: a save decides in a few numpy
operations, whatever the number of experts.
"""

from __future__ import annotations

import numpy

from megatron_pec.items import NON_EXPERT
from megatron_pec.protocol import Pin
from megatron_pec.slots import NUM_SLOTS

FREE, RECORDED, PENDING = 0, 1, 2  # a region's state: holds nothing needed / a recorded version / in flight


class RegionBook:
    def __init__(self, items: list[str]):
        self.items = list(items)
        self.index = {item: i for i, item in enumerate(self.items)}
        n = len(self.items)
        self.version = numpy.full((NUM_SLOTS, n), -1, dtype=numpy.int64)  # iteration the region holds
        self.state = numpy.zeros((NUM_SLOTS, n), dtype=numpy.int8)
        self.newest = numpy.full(n, -1, dtype=numpy.int64)  # slot of each item's newest recorded version
        self.pinned = numpy.zeros((NUM_SLOTS, n), dtype=bool)
        self.pins: list[Pin] = []
        self.hold: str | None = None  # the agent's reason the next snapshot must wait (a lagging replica)
        self.pending: dict[int, list[tuple[int, int]]] = {}  # iteration announced -> its (slot, item) regions
        self.stale: dict[str, set[int]] = {}  # regions overwritten by attempts not announced yet
        self._columns = numpy.arange(n)

    # ---- what the agent says ---------------------------------------------------------------------
    def reset(self, memory, rank: int) -> None:
        """Start from what node memory holds (``agent.memory.NodeMemory``, as the agent last wrote it):
        every region on the rank's timeline is recorded, the rest free."""
        self.version[:] = -1
        self.state[:] = FREE
        self.newest[:] = -1
        self.pending, self.stale = {}, {}
        for item, (slot, _) in memory.regions(rank).items():
            if item in self.index:
                self.newest[self.index[item]] = slot
        for slot, record in memory.slots.get(rank, {}).items():
            if slot >= NUM_SLOTS:
                continue
            for item, version in record.items.items():
                i = self.index.get(item)
                if i is not None and memory.admits(rank, record.run_of(item), version) \
                        and (item != NON_EXPERT or memory.on_lineage(rank, record)):
                    self.version[slot, i] = version
                    self.state[slot, i] = RECORDED
        self._pin()

    def pin(self, pins: list[Pin], hold: str | None = None) -> None:
        """The agent's current pins and hold (they replace the earlier ones)."""
        self.pins, self.hold = list(pins), hold
        self._pin()

    def _pin(self) -> None:
        self.pinned = self._pinned(self.pins)

    def _pinned(self, pins: list[Pin]) -> numpy.ndarray:
        pinned = numpy.zeros_like(self.pinned)
        recorded = self.state == RECORDED
        for pin in pins:
            columns = self._columns if pin.items is None else \
                numpy.array([self.index[i] for i in pin.items if i in self.index], dtype=numpy.int64)
            if pin.newest:  # each item's newest recorded version up to the iteration
                versions = numpy.where(recorded & (self.version <= pin.iteration), self.version, -1)
                best = versions.argmax(axis=0)
                held = versions.max(axis=0) >= 0
                picked = columns[held[columns]]
                pinned[best[picked], picked] = True
            else:
                pinned[:, columns] |= recorded[:, columns] & (self.version[:, columns] == pin.iteration)
        return pinned

    def released(self, iteration: int, recorded: bool) -> None:
        """The agent is done with snapshot ``iteration``: its regions are recorded (each its item's newest
        version, unless a later snapshot was released first), or hold nothing."""
        for slot, i in self.pending.pop(iteration, []):
            if recorded:
                self.state[slot, i] = RECORDED
                newest = self.newest[i]
                # (a persistent snapshot is released once written: later ones may have been released first)
                if newest < 0 or self.version[newest, i] <= iteration:
                    self.newest[i] = slot
            else:
                self.state[slot, i] = FREE
                self.version[slot, i] = -1
        self._pin()

    def agent_lost(self) -> None:
        """The agent died: what it had not recorded never will be."""
        for iteration in list(self.pending):
            self.released(iteration, False)

    # ---- a snapshot ------------------------------------------------------------------------------
    def writable(self, pinned: numpy.ndarray | None = None) -> numpy.ndarray:
        """[slot, item]: whether the region may be overwritten now (``pinned``: other pins than the agent's)."""
        writable = (self.state == FREE) | (self.state == RECORDED)
        writable &= ~(self.pinned if pinned is None else pinned)
        writable[self.newest[self.newest >= 0], numpy.nonzero(self.newest >= 0)[0]] = False
        return writable

    def home(self) -> int | None:
        """The slot for the next snapshot's header and dense state: a slot whose dense region may be
        overwritten, the oldest first; None when some item has no region to go to (the snapshot must
        be skipped, or wait: whatever it plans, every item it writes needs one) or the agent holds the
        snapshot back."""
        return None if self.hold else self._home(self.writable())

    def held_by_replicas(self) -> bool:
        """There is no home only because of replication - the agent holds the snapshot back (a replica
        lags too far) or what is being sent to a peer holds the regions (``newest`` pins): the next
        snapshot waits for the replica."""
        if self.home() is not None:
            return False
        return bool(self.hold) or \
            self._home(self.writable(self._pinned([p for p in self.pins if not p.newest]))) is not None

    def _home(self, writable: numpy.ndarray) -> int | None:
        if not writable.any(axis=0).all():
            return None
        dense = self.index[NON_EXPERT]
        slots = [s for s in range(NUM_SLOTS) if writable[s, dense]]
        return min(slots, key=lambda s: self.version[s, dense])

    def place(self, home: int, items) -> dict[str, int]:
        """item -> the slot to write it into: the home where it may, else its oldest writable region."""
        writable = self.writable()
        out = {}
        for item in items:
            i = self.index[item]
            if writable[home, i]:
                out[item] = home
            else:
                slots = [s for s in range(NUM_SLOTS) if writable[s, i]]
                out[item] = min(slots, key=lambda s: self.version[s, i])
        return out

    def writing(self, iteration: int, placement: dict[str, int]) -> None:
        """These regions are about to be overwritten with ``iteration`` (said before the copy: one cut
        short changed them too)."""
        for item, slot in placement.items():
            i = self.index[item]
            self.version[slot, i] = iteration
            self.state[slot, i] = PENDING
            self.stale.setdefault(item, set()).add(slot)

    def announced(self, iteration: int, placement: dict[str, int]) -> dict[str, list[int]]:
        """Snapshot ``iteration`` (``placement``: its regions) goes to the agent; returns the regions
        overwritten since the last announcement that it does not hold (skipped attempts)."""
        regions = [(slot, self.index[item]) for item, slot in placement.items()]
        self.pending[iteration] = regions
        for item, slot in placement.items():
            self.stale.get(item, set()).discard(slot)
        stale = {item: sorted(slots) for item, slots in self.stale.items() if slots}
        self.stale = {}
        return stale

    def skipped(self, placement: dict[str, int]) -> None:
        """An attempt wrote these regions and was skipped: they hold nothing (the agent hears at the
        next announcement)."""
        for item, slot in placement.items():
            i = self.index[item]
            self.state[slot, i] = FREE
            self.version[slot, i] = -1


__all__ = ["RegionBook"]
