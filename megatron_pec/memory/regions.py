"""Which bytes of node memory a trainer may overwrite: its regions, one version of one item each.

A rank's node memory (``memory/slot_map.py``) has two dense regions (its home slots 0 and 1) and a pool of
expert regions (slot ids ``POOL + j``). A snapshot writes its header and dense state into one home
slot and each expert it saves into any pool region it may overwrite, so nothing is copied afterwards.
A region may be overwritten unless it holds something still needed: its item's newest recorded version
(what a restore reads), a version being written or announced and not yet recorded (the agent may be
reading it), or a version the agent pinned (being persisted or sent to a peer - handed back item by
item as they are done - or the newest persisted dense state, which survivors of a node loss restore).
The agent records and pins (``memory/history.py``, ``agent/pins.py``); this book, on the trainer, follows
what it was told and chooses the regions. Per-region state is kept as arrays: a save decides in a few
numpy operations, whatever the number of experts. Which regions may be overwritten is worked out when the
agent's answers change it, on the listener thread, not by the save that asks (a dozen numpy calls right
after a training step took 0.1 ms of the training thread).
"""

from __future__ import annotations

import numpy

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Pin
from megatron_pec.memory.slot_map import HOME_SLOTS, POOL

FREE, RECORDED, PENDING = 0, 1, 2  # a region's state: holds nothing needed / a recorded version / in flight


class RegionBook:
    def __init__(self, items: list[str], pool: int, homes: int = HOME_SLOTS):
        """``items``: the rank's items in slot order; ``pool``: its expert regions; ``homes``: its home slots."""
        self.items = list(items)
        self.index = {item: i for i, item in enumerate(self.items)}
        self.dense = self.index.get(NON_EXPERT, -1)
        self.homes = homes
        regions = POOL + pool
        self.holder = numpy.full(regions, -1, dtype=numpy.int64)   # item index a region holds (or is written with)
        self.version = numpy.full(regions, -1, dtype=numpy.int64)  # iteration of that version
        self.state = numpy.zeros(regions, dtype=numpy.int8)
        self.pinned = numpy.zeros(regions, dtype=bool)
        # the region of each item's newest recorded version
        self.newest = numpy.full(len(self.items), -1, dtype=numpy.int64)
        self.pins: list[Pin] = []
        self.hold: str | None = None  # the agent's reason the next snapshot must wait (a lagging replica)
        # (iteration, its regions) per snapshot announced and not yet answered, in order: the agent answers
        # in that order, and one iteration may be announced twice (a planned exit's save after its snapshot)
        self.pending: list[tuple[int, list[int]]] = []
        self.stale: dict[int, str] = {}  # regions overwritten by attempts not announced yet -> the item written
        self._refresh()

    @property
    def regions(self) -> int:
        return len(self.holder)

    # ---- what the agent says ---------------------------------------------------------------------
    def reset(self, memory, rank: int) -> None:
        """Start from what node memory holds (``memory.history.NodeMemory``, as the agent last wrote it):
        every region on the rank's timeline is recorded, the rest free."""
        self.holder[:] = -1
        self.version[:] = -1
        self.state[:] = FREE
        self.newest[:] = -1
        self.pending, self.stale = [], {}
        for slot, record in memory.slots.get(rank, {}).items():
            if slot >= self.regions:
                continue
            for item, version in record.items.items():
                i = self.index.get(item)
                if i is None or (i == self.dense) == (slot >= POOL):
                    continue  # (the dense state lies in home slots only, experts in the pool only)
                if memory.admits(rank, record.run_of(item), version) \
                        and (item != NON_EXPERT or memory.on_lineage(rank, record)):
                    self.holder[slot], self.version[slot], self.state[slot] = i, version, RECORDED
        for item, (slot, _) in memory.regions(rank).items():
            i = self.index.get(item)
            if i is not None and slot < self.regions and self.holder[slot] == i:
                self.newest[i] = slot
        self._pin()

    def pin(self, pins: list[Pin], hold: str | None = None) -> None:
        """The agent's current pins and hold (they replace the earlier ones)."""
        self.pins, self.hold = list(pins), hold
        self._pin()

    def _pin(self) -> None:
        """(every change of the agent's answers ends here: regions recorded, freed, pinned)"""
        self.pinned = self._pinned(self.pins)
        self._refresh()

    def _refresh(self) -> None:
        """What a snapshot may overwrite, worked out anew (on the listener thread, where the agent's
        answers change it: the save that asks reads it)."""
        self._writable = self._work_out_writable()
        self._next_home = self._home(self._writable)  # (what ``home`` answers, unless the agent holds back)
        pool = numpy.nonzero(self._writable[POOL:])[0] + POOL
        order = numpy.argsort(self.version[pool], kind="stable")
        self._pool_order = pool[order].tolist()  # pool regions that may be overwritten: free first, then oldest

    def _pinned(self, pins: list[Pin]) -> numpy.ndarray:
        pinned = numpy.zeros(self.regions, dtype=bool)
        recorded = self.state == RECORDED
        newest = numpy.zeros(self.regions, dtype=bool)
        newest[self.newest[self.newest >= 0]] = True
        for pin in pins:
            if pin.slots is not None:  # (exactly the regions a write or a push still reads)
                pinned[[s for s in pin.slots if 0 <= s < self.regions]] = True
                continue
            mine = recorded & (self.holder >= 0)
            if pin.items is not None:
                wanted = numpy.zeros(len(self.items) + 1, dtype=bool)
                wanted[[self.index[i] for i in pin.items if i in self.index]] = True
                mine &= wanted[self.holder]
            if pin.newest:  # each item's newest recorded version up to the iteration
                candidates = numpy.nonzero(mine & (self.version <= pin.iteration))[0]
                if len(candidates):
                    # (two versions of one iteration - a planned exit's save after its snapshot: the one
                    # recorded last is the newest, as the agent's index says)
                    order = numpy.lexsort((newest[candidates], self.version[candidates], self.holder[candidates]))
                    ranked = candidates[order]
                    last = numpy.append(self.holder[ranked][1:] != self.holder[ranked][:-1], True)
                    pinned[ranked[last]] = True
            else:
                pinned |= mine & (self.version == pin.iteration)
        return pinned

    def released(self, iteration: int, recorded: bool) -> None:
        """The agent recorded snapshot ``iteration`` (each of its regions is its item's newest version,
        unless a later snapshot was released first), or not (its regions hold nothing)."""
        at = next((n for n, (announced, _) in enumerate(self.pending) if announced == iteration), None)
        for slot in self.pending.pop(at)[1] if at is not None else []:
            i = self.holder[slot]
            if recorded:
                self.state[slot] = RECORDED
                newest = self.newest[i]
                if newest < 0 or self.version[newest] <= iteration:
                    self.newest[i] = slot
            else:
                self._free(slot)
        self._pin()

    def agent_lost(self) -> None:
        """The agent died: what it had not recorded never will be."""
        for iteration, _ in list(self.pending):
            self.released(iteration, False)

    # ---- a snapshot ------------------------------------------------------------------------------
    def writable(self, pinned: numpy.ndarray | None = None) -> numpy.ndarray:
        """[region]: whether it may be overwritten now (``pinned``: other pins than the agent's; without,
        the book's own array: read it, do not change it)."""
        return self._writable if pinned is None else self._work_out_writable(pinned)

    def _work_out_writable(self, pinned: numpy.ndarray | None = None) -> numpy.ndarray:
        writable = (self.state == FREE) | (self.state == RECORDED)
        writable &= ~(self.pinned if pinned is None else pinned)
        writable[self.newest[self.newest >= 0]] = False
        writable[self.homes:POOL] = False  # (no such home slot)
        return writable

    def home(self) -> int | None:
        """The home slot for the next snapshot's header and dense state: the home whose dense region may
        be overwritten (the older one); None when neither may (the snapshot must be skipped, or wait) or
        the agent holds the snapshot back."""
        return None if self.hold else self._next_home

    def capacity(self) -> int:
        """Experts the next snapshot can write: the pool regions it may overwrite."""
        return len(self._pool_order)

    def may_free(self) -> bool:
        """Waiting for the agent can give the pool a region: a snapshot is in flight (once recorded, its
        experts' older regions are free) or the agent pins a region that is not its expert's newest (a
        persist or a push hands it back). False: no region frees whatever the wait (each holds its expert's
        newest version), so a save must not wait."""
        if self.pending:
            return True
        held = self.pinned.copy()
        held[self.newest[self.newest >= 0]] = False
        return bool(held[POOL:].any())

    def held_by_replicas(self) -> bool:
        """There is no home only because of replication - the agent holds the snapshot back (a replica
        lags too far) or what is being sent to a peer holds the dense regions (``newest`` pins): the next
        snapshot waits for the replica."""
        if self.home() is not None:
            return False
        return bool(self.hold) or \
            self._home(self.writable(self._pinned([p for p in self.pins if not p.newest]))) is not None

    def held_by_writes(self) -> bool:
        """There is no home only because a write to storage still reads the dense regions (it hands the
        dense state back first, at once): the next snapshot waits for it."""
        if self.home() is not None:
            return False
        return self._home(self.writable(self._pinned([p for p in self.pins if p.newest]))) is not None

    def _home(self, writable: numpy.ndarray) -> int | None:
        homes = [s for s in range(self.homes) if writable[s]]
        return min(homes, key=lambda s: self.version[s]) if homes else None

    def place(self, home: int, items) -> dict[str, int]:
        """item -> the slot to write it into: the dense state to ``home``, each expert to its own pool
        region that may be overwritten, free ones first, then the oldest. Raises RuntimeError when the
        pool has fewer such regions than experts (the plan keeps within ``capacity``)."""
        experts = [item for item in items if item != NON_EXPERT]
        out = {NON_EXPERT: home} if len(experts) < len(items) else {}
        if experts:
            writable = self._pool_order
            if len(writable) < len(experts):
                raise RuntimeError(f"{len(experts)} experts to write and {len(writable)} pool regions free")
            out.update(zip(experts, writable))
        return out

    def writing(self, iteration: int, placement: dict[str, int]) -> None:
        """These regions are about to be overwritten with ``iteration`` (said before the copy: one cut
        short changed them too)."""
        for item, slot in placement.items():
            self.holder[slot], self.version[slot], self.state[slot] = self.index[item], iteration, PENDING
            self._writable[slot] = False  # (in flight; one element at a time: cheaper than one indexed write)
            self.stale[slot] = item
        # (kept up to date here, not worked out anew: the rest of this save's copy places again)
        written = set(placement.values())
        if self._next_home in written:
            self._next_home = self._home(self._writable)
        self._pool_order = [slot for slot in self._pool_order if slot not in written]

    def announced(self, iteration: int, placement: dict[str, int]) -> dict[str, list[int]]:
        """Snapshot ``iteration`` (``placement``: its regions) goes to the agent; returns the regions
        overwritten since the last announcement that it does not hold (skipped attempts), by the item
        last written into each."""
        self.pending.append((iteration, list(placement.values())))
        for slot in placement.values():
            self.stale.pop(slot, None)
        stale: dict[str, list[int]] = {}
        for slot, item in sorted(self.stale.items()):
            stale.setdefault(item, []).append(slot)
        self.stale = {}
        return stale

    def skipped(self, placement: dict[str, int]) -> None:
        """An attempt wrote these regions and was skipped: they hold nothing (the agent hears at the
        next announcement)."""
        for slot in placement.values():
            self._free(slot)
        self._refresh()

    def _free(self, slot: int) -> None:
        self.holder[slot], self.version[slot], self.state[slot] = -1, -1, FREE


__all__ = ["RegionBook"]
