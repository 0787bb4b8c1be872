"""The node agent's writer thread: rank files and commits, beside the worker that records snapshots.

A persist takes as long as storage needs for the rank's state (seconds to minutes); memory-only
snapshots keep arriving every iteration meanwhile. The worker records each snapshot as it arrives and
hands its rank file to this thread, in arrival order; the regions a write still has to read stay
pinned, and are handed back item by item as it reads them (``HandBack``: the dense state first). A
write's result goes back to the worker as a job (``jobs.Written``): the
worker owns node memory and every answer to a trainer. While the agent serves, commits are made here
only (``committer.py``), in the order the writes end; at a planned exit, after both threads stopped,
the agent's own thread persists what storage still lacks.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from megatron_pec.agent import jobs
from megatron_pec.agent.committer import Committer, MemoryCopy
from megatron_pec.agent.persist import CheckedSnapshot, write_rank_file
from megatron_pec.common import log
from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import RankFile, SnapshotReady


@dataclass(frozen=True)
class Write:
    """The rank file of a persistent snapshot the worker recorded."""

    link: object                 # the announcing trainer's ``trainers.Link``
    msg: SnapshotReady
    checked: CheckedSnapshot


@dataclass(frozen=True)
class WriteFromMemory:
    """A snapshot held only in node memory, persisted after a restart restored it."""

    link: object
    copy: MemoryCopy
    why: str
    generation: str


@dataclass(frozen=True)
class Failed:
    """A persistent snapshot failed its check: that save of the iteration is never committed."""

    root: str
    iteration: int
    generation: str


@dataclass(frozen=True)
class Drain:
    """Answer (through the worker) once every write queued before has ended."""

    link: object


class HandBack:
    """The items of a write still to be read, told to the worker as they shrink (the dense state at once,
    then at most every ``EVERY_S``): it pins only those, so snapshots may overwrite the rest."""

    EVERY_S = 0.02

    def __init__(self, tell_worker, rank: int, iteration: int, generation: str, items):
        self.tell_worker, self.rank, self.iteration, self.generation = tell_worker, rank, iteration, generation
        self.left = set(items)
        self.told = time.monotonic()

    def done(self, item: str) -> None:
        self.left.discard(item)
        now = time.monotonic()
        if not self.left or item == NON_EXPERT or now - self.told >= self.EVERY_S:
            self.told = now
            self.tell_worker(jobs.Progress(self.rank, self.iteration, self.generation, frozenset(self.left)))


class Writer:
    def __init__(self, directory: str, slots, cpu, tell_worker: Callable[[object], None]):
        self.slots, self.cpu, self.tell_worker = slots, cpu, tell_worker
        self.committer = Committer(directory, slots)
        self.queue: queue.Queue = queue.Queue()
        self._unfinished = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="writer")
        self._thread.start()

    def put(self, job) -> None:
        with self._lock:
            self._unfinished += 1
        self.queue.put(job)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._unfinished > 0

    def stop(self, timeout: float) -> None:
        """Finish every write queued, then stop (the committer is the caller's afterwards)."""
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._do(job)
            except Exception as exc:  # said; the writer goes on with the next job
                log.info(f"writer: {type(job).__name__} failed: {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._unfinished -= 1

    def _do(self, job) -> None:
        """One job; a write's result always goes back to the worker (a trainer waits for its release)."""
        if isinstance(job, Write):
            error, committable = "the writer failed (see the node agent's log)", False
            try:
                error, committable = self._write(job)
            finally:
                self.tell_worker(jobs.Written(job.link, job.msg, error, committable))
        elif isinstance(job, WriteFromMemory):
            try:
                self.committer.persist_from_memory(job.link, job.copy, job.why, job.generation)
            finally:
                self.tell_worker(jobs.WrittenFromMemory(job.link.rank, job.copy.record.iteration))
        elif isinstance(job, Failed):
            self.committer.failed_persist(job.root, job.iteration, job.generation)
        elif isinstance(job, Drain):
            self.committer.purge.wait()  # a flush answers once the tidying after earlier commits ran too
            self.tell_worker(jobs.Drained(job.link))

    def _write(self, job: Write) -> tuple[str | None, bool]:
        """Write and commit: (the error a trainer hears, if any; whether the save may still commit)."""
        link, msg = job.link, job.msg
        checkpoints = link.checkpoints
        try:
            target = checkpoints.fresh_rank_file(msg.iteration, link.rank, msg.generation)
            keep = job.checked.kept(set(msg.persist_items) if msg.persist_items is not None else None)
            progress = HandBack(self.tell_worker, link.rank, msg.iteration, msg.generation, keep)
            with self.cpu("writing"):
                file = write_rank_file(job.checked, keep, target, checkpoints.storage,
                                       self.committer.locator(link.rank, msg.slot, msg.places), self.cpu, progress.done)
        except Exception as exc:  # reported to the trainer; the agent keeps serving
            self.committer.failed_persist(checkpoints.root, msg.iteration, msg.generation)
            return f"{type(exc).__name__}: {exc}", False
        try:
            with self.cpu("committing"):
                committable = self.committer.persisted(checkpoints, link.job, msg.iteration, link.rank,
                                                       RankFile(file=checkpoints.relative(target), **file),
                                                       msg.generation)
        except Exception as exc:  # the snapshot itself is sound: it still serves node memory
            return f"{type(exc).__name__}: {exc}", False
        return None, committable


__all__ = ["Writer", "Write", "WriteFromMemory", "Failed", "Drain"]
