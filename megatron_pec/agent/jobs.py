"""The node agent's work, as typed jobs: what the connections queue and the worker loop runs, in
arrival order (``server.Agent._work``). The loop stops on ``Shutdown``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pec.protocol import Begin, SlotRecord, SnapshotReady


@dataclass(frozen=True)
class Persist:
    """Phases 5-6 for an announced snapshot: check it, persist it if asked, record it, commit."""

    link: object  # the announcing trainer's ``server.Link``
    msg: SnapshotReady


@dataclass(frozen=True)
class Carry:
    """Phase 7 for a recorded snapshot: carry the experts it did not write, release its slot."""

    link: object
    msg: SnapshotReady
    record: SlotRecord    # as phase 5 recorded it
    error: str | None     # the commit's error, reported with the release


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
    """The trainer's ``Begin``: its new timeline, its first grants."""

    link: object
    msg: Begin


@dataclass(frozen=True)
class Flush:
    """Answer once everything queued before is done (carries included)."""

    link: object


@dataclass(frozen=True)
class Shutdown:
    """Finish the queued carries and stop the worker."""


__all__ = ["Persist", "Carry", "Pull", "Settle", "Resume", "Flush", "Shutdown"]
