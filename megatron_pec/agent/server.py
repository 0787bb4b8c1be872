"""The node agent: one process per node that persists snapshots, commits checkpoints and owns node memory.

Started detached by a trainer (or by hand with ``python -m megatron_pec agent``),
it outlives trainer crashes so their snapshots stay in node memory. It never
imports torch or Megatron. Phases:

5. persist  for each announced snapshot, in arrival order: check the slot and,
            for persistent saves, write the rank file (tmp, fsync, rename); record
            the slot in node memory (``memory.py``) with the items it wrote, so a
            restore never waits for phase 7 (it reads the others from older slots).
6. commit   when all local ranks of an iteration are persisted, write this node's
            marker; whichever node completes last writes manifest and tracker.
7. carry    copy the experts the snapshot did not write forward from the rank's
            newest complete slot (``carry.py``), record the slot again, release the
            snapshot and grant the trainer the slots it may overwrite now. Carries
            wait while other snapshots queue up for phases 5-6, so they never delay
            a commit, and while a trainer restores (from its Settle to its Begin, at
            most RESTORE_HOLD_S), so they never slow a restore down.

Protocol (``protocol.py`` records, newline-delimited JSON over ``<node dir>/agent.sock``):
a trainer sends ``Hello`` (answered ``Ready``), ``Begin`` (answered ``Begun`` with its
first slot grants), then ``SnapshotReady`` per snapshot (answered ``Released``, with an
error if persisting failed, and new grants), ``Flush`` (answered ``Flushed`` once all
earlier work is done), ``Settle`` (answered ``Flushed`` once every earlier snapshot is
recorded: what a restore needs; at once, not behind queued carries, when all are),
``Detach`` or ``Stop``. A slot belongs to the trainer only while granted; announcing a
snapshot hands it back. A trainer left with no slot (all
held for recovery or a replica push) is sent ``Granted`` as soon as one is free again.
A failed persist is reported and the agent keeps serving.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from megatron_pec import faults, log, manifest
from megatron_pec.agent import jobs
from megatron_pec.agent.carry import carry_forward
from megatron_pec.agent.committer import Committer
from megatron_pec.agent.cpu import FILE as CPU_LEDGER, CpuLedger
from megatron_pec.agent.grants import GrantBook
from megatron_pec.agent.memory import INDEX, NodeMemory
from megatron_pec.agent.persist import check_and_persist
from megatron_pec.agent.replication import Replication
from megatron_pec.protocol import (Begin, Begun, Detach, Flush, Flushed, Granted, Hello, JobInfo, ProtocolError,
                                   RankFile, Ready, Record, Released, Settle, SlotRecord, SnapshotReady, Stop,
                                   decode_message)
from megatron_pec.slots import SlotCache, slot_path
from megatron_pec.stformat import FormatError
from megatron_pec.storage import PosixStorage

SOCKET = "agent.sock"
PIDFILE = "agent.pid"
LOCKFILE = "agent.lock"  # held by a trainer starting an agent, and by an agent from its last job to its exit
GRANT_CHECK_S = 0.25  # how often an idle agent looks for a slot to give a trainer that holds none
RESTORE_HOLD_S = 5.0  # carries wait for a restore (Settle to Begin) at most this long

_LINKS = itertools.count()


@dataclass
class Link:
    """One trainer's connection: who it is, which timeline it writes, which slots it holds."""

    conn: socket.socket
    rank: int
    job: JobInfo
    run: str | None = None            # set by Begin
    granted: set[int] = field(default_factory=set)
    serial: int = field(default_factory=lambda: next(_LINKS))  # unlike id(), never reused

    def begin(self, run: str) -> None:
        """The trainer writes ``run`` from now on; it dropped its grants when it sent Begin."""
        self.run, self.granted = run, set()

    def take(self, slots: list[int]) -> None:
        self.granted.update(slots)

    def give_back(self, slot: int) -> None:
        self.granted.discard(slot)


class Agent:
    """The server: connections, the worker loop, and the order of phases 5 to 7. What node memory
    holds is ``memory``'s, grants are ``grants``', commits ``committer``'s, replication
    ``replication``'s."""

    def __init__(self, directory: str, node_rank: int, idle_timeout: float, keep_shm: bool):
        self.directory, self.node_rank = directory, node_rank
        self.idle_timeout, self.keep_shm = idle_timeout, keep_shm
        self.storage = PosixStorage()
        self.slots = SlotCache()                        # slot mappings and tables, kept across snapshots
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.unrecorded: collections.Counter = collections.Counter()  # rank -> snapshots (and pulls) not yet recorded
        self.restoring: dict[int, float] = {}           # rank -> until when its restore holds carries back
        self.send_locks: dict[socket.socket, threading.Lock] = {}     # the worker and a client thread both answer
        self.links: dict[int, Link] = {}                # rank -> its current trainer
        self.served: dict[int, Link] = {}               # rank -> its latest trainer, connected or not
        self.detached: set[int] = set()
        self.planned_exit = False                       # every trainer detached cleanly
        self.replication = Replication(directory, self.storage)  # started once a job asks for it
        self.memory = NodeMemory.read(directory)        # changed only by the worker thread
        self.grants = GrantBook()
        self.committer = Committer(directory, self.storage, self.slots)
        self.pending_work = False  # a job is queued or running
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.cpu = CpuLedger(directory)                 # the worker's CPU time by phase (benchmarks)

    # ---- lifecycle -------------------------------------------------------------------------------
    def serve(self) -> int:
        log.use_agent_prefix()
        os.makedirs(self.directory, exist_ok=True)
        self._remove_stale_tmp()
        sock_path = os.path.join(self.directory, SOCKET)
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(sock_path)
        server.listen(64)
        server.settimeout(0.5)
        with open(os.path.join(self.directory, PIDFILE) + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(self.directory, PIDFILE) + ".tmp", os.path.join(self.directory, PIDFILE))
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        worker = threading.Thread(target=self._work, daemon=True)
        worker.start()
        log.info(f"serving {self.directory} (node {self.node_rank})")
        while not self.stopping.is_set():
            try:
                conn, _ = server.accept()
                threading.Thread(target=self._client, args=(conn,), daemon=True).start()
            except socket.timeout:
                pass
            self._check_idle()
        with open(os.path.join(self.directory, LOCKFILE), "w") as lock:
            # A trainer that wants an agent now waits until this one has persisted and cleaned up,
            # instead of starting a second one that this cleanup would then pull the memory from under.
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.jobs.put(jobs.Shutdown())
            worker.join(timeout=300)
            server.close()
            os.unlink(sock_path)  # no longer serving: a trainer must not find a socket to connect to
            if self.planned_exit:
                self.committer.persist_newest(self.served, self.memory)
            self.replication.close()
            self._cleanup()
        return 0

    def _check_idle(self) -> None:
        with self.lock:
            busy = bool(self.links) or not self.jobs.empty() or self.pending_work
            everyone_left = bool(self.served) and set(self.served) <= self.detached and not self.links
        if busy:
            self.last_activity = time.monotonic()
        elif everyone_left:
            log.info("all trainers detached cleanly; exiting")
            self.planned_exit = True
            self.stopping.set()
        elif time.monotonic() - self.last_activity > self.idle_timeout:
            log.info(f"no trainer for {self.idle_timeout:.0f}s; exiting")
            self.stopping.set()

    def _cleanup(self) -> None:
        for name in (SOCKET, PIDFILE):
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        if not self.keep_shm:
            for name in os.listdir(self.directory):
                if ".slot" in name or name in (INDEX, CPU_LEDGER):
                    os.unlink(os.path.join(self.directory, name))
            self.replication.clear()
            log.info("removed node-memory slots")

    def _remove_stale_tmp(self) -> None:
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))

    # ---- connections ----------------------------------------------------------------------------
    def _client(self, conn: socket.socket) -> None:
        link = None
        try:
            for line in conn.makefile("r"):
                msg = decode_message(line)
                if isinstance(msg, Hello):
                    link = self._hello(conn, msg)
                elif link is None and not isinstance(msg, Stop):
                    raise ProtocolError(f"{msg.KIND} before hello")
                elif isinstance(msg, Settle):
                    self._settle(link)
                elif isinstance(msg, (Begin, SnapshotReady, Flush)):
                    with self.lock:
                        self.pending_work = True
                        if isinstance(msg, SnapshotReady):
                            self.unrecorded[link.rank] += 1
                    self.jobs.put(jobs.Resume(link, msg) if isinstance(msg, Begin) else
                                  jobs.Persist(link, msg) if isinstance(msg, SnapshotReady) else jobs.Flush(link))
                elif isinstance(msg, Detach):
                    with self.lock:
                        self.detached.add(link.rank)
                elif isinstance(msg, Stop):
                    self.stopping.set()
        except (OSError, ValueError) as exc:
            log.info(f"connection from rank {link.rank if link else None} broke: {exc}")
        finally:
            with self.lock:
                if link is not None and self.links.get(link.rank) is link:
                    del self.links[link.rank]
                    self.restoring.pop(link.rank, None)
                self.send_locks.pop(conn, None)
            conn.close()

    def _hello(self, conn: socket.socket, msg: Hello) -> Link:
        link = Link(conn, msg.rank, msg.job)
        with self.lock:
            self.links[msg.rank] = link  # a new trainer: grants of the old one are void
            self.served[msg.rank] = link
            self.detached.discard(msg.rank)
        self._send(conn, Ready(os.getpid()))
        if msg.job.replicas and msg.job.num_nodes > 1:
            # After Ready, before this trainer's next message is read: the pull is the first job of
            # this trainer, and a failure here cannot break its handshake.
            self.replication.start(msg.job)
            if not self.memory.slots.get(msg.rank):  # e.g. a replacement node: ask the peers
                with self.lock:
                    self.pending_work = True
                    self.unrecorded[msg.rank] += 1  # a restore waits for what the pull brings
                self.jobs.put(jobs.Pull(link))
        return link

    def _send(self, conn: socket.socket, msg: Record) -> None:
        with self.lock:
            lock = self.send_locks.setdefault(conn, threading.Lock())
        with lock:  # whole lines: the worker and the connection's own thread may answer at once
            try:
                conn.sendall((msg.dumps() + "\n").encode())
            except OSError:
                pass  # the trainer is gone; its snapshot is still recorded

    def _settle(self, link: Link) -> None:
        """A restore starts: carries wait for its Begin (``_restore_running``). Answered at once when
        every snapshot announced for the rank is recorded and a pull from peers' replicas for it has
        ended (what a restore needs), not queued behind carries and commits; else in order."""
        with self.lock:
            self.restoring[link.rank] = time.monotonic() + RESTORE_HOLD_S
            settled = self.unrecorded[link.rank] == 0
            self.pending_work |= not settled
        if settled:
            self._send(link.conn, Flushed())
        else:
            self.jobs.put(jobs.Settle(link))

    def _restore_running(self) -> bool:
        """A trainer of this node is restoring (between its Settle and its Begin): the CPU and memory
        bandwidth a carry would take are its, on a small node (carries wait; no restore needs them)."""
        with self.lock:
            now = time.monotonic()
            return any(until > now for until in self.restoring.values())

    # ---- the worker: phases 5 to 7 in order -------------------------------------------------------
    def _work(self) -> None:
        """Jobs in arrival order. A snapshot's carry (phase 7) waits while other snapshots queue up
        to be persisted, so it never delays another rank's commit, and while a trainer restores;
        carries keep their order (each one's base is the slot the previous one completed), and a
        flush or begin waits for them."""
        carries: collections.deque[jobs.Carry] = collections.deque()
        while True:
            held = bool(carries) and self._restore_running()
            try:
                job = self.jobs.get_nowait() if carries and not held else self.jobs.get(timeout=GRANT_CHECK_S)
            except queue.Empty:
                if not carries:
                    self._grant_starved()
                if not carries or held:
                    continue
                job = carries.popleft()
            if isinstance(job, (jobs.Shutdown, jobs.Flush)):
                while carries:
                    self._carry(carries.popleft())
                if isinstance(job, jobs.Shutdown):
                    return
                self._write_cpu_ledger()
                self._send(job.link.conn, Flushed())
            elif isinstance(job, jobs.Carry):
                self._carry(job)
            elif isinstance(job, jobs.Persist):
                carry = self._persist(job)
                if carry is not None:
                    carries.append(carry)
            elif isinstance(job, jobs.Pull):
                try:
                    self.replication.pull(job.link.job, job.link.rank, self.memory)
                finally:
                    self._recorded(job.link.rank)
            elif isinstance(job, jobs.Settle):  # every earlier snapshot is recorded: carries may wait
                self._send(job.link.conn, Flushed())
            elif isinstance(job, jobs.Resume):
                with self.lock:
                    self.restoring.pop(job.link.rank, None)  # the restore (if any) is over
                self._send(job.link.conn, self._begin(job.link, job.msg))
                if job.msg.resumed_from:
                    self.committer.persist_resumed(job.link, job.msg.resumed_from, self.memory)
            with self.lock:  # after every step: a stale "busy" kept the agent alive forever
                self.pending_work = bool(carries) or not self.jobs.empty()

    def _persist(self, job: jobs.Persist) -> jobs.Carry | None:
        """Phases 5 and 6: check the slot and, if asked, write its rank file; record the slot (a restore
        never waits for phase 7); report to the committer. Returns the carry to run next, or None when
        the slot could not be checked or its rank file not written (reported to the trainer)."""
        link, msg = job.link, job.msg
        rank, root = link.rank, link.job.save
        self.grants.announced(link, msg, self.memory)
        self.memory.forget(rank, msg.slot)  # the old contents are gone (but for what the grant book kept)
        target = manifest.rank_file(root, msg.iteration, rank) if msg.persist else None
        persist_items = set(msg.persist_items) if msg.persist_items is not None else None
        try:
            with self.cpu("checking and writing"):
                record, file = check_and_persist(slot_path(self.directory, rank, msg.slot), msg.iteration,
                                                 link.run or "", link.job.key, persist_items, target, self.storage,
                                                 self.slots)
        except Exception as exc:  # reported to the trainer; the agent keeps serving
            if target is not None:
                self.committer.failed_persist(root, msg.iteration)
            self.memory.write()
            self._recorded(rank)
            self._release(link, msg, f"{type(exc).__name__}: {exc}")
            return None
        with self.cpu("node-memory index"):
            self.memory.record(rank, msg.slot, record)  # restorable now; phase 7 adds the carried experts
            self.memory.write()
        self._recorded(rank)
        error = None
        if target is not None:
            try:
                with self.cpu("committing"):
                    self.committer.persisted(link.job, msg.iteration, rank,
                                             RankFile(file=manifest.relative(root, target), **file))
            except Exception as exc:  # the snapshot itself is sound: it still serves node memory
                error = f"{type(exc).__name__}: {exc}"
        return jobs.Carry(link, msg, record, error)

    def _carry(self, job: jobs.Carry) -> None:
        """Phase 7: carry experts forward, record the slot, release it, grant what is free now."""
        link, msg = job.link, job.msg
        rank = link.rank
        with self.cpu("carrying"):
            record = self._carried(rank, msg.slot, job.record, link.job)
        faults.point("agent_carried", iteration=msg.iteration)
        with self.cpu("node-memory index"):
            self.memory.record(rank, msg.slot, record)
            self.memory.write()
        self.grants.completed(rank, msg.slot)
        self.replication.offer(link.job, rank, msg.slot, record, self.memory)
        self._release(link, msg, job.error)

    def _carried(self, rank: int, slot: int, record: SlotRecord, job: JobInfo) -> SlotRecord:
        """The record completed with the experts this snapshot did not write, carried from the rank's
        newest complete slot (carries run in order: every older snapshot's is done, newer ones are
        still in flight); on any failure they restore from storage."""
        in_place = self.grants.take_in_place(rank, slot)
        newest = self.memory.newest(rank, exclude=self.grants.uncarried(rank))
        if newest is None:
            return record
        verdict = self.memory.is_restorable(rank, newest[0], job.key)
        if isinstance(verdict, str):
            log.info(f"rank {rank}: the previous snapshot {verdict}; the experts iteration {record.iteration} did "
                     "not write restore from storage")
            return record
        base_record, base_header = verdict
        try:
            return carry_forward(slot_path(self.directory, rank, slot), record,
                                 slot_path(self.directory, rank, newest[0]), base_record, base_header, self.slots,
                                 in_place)
        except (OSError, FormatError, ValueError) as exc:
            log.info(f"rank {rank}: cannot carry experts forward into iteration {record.iteration}: {exc}")
            return record

    def _release(self, link: Link, msg: SnapshotReady, error: str | None) -> None:
        self.grants.released(link.rank, msg.slot)
        if error is not None:
            log.info(f"rank {link.rank} iteration {msg.iteration}: {error}")
        self._send(link.conn, Released(msg.slot, msg.iteration, error, self._grant(link)))

    def _recorded(self, rank: int) -> None:
        with self.lock:
            self.unrecorded[rank] -= 1

    # ---- grants ------------------------------------------------------------------------------------
    def _begin(self, link: Link, msg: Begin) -> Begun:
        """The trainer's timeline: abandon other runs after its resume point, then grant it the slots
        it may write (all but the newest snapshot on its timeline and those still in flight)."""
        self.memory.begin(link.rank, msg.run, msg.resumed_from)
        self.memory.write()
        link.begin(msg.run)
        return Begun(self._grant(link))

    def _grant(self, link: Link) -> list[int]:
        if link.run is None or self.links.get(link.rank) is not link:
            return []  # a trainer that has not begun, or has been replaced, gets nothing
        kept = self._newest_committed(link) | self.replication.busy(link.rank)  # (being sent to a peer)
        return self.grants.grant(link, self.memory, kept)

    def _grant_starved(self) -> None:
        """Trainers holding no slot and with nothing in flight hear of none until told: a slot held
        for a replica push or as the newest committed one may have become free since."""
        with self.lock:
            links = list(self.links.values())
        for link in links:
            if link.granted or self.grants.uncarried(link.rank):
                continue
            grants = self._grant(link)
            if grants:
                self._send(link.conn, Granted(grants))

    def _newest_committed(self, link: Link) -> set[int]:
        """The slot of the rank's newest snapshot that is committed on storage: kept, so that after a
        node loss the survivors restore the iteration the lost node restores from storage from memory,
        whatever the ratio of snapshot and persist intervals."""
        root = link.job.save
        kept = self.memory.newest(link.rank, lambda r: self.storage.exists(manifest.manifest_path(root, r.iteration)))
        return {kept[0]} if kept else set()

    def _write_cpu_ledger(self) -> None:
        try:
            self.cpu.write()
        except OSError as exc:  # (only the benchmarks read it)
            log.info(f"cannot write {self.cpu.path}: {exc}")


def main(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool) -> int:
    return Agent(directory, node_rank, idle_timeout, keep_shm).serve()
