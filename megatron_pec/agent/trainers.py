"""The trainers a node agent serves: one ``Link`` per connection, and ``Trainers``, what the agent's
connection threads and its worker share about them - who is connected, who detached, what each rank
has yet to hear recorded, whether work is queued - under one lock, and answers sent as whole lines.

Runs in the node agent (``server.py``); no torch.
"""

from __future__ import annotations

import collections
import itertools
import socket
import threading
from dataclasses import dataclass, field

from megatron_pec.format.protocol import JobInfo, Pin, Record
from megatron_pec.store.checkpoint_dir import CheckpointDir

_LINKS = itertools.count()


@dataclass
class Link:
    """One trainer's connection: who it is, which timeline it writes, the pins it heard last."""

    conn: socket.socket
    rank: int
    job: JobInfo
    checkpoints: CheckpointDir        # the job's --save
    run: str | None = None            # set by Begin
    pins: tuple = ((), None)          # (pins, hold) it heard last
    serial: int = field(default_factory=lambda: next(_LINKS))  # unlike id(), never reused

    def begin(self, run: str) -> None:
        self.run = run

    def told(self, pins: tuple[list[Pin], str | None]) -> tuple[list[Pin], str | None]:
        self.pins = pins
        return pins


class Trainers:
    def __init__(self):
        self._lock = threading.Lock()
        self._current: dict[int, Link] = {}   # rank -> its connected trainer
        self._latest: dict[int, Link] = {}    # rank -> its latest trainer, connected or not
        self._detached: set[int] = set()
        self._unrecorded: collections.Counter = collections.Counter()  # rank -> snapshots (and pulls) not recorded
        self._send_locks: dict[socket.socket, threading.Lock] = {}      # the worker and a client thread both answer
        self._work_queued = False             # a job is queued or running

    # ---- connections (their threads) ---------------------------------------------------------------
    def hello(self, link: Link) -> None:
        """A new trainer of ``link.rank``: what the old one was told is void."""
        with self._lock:
            self._current[link.rank] = link
            self._latest[link.rank] = link
            self._detached.discard(link.rank)

    def gone(self, link: Link | None, conn: socket.socket) -> None:
        with self._lock:
            if link is not None and self._current.get(link.rank) is link:
                del self._current[link.rank]
            self._send_locks.pop(conn, None)

    def detach(self, rank: int) -> None:
        with self._lock:
            self._detached.add(rank)

    def send(self, conn: socket.socket, msg: Record) -> None:
        with self._lock:
            lock = self._send_locks.setdefault(conn, threading.Lock())
        with lock:  # whole lines: the worker and the connection's own thread may answer at once
            try:
                conn.sendall((msg.dumps() + "\n").encode())
            except OSError:
                pass  # the trainer is gone; its snapshot is still recorded

    # ---- work in flight --------------------------------------------------------------------------------
    def queued(self, awaited_rank: int | None = None) -> None:
        """A job is queued; ``awaited_rank``: one whose restore must wait for it (a snapshot to record, a
        pull)."""
        with self._lock:
            self._work_queued = True
            if awaited_rank is not None:
                self._unrecorded[awaited_rank] += 1

    def recorded(self, rank: int) -> None:
        with self._lock:
            self._unrecorded[rank] -= 1

    def settled(self, rank: int) -> bool:
        """Whether everything a restore of ``rank`` waits for is recorded (if not, its answer is queued)."""
        with self._lock:
            settled = self._unrecorded[rank] == 0
            self._work_queued |= not settled
            return settled

    def done(self, more_queued: bool) -> None:
        """The worker ended a job (``more_queued``: others wait): a stale "busy" kept the agent alive forever."""
        with self._lock:
            self._work_queued = more_queued

    # ---- what the agent asks ---------------------------------------------------------------------------
    def connected(self) -> list[Link]:
        with self._lock:
            return list(self._current.values())

    def latest(self) -> dict[int, Link]:
        """Rank -> its latest trainer, connected or not."""
        with self._lock:
            return dict(self._latest)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._current) or self._work_queued

    def everyone_left(self) -> bool:
        """Every trainer served detached cleanly and none is connected: a planned exit."""
        with self._lock:
            return bool(self._latest) and set(self._latest) <= self._detached and not self._current


__all__ = ["Link", "Trainers"]
