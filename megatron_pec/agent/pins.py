"""Which regions of a rank's node memory the agent needs kept: its pins, sent with every answer.

Runs in the node agent. A trainer overwrites any region of its slots that is not its item's newest
recorded version, not in flight and not pinned (``regions.RegionBook``). The agent pins:

* on several nodes without replicas: the dense state of the rank's newest committed snapshot (its own
  home slot: the trainer has three), so that after a node
  loss the survivors restore from memory the iteration the lost node restores from storage, whatever
  the ratio of snapshot and persist intervals (its experts are at their newest versions anyway, or on
  storage) - or of the newest one this agent persists, from the start of its write (pinned only once the
  other nodes' agents commit it, it could be overwritten before). With replicas the lost node restores its
  newest replica instead, which the survivors hold as one of their newest snapshots; keeping a third
  one would leave snapshots no region while a push runs;
* the snapshot being sent to a peer, or waiting to be: each item at its newest version up to it, less
  the items the push has read (handed back as it goes: the dense state first);
* a snapshot being written to storage (``writer.py``): the items it has yet to read (handed back as
  the write goes), or for a persist from node memory each item at its newest version up to it.

A trainer hears the pins with every ``Begun`` and ``Released``, and unasked (``Granted``) when they
shrink while it waits for a region.
"""

from __future__ import annotations

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import Pin
from megatron_pec.memory.history import NodeMemory
from megatron_pec.store.checkpoint_dir import CheckpointDir


def pins(rank: int, job, memory: NodeMemory, checkpoints: CheckpointDir, replicating: list[Pin],
         writing: list[Pin], persisted: tuple | None) -> list[Pin]:
    """The rank's pins now (``job``: its ``JobInfo``; ``checkpoints``: its --save); ``replicating``: the
    pins of its snapshots being sent or to send; ``writing``: the pins of its writes in flight;
    ``persisted``: (run, iteration) of the newest snapshot this agent wrote the rank's file of, which may
    still commit. Pins name their regions where the agent knows them: one iteration may lie in several
    (a planned exit's save in rounds writes its dense state more than once)."""
    out = list(replicating) + list(writing)
    if not job.replicas and job.num_nodes > 1:  # (its trainer has a third home slot for it)
        # (a write in flight from its start: once the writer has read the dense state, its own pin no longer
        # holds it, and until the write ends nothing else did - a save could overwrite it mid-write)
        in_flight = {pin.iteration for pin in writing}
        committed = memory.newest(rank, lambda r: (r.run, r.iteration) == persisted or r.iteration in in_flight or
                                  checkpoints.is_committed(r.iteration))
        if committed is not None:
            out.append(Pin(committed[1].iteration, [NON_EXPERT], slots=[committed[0]]))
    return out


def reading(iteration: int, items, where: dict[str, int]) -> Pin:
    """The pin of a write or a push of snapshot ``iteration`` that has ``items`` left to read (``where``:
    item -> its region)."""
    items = sorted(items)
    return Pin(iteration, items, slots=[where[item] for item in items])


__all__ = ["pins", "reading"]
