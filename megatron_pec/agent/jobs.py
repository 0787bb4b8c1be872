"""The node agent's work, as typed jobs: what the connections (and the writer, ``writer.py``) queue
and the worker loop runs, in arrival order, each through its handler in ``server.Agent.HANDLERS``. The
loop stops on ``Shutdown``. ``link``: the trainer's ``trainers.Link``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pec.format.protocol import Begin, SnapshotReady


@dataclass(frozen=True)
class RecordSnapshot:
    """Save step 5 for every announced snapshot, memory-only or persistent: check its header and record
    it in node memory; release a memory-only one, hand a persistent one's rank file to the writer."""

    link: object  # the announcing trainer's
    msg: SnapshotReady


@dataclass(frozen=True)
class Pull:
    """A replacement node's rank: take its newest replica from a peer's memory."""

    link: object


@dataclass(frozen=True)
class Settle:
    """Answer a restore once every snapshot announced before is recorded."""

    link: object


@dataclass(frozen=True)
class Resume:
    """The trainer's ``Begin``: its new timeline, answered with its pins."""

    link: object
    msg: Begin


@dataclass(frozen=True)
class Flush:
    """Answer once everything queued before is done."""

    link: object


@dataclass(frozen=True)
class Written:
    """The writer is done with a persistent snapshot: release it (with ``error``, if any)."""

    link: object
    msg: SnapshotReady
    error: str | None
    committable: bool = True  # no other rank file of its save failed


@dataclass(frozen=True)
class Progress:
    """A write has read every item of a persistent snapshot but ``left``: the others are handed back."""

    rank: int
    iteration: int
    generation: str
    left: frozenset


@dataclass(frozen=True)
class WrittenFromMemory:
    """The writer is done with a persist from node memory: the regions it read are free to go."""

    rank: int
    iteration: int


@dataclass(frozen=True)
class Drained:
    """Every write queued before a ``Flush`` has ended: answer it."""

    link: object


@dataclass(frozen=True)
class Repin:
    """Tell the trainers the regions they must keep now (a replica push ended)."""


@dataclass(frozen=True)
class Shutdown:
    """Stop the worker (everything queued before is done)."""


__all__ = ["RecordSnapshot", "Pull", "Settle", "Resume", "Flush", "Written", "Progress", "WrittenFromMemory", "Drained",
           "Repin", "Shutdown"]
