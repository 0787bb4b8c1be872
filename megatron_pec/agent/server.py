"""The node agent: one process per node that records and persists snapshots, commits checkpoints and
owns node memory.

Started detached by a trainer (or by hand with ``python -m megatron_pec agent``), it outlives
trainer crashes so their snapshots stay in node memory. It never imports torch or Megatron. Two
threads do its work:

5. record   the worker, for each announced snapshot in arrival order: check its header (the trainer
            wrote each item's checksum there) and record its regions in node memory (``memory.py``):
            it is restorable now, every item at its newest version. A memory-only snapshot is
            released at once: it costs the agent its header and its index entry, whatever its size.
6. persist  the writer (``writer.py``), for each persistent snapshot in arrival order: write the rank
   and     file (tmp, fsync, rename; each persisted item checked on the way); when all local ranks of
   commit   an iteration are persisted, write this node's marker; whichever node completes last writes
            manifest and tracker (``committer.py``). Snapshots keep being recorded meanwhile.
   release  the worker answers the trainer with the regions it must keep (``pins.py``) and sends the
            snapshot to the node's replica holders (``replication.py``).

Protocol (``protocol.py`` records, newline-delimited JSON over ``<node dir>/agent.sock``):
a trainer sends ``Hello`` (answered ``Ready``), ``Begin`` (answered ``Begun`` with its pins), then
``SnapshotReady`` per snapshot (answered ``Released``: recorded or not, an error if persisting
failed, the pins; a persistent snapshot once written, so answers may come out of order), ``Flush``
(answered ``Flushed`` once all earlier work is done), ``Settle`` (answered ``Flushed`` once every
earlier snapshot is recorded: what a restore needs), ``Detach`` or ``Stop``. A trainer waiting for a
region hears ``Granted`` when the pins shrink. A failed persist is reported and the agent keeps
serving.
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

from megatron_pec import faults, log
from megatron_pec.agent import jobs, writer
from megatron_pec.agent.committer import MemoryCopy
from megatron_pec.agent.cpu import FILE as CPU_LEDGER
from megatron_pec.agent.cpu import CpuLedger
from megatron_pec.agent.memory import INDEX, NodeMemory
from megatron_pec.agent.persist import check_snapshot
from megatron_pec.agent.pins import pins
from megatron_pec.agent.replication import Replication
from megatron_pec.checkpoint_dir import CheckpointDir
from megatron_pec.protocol import (
    Begin,
    Begun,
    Detach,
    Flush,
    Flushed,
    Granted,
    Hello,
    JobInfo,
    Pin,
    ProtocolError,
    Ready,
    Record,
    Released,
    Settle,
    SnapshotReady,
    Stop,
    decode_message,
)
from megatron_pec.slots import SlotCache, slot_path
from megatron_pec.storage import Storage

SOCKET = "agent.sock"
PIDFILE = "agent.pid"
LOCKFILE = "agent.lock"  # held by a trainer starting an agent, and by an agent from its last job to its exit
GRANT_CHECK_S = 0.25  # how often an idle agent looks for a slot to give a trainer that holds none

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


class Agent:
    """The server: connections, the worker loop, and the order of phases 5 and 6. What node memory
    holds is ``memory``'s, writes and commits ``writer``'s, replication ``replication``'s."""

    def __init__(self, directory: str, node_rank: int, idle_timeout: float, keep_shm: bool, storage: Storage):
        self.directory, self.node_rank = directory, node_rank
        self.idle_timeout, self.keep_shm = idle_timeout, keep_shm
        self.storage = storage
        self.slots = SlotCache()                        # slot mappings and tables, kept across snapshots
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.unrecorded: collections.Counter = collections.Counter()  # rank -> snapshots (and pulls) not yet recorded
        self.send_locks: dict[socket.socket, threading.Lock] = {}     # the worker and a client thread both answer
        self.links: dict[int, Link] = {}                # rank -> its current trainer
        self.served: dict[int, Link] = {}               # rank -> its latest trainer, connected or not
        self.detached: set[int] = set()
        self.planned_exit = False                       # every trainer detached cleanly
        # started once a job asks for it; a push that ends frees the regions it pinned
        self.replication = Replication(directory, self.storage, lambda: self.jobs.put(jobs.Repin()))
        self.memory = NodeMemory.read(directory)        # changed only by the worker thread
        self.writing: dict[int, list[Pin]] = {}         # rank -> pins of its writes in flight (the worker's)
        self.persisted: dict[int, tuple] = {}           # rank -> (run, iteration) of the newest file written
        self.pending_work = False  # a job is queued or running
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.cpu = CpuLedger(directory)                 # CPU time by phase (benchmarks)
        self.writer = writer.Writer(directory, self.slots, self.cpu, self.jobs.put)

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
            self.writer.stop(timeout=3600)  # every write queued ends (a trainer that flushed waited for them)
            server.close()
            os.unlink(sock_path)  # no longer serving: a trainer must not find a socket to connect to
            if self.planned_exit:
                self.writer.committer.persist_newest(self.served, self.memory)
            self.replication.close()
            self._cleanup()
        return 0

    def _check_idle(self) -> None:
        with self.lock:
            busy = bool(self.links) or not self.jobs.empty() or self.pending_work or self.writer.busy
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
                self.send_locks.pop(conn, None)
            conn.close()

    def _hello(self, conn: socket.socket, msg: Hello) -> Link:
        link = Link(conn, msg.rank, msg.job, CheckpointDir(msg.job.save, self.storage))
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
        """A restore starts: answered at once when every snapshot announced for the rank is recorded
        and a pull from peers' replicas for it has ended (what a restore needs), not queued behind
        commits; else in order."""
        with self.lock:
            settled = self.unrecorded[link.rank] == 0
            self.pending_work |= not settled
        if settled:
            self._send(link.conn, Flushed())
        else:
            self.jobs.put(jobs.Settle(link))

    # ---- the worker: phases 5 and 6 in order ----------------------------------------------------
    def _work(self) -> None:
        """Jobs in arrival order; when idle, tell trainers waiting for a region that pins shrank."""
        while True:
            try:
                job = self.jobs.get(timeout=GRANT_CHECK_S)
            except queue.Empty:
                self._repin()
                continue
            if isinstance(job, jobs.Shutdown):
                return
            try:
                self._do(job)
            except Exception as exc:  # (node memory full, storage unreachable): said, and the agent keeps serving
                log.info(f"{type(job).__name__} failed: {type(exc).__name__}: {exc}")
            with self.lock:  # after every step: a stale "busy" kept the agent alive forever
                self.pending_work = not self.jobs.empty()

    def _do(self, job) -> None:
        """One job; each is answered even when it fails (a trainer waits for the answer)."""
        if isinstance(job, jobs.Flush):
            self.writer.put(writer.Drain(job.link))  # answered once the writes before it ended
        elif isinstance(job, jobs.Drained):
            self._write_cpu_ledger()
            self._send(job.link.conn, Flushed())
        elif isinstance(job, jobs.Persist):
            self._record(job)
        elif isinstance(job, jobs.Written):
            self._written(job.link, job.msg, job.error, job.committable)
        elif isinstance(job, jobs.WrittenFromMemory):
            self.writing[job.rank].remove(Pin(job.iteration, None, newest=True))
            self._repin()
        elif isinstance(job, jobs.Repin):
            self._repin()
        elif isinstance(job, jobs.Pull):
            try:
                self.replication.pull(job.link.job, job.link.rank, self.memory)
            finally:
                self._recorded(job.link.rank)
        elif isinstance(job, jobs.Settle):  # every earlier snapshot is recorded
            self._send(job.link.conn, Flushed())
        elif isinstance(job, jobs.Resume):
            self._resume(job.link, job.msg)

    def _record(self, job: jobs.Persist) -> None:
        """Phase 5: check the header, record the snapshot's regions, offer it to the replicas; release it,
        or hand its rank file to the writer (released once written)."""
        link, msg = job.link, job.msg
        rank, root = link.rank, link.checkpoints.root
        try:
            with self.cpu("checking"):
                checked = check_snapshot(slot_path(self.directory, rank, msg.slot), msg.iteration, link.run or "",
                                         link.job.key, self.slots)
        except Exception as exc:  # reported to the trainer; the agent keeps serving
            if msg.persist:
                self.writer.put(writer.Failed(root, msg.iteration, msg.generation))
            self._recorded(rank)
            self._release(link, msg, False, f"{type(exc).__name__}: {exc}")
            return
        try:
            with self.cpu("node-memory index"):
                self.memory.record_snapshot(rank, msg.slot, checked.snapshot, checked.checks, msg.places, msg.stale,
                                            link.job.key)
                self.memory.write()
        except Exception as exc:  # e.g. node memory full: not restorable, said; training goes on
            if msg.persist:
                self.writer.put(writer.Failed(root, msg.iteration, msg.generation))
            self._recorded(rank)
            self._release(link, msg, False, f"cannot record it in node memory: {type(exc).__name__}: {exc}")
            return
        self._recorded(rank)
        faults.point("agent_recorded", iteration=msg.iteration)
        with self.cpu("replicating"):
            self.replication.offer(link.job, rank, msg.iteration, self.memory)
        if not msg.persist:
            self._release(link, msg, True, None)
            return
        self.writing.setdefault(rank, []).append(Pin(msg.iteration, None))
        elsewhere = {item: slot_path(self.directory, rank, slot) for item, slot in msg.places.items()}
        self.writer.put(writer.Write(link, msg, checked, elsewhere))

    def _written(self, link: Link, msg: SnapshotReady, error: str | None, committable: bool) -> None:
        self.writing[link.rank].remove(Pin(msg.iteration, None))
        if error is None and committable:
            newest = self.persisted.get(link.rank)
            # (a restart's new run resumes below the old run's iterations: its own writes count from then)
            if newest is None or newest[0] != link.run or newest[1] < msg.iteration:
                self.persisted[link.rank] = (link.run, msg.iteration)
        self._release(link, msg, True, error)

    def _release(self, link: Link, msg: SnapshotReady, recorded: bool, error: str | None) -> None:
        if error is not None:
            log.info(f"rank {link.rank} iteration {msg.iteration}: {error}")
        self._send(link.conn, Released(msg.slot, msg.iteration, error, recorded, *link.told(self._pins(link))))

    def _recorded(self, rank: int) -> None:
        with self.lock:
            self.unrecorded[rank] -= 1

    # ---- the timeline and the pins ------------------------------------------------------------------
    def _resume(self, link: Link, msg: Begin) -> None:
        """The trainer's timeline: abandon other runs after its resume point; it reads node memory's
        regions from the index, written here first. The snapshot it resumed from, if node memory holds
        it, is persisted where storage lacks it (the restore may have read it from memory), so a second
        failure does not fall back further than it: its regions are pinned before the trainer hears
        ``Begun``."""
        link.begin(msg.run)
        copy = None
        try:
            self.memory.begin(link.rank, msg.run, msg.resumed_from, link.job.key)
            self.memory.write()
            resumed = None
            if msg.resumed_from is not None:
                resumed = self.memory.newest(link.rank, lambda r: r.iteration == msg.resumed_from)
            if resumed is not None:
                copy = MemoryCopy.of(self.memory, link.rank, *resumed)
                self.writing.setdefault(link.rank, []).append(Pin(msg.resumed_from, None, newest=True))
        finally:  # answered whatever failed: the trainer waits for it
            self._send(link.conn, Begun(*link.told(self._pins(link))))
        if copy is not None:
            self.writer.put(writer.WriteFromMemory(link, copy, "resumed", f"{link.job.session}.resumed"))

    def _pins(self, link: Link) -> tuple[list[Pin], str | None]:
        """The rank's pins and, if the next snapshot must wait, why."""
        return (pins(link.rank, link.job, self.memory, link.checkpoints, self.replication.replicating(link.rank),
                     self.writing.get(link.rank, []), self.persisted.get(link.rank)),
                self.replication.hold(link.rank, link.job.replica_lag))

    def _repin(self) -> None:
        """Trainers hear of pins that changed since their last answer (a push ended, a newer iteration
        committed): one that waits for a region would not otherwise know it is free."""
        with self.lock:
            links = list(self.links.values())
        for link in links:
            if link.run is None:
                continue
            now = self._pins(link)
            if now != link.pins:
                self._send(link.conn, Granted(*link.told(now)))

    def _write_cpu_ledger(self) -> None:
        try:
            self.cpu.write()
        except OSError as exc:  # (only the benchmarks read it)
            log.info(f"cannot write {self.cpu.path}: {exc}")


def main(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool, storage: Storage) -> int:
    return Agent(directory, node_rank, idle_timeout, keep_shm, storage).serve()
