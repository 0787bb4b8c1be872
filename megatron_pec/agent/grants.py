"""Which slots each trainer may write: the agent's book of grants.

Runs in the node agent (the worker thread and the connections' threads ask it, under the agent's
lock where they share it). A slot is granted only when nothing needs its contents: not announced
and still in flight, not granted already, not the newest committed snapshot, not being sent to a
peer, and not what ``NodeMemory.grantable`` keeps (the newest snapshot; the newest complete one
while a newer one waits for its carry). The book also remembers which slots were granted to one
trainer only since the agent recorded them complete: such a slot still holds its recorded bytes
outside what that trainer says it wrote, so a carry need not copy them again (``carry.py``).
"""

from __future__ import annotations

from megatron_pec.agent.memory import NodeMemory
from megatron_pec.protocol import SlotRecord, SnapshotReady


class GrantBook:
    def __init__(self):
        self.in_flight: dict[int, set[int]] = {}  # rank -> slots announced and not yet released
        # (rank, slot) recorded complete -> serials of the links granted it since
        self.granted_since: dict[tuple[int, int], set[int]] = {}
        # (rank, slot) -> (its previous record, items written since besides the new snapshot's)
        self.in_place: dict[tuple[int, int], tuple[SlotRecord, frozenset[str]]] = {}

    def grant(self, link, memory: NodeMemory, kept: set[int]) -> list[int]:
        """The slots ``link``'s trainer may write now (``kept``: slots kept for other reasons: the newest
        committed snapshot, one being sent to a peer), recorded as granted to it."""
        in_flight = self.in_flight.get(link.rank, set())
        grants = memory.grantable(link.rank, in_flight | link.granted | kept, uncarried=in_flight)
        link.take(grants)
        for slot in grants:
            self.granted_since.get((link.rank, slot), set()).add(link.serial)
        return grants

    def announced(self, link, msg: SnapshotReady, memory: NodeMemory) -> None:
        """``link``'s trainer handed ``msg.slot`` back with a new snapshot: in flight until released.
        Keeps the slot's previous record for the carry when its bytes are still that record's outside
        what the snapshot wrote and ``msg.also_written`` (granted to this trainer only since it was
        recorded complete: another trainer, e.g. one killed mid-copy, may have written anything)."""
        key = (link.rank, msg.slot)
        link.give_back(msg.slot)
        self.in_flight.setdefault(link.rank, set()).add(msg.slot)
        previous = memory.slots.get(link.rank, {}).get(msg.slot)
        if self.granted_since.pop(key, None) == {link.serial} and previous is not None \
                and msg.also_written is not None:
            self.in_place[key] = (previous, frozenset(msg.also_written))
        else:
            self.in_place.pop(key, None)

    def take_in_place(self, rank: int, slot: int) -> tuple[SlotRecord, frozenset[str]] | None:
        return self.in_place.pop((rank, slot), None)

    def uncarried(self, rank: int) -> set[int]:
        """The rank's slots announced and not yet released (their carries pending)."""
        return self.in_flight.get(rank, set())

    def completed(self, rank: int, slot: int) -> None:
        """The slot is recorded complete: from now on, note who is granted it."""
        self.granted_since[(rank, slot)] = set()

    def released(self, rank: int, slot: int) -> None:
        self.in_flight.get(rank, set()).discard(slot)


__all__ = ["GrantBook"]
