"""The node agent: one process per node that records and persists snapshots, commits checkpoints and
owns node memory.

Started detached by a trainer (or by hand with ``python -m megatron_pec agent``), it outlives
trainer crashes so their snapshots stay in node memory. It never imports torch or Megatron. Two
threads do its work, save steps 5-7 (docs/design.md):

5. record     the worker, for each announced snapshot in arrival order: check its header (the trainer
              wrote each item's checksum there) and record its regions in node memory
              (``memory/history.py``): it is restorable now, every item at its newest version. A memory-only snapshot is
              released at once: it costs the agent its header and its index entry, whatever its size.
6. persist    the writer (``writer.py``), for each persistent snapshot in arrival order: write the rank
   and        file (tmp, fsync, rename; each persisted item checked on the way); when all local ranks of
   commit     an iteration are persisted, write this node's marker; whichever node completes last writes
              manifest and tracker (``committer.py``). Snapshots keep being recorded meanwhile; the
              worker answers the trainer with the regions it must keep (``pins.py``) once written.
7. replicate  the worker offers each recorded snapshot to the node's replica holders (``replication.py``).

The worker runs typed jobs (``jobs.py``) through one table (``Agent.HANDLERS``); the connections'
messages go through another (``Agent.MESSAGES``). Who is connected, and what each rank waits for, is
``trainers.Trainers``'.

Protocol (``format/protocol.py`` records, newline-delimited JSON over ``<node dir>/agent.sock``):
a trainer sends ``Hello`` (answered ``Ready``), ``Begin`` (answered ``Begun`` with its pins), then
``SnapshotReady`` per snapshot (answered ``Released``: recorded or not, an error if persisting
failed, the pins; a persistent snapshot once written, so answers may come out of order), ``Flush``
(answered ``Flushed`` once all earlier work is done), ``Settle`` (answered ``Flushed`` once every
earlier snapshot is recorded: what a restore needs), ``Detach`` or ``Stop``. A trainer waiting for a
region hears ``Granted`` when the pins shrink. A failed persist is reported and the agent keeps
serving.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time

from megatron_pec.agent import jobs, writer
from megatron_pec.agent.committer import MemoryCopy
from megatron_pec.agent.cpu_ledger import CpuLedger
from megatron_pec.agent.persist import check_snapshot
from megatron_pec.agent.pins import pins, reading
from megatron_pec.agent.replication import Replication
from megatron_pec.agent.trainers import Link, Trainers
from megatron_pec.common import faults, log
from megatron_pec.format.protocol import (
    Begin,
    Begun,
    Detach,
    Flush,
    Flushed,
    Granted,
    Hello,
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
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.node_files import (
    PIDFILE,
    SOCKET,
    agent_lock,
    remove_job_files,
    remove_stale_tmp,
    replace_node_file,
)
from megatron_pec.memory.slots import SlotCache, slot_path
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import Storage, open_storage

GRANT_CHECK_S = 0.25  # how often an idle agent looks for a slot to give a trainer that holds none


def listening(directory: str) -> tuple[socket.socket, str]:
    """The agent's socket in ``directory`` (one a dead agent left replaced), listening, and its path."""
    path = os.path.join(directory, SOCKET)
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(0.5)
    return server, path


def job_storage(storages: dict[str, Storage], spec: str) -> Storage:
    """The job's one storage, rebuilt from the description its trainers sent (``JobInfo.storage``) once and
    kept in ``storages``: every rank file, marker, commit, retirement and published address of the job
    goes through it."""
    storage = storages.get(spec)
    if storage is None:
        try:
            storage = storages[spec] = open_storage(spec)
        except ValueError as exc:
            log.info(f"cannot build the job's storage: {exc}")
            raise
        log.info(f"the job's storage: {storage.spec}")
    return storage


class Agent:
    """The server: connections, the worker loop, and the order of save steps 5-7. What node memory
    holds is ``memory``'s, writes and commits ``writer``'s, replication ``replication``'s, who is
    connected ``trainers``'."""

    def __init__(self, directory: str, node_rank: int, idle_timeout: float, keep_shm: bool):
        self.directory, self.node_rank = directory, node_rank
        self.idle_timeout, self.keep_shm = idle_timeout, keep_shm
        self.storages: dict[str, Storage] = {}          # a job's storage description -> the storage rebuilt from it
        self.slots = SlotCache()                        # slot mappings and tables, kept across snapshots
        self.jobs: queue.Queue = queue.Queue()
        self.trainers = Trainers()                      # shared by the connections' threads and the worker
        self.planned_exit = False                       # every trainer detached cleanly
        # started once a job asks for it; a push that ends frees the regions it pinned
        self.replication = Replication(directory, self.slots, lambda: self.jobs.put(jobs.Repin()))
        self.memory = NodeMemory.read(directory)        # changed only by the worker thread
        self.writing: dict[int, dict] = {}              # rank -> its writes in flight -> what they still read
        self.persisted: dict[int, tuple] = {}           # rank -> (run, iteration) of the newest file written
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.cpu = CpuLedger(directory)                 # CPU time by phase (benchmarks)
        self.writer = writer.Writer(directory, self.slots, self.cpu, self.jobs.put)

    # ---- lifecycle -------------------------------------------------------------------------------
    def serve(self) -> int:
        log.use_agent_prefix()
        os.makedirs(self.directory, exist_ok=True)
        remove_stale_tmp(self.directory)
        server, sock_path = listening(self.directory)
        replace_node_file(os.path.join(self.directory, PIDFILE), str(os.getpid()))
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
        with agent_lock(self.directory):
            # A trainer that wants an agent now waits until this one has persisted and cleaned up,
            # instead of starting a second one that this cleanup would then pull the memory from under.
            self.jobs.put(jobs.Shutdown())
            worker.join(timeout=300)
            self.writer.stop(timeout=3600)  # every write queued ends (a trainer that flushed waited for them)
            server.close()
            os.unlink(sock_path)  # no longer serving: a trainer must not find a socket to connect to
            kept = self.planned_exit and not self.writer.committer.persist_newest(self.trainers.latest(), self.memory)
            self.writer.committer.purge.stop(timeout=600)  # the tidying after the last commits runs before exit
            self.replication.close()
            self._cleanup(keep_memory=kept)
        return 0

    def _check_idle(self) -> None:
        if self.trainers.busy() or not self.jobs.empty() or self.writer.busy:
            self.last_activity = time.monotonic()
        elif self.trainers.everyone_left():
            log.info("all trainers detached cleanly; exiting")
            self.planned_exit = True
            self.stopping.set()
        elif time.monotonic() - self.last_activity > self.idle_timeout:
            log.info(f"no trainer for {self.idle_timeout:.0f}s; exiting")
            self.stopping.set()

    def _cleanup(self, keep_memory: bool = False) -> None:
        for name in (SOCKET, PIDFILE):
            try:
                os.unlink(os.path.join(self.directory, name))
            except OSError:
                pass
        if not self.keep_shm and not keep_memory:
            # (the lock file too: this process holds it, and a waiter then locks a new one)
            remove_job_files(self.directory)
            log.info("removed the job's node memory (all but agent.log)")

    # ---- connections: one thread each, messages through ``MESSAGES`` ----------------------------------
    def _client(self, conn: socket.socket) -> None:
        link = None
        try:
            for line in conn.makefile("r"):
                msg = decode_message(line)
                handle = self.MESSAGES.get(type(msg))
                if handle is None:
                    raise ProtocolError(f"{msg.KIND} is no message a trainer sends")
                if link is None and not isinstance(msg, (Hello, Stop)):
                    raise ProtocolError(f"{msg.KIND} before hello")
                link = handle(self, conn, link, msg) or link
        except (OSError, ValueError) as exc:
            log.info(f"connection from rank {link.rank if link else None} broke: {exc}")
        finally:
            self.trainers.gone(link, conn)
            conn.close()

    def _hello(self, conn: socket.socket, link: Link | None, msg: Hello) -> Link:
        storage = job_storage(self.storages, msg.job.storage)
        link = Link(conn, msg.rank, msg.job, CheckpointDir(msg.job.save, storage))
        self.trainers.hello(link)  # a new trainer: grants of the old one are void
        self.trainers.send(conn, Ready(os.getpid()))
        if msg.job.replicas and msg.job.num_nodes > 1:
            # After Ready, before this trainer's next message is read: the pull is the first job of
            # this trainer, and a failure here cannot break its handshake.
            self.replication.start(msg.job, storage)
            if not self.memory.slots.get(msg.rank):  # e.g. a replacement node: ask the peers
                self.trainers.queued(awaited_rank=msg.rank)  # a restore waits for what the pull brings
                self.jobs.put(jobs.Pull(link))
        return link

    def _settle(self, conn: socket.socket, link: Link, msg: Settle) -> None:
        """A restore starts: answered at once when every snapshot announced for the rank is recorded
        and a pull from peers' replicas for it has ended (what a restore needs), not queued behind
        commits; else in order."""
        if self.trainers.settled(link.rank):
            self.trainers.send(conn, Flushed())
        else:
            self.jobs.put(jobs.Settle(link))

    def _begin(self, conn: socket.socket, link: Link, msg: Begin) -> None:
        self.trainers.queued()
        self.jobs.put(jobs.Resume(link, msg))

    def _announced(self, conn: socket.socket, link: Link, msg: SnapshotReady) -> None:
        self.trainers.queued(awaited_rank=link.rank)  # a restore waits until it is recorded
        self.jobs.put(jobs.RecordSnapshot(link, msg))

    def _flush_asked(self, conn: socket.socket, link: Link, msg: Flush) -> None:
        self.trainers.queued()
        self.jobs.put(jobs.Flush(link))

    def _detach(self, conn: socket.socket, link: Link, msg: Detach) -> None:
        self.trainers.detach(link.rank)

    def _stop(self, conn: socket.socket, link: Link | None, msg: Stop) -> None:
        self.stopping.set()

    MESSAGES = {Hello: _hello, Settle: _settle, Begin: _begin, SnapshotReady: _announced, Flush: _flush_asked,
                Detach: _detach, Stop: _stop}

    def _send(self, link: Link, msg: Record) -> None:
        self.trainers.send(link.conn, msg)

    # ---- the worker: save steps 5-7 in order, jobs through ``HANDLERS`` --------------------------------
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
            try:  # each job is answered even when it fails (a trainer waits for the answer)
                self.HANDLERS[type(job)](self, job)
            except Exception as exc:  # (node memory full, storage unreachable): said, and the agent keeps serving
                log.info(f"{type(job).__name__} failed: {type(exc).__name__}: {exc}")
            self.trainers.done(more_queued=not self.jobs.empty())

    def _flush(self, job: jobs.Flush) -> None:
        self.writer.put(writer.Drain(job.link))  # answered once the writes before it ended

    def _drained(self, job: jobs.Drained) -> None:
        self.cpu.write()
        self._send(job.link, Flushed())

    def _settled(self, job: jobs.Settle) -> None:  # every earlier snapshot is recorded
        self._send(job.link, Flushed())

    def _pull(self, job: jobs.Pull) -> None:
        try:
            self.replication.pull(job.link.job, job.link.rank, self.memory)
        finally:
            self.trainers.recorded(job.link.rank)

    def _written_from_memory(self, job: jobs.WrittenFromMemory) -> None:
        self.writing[job.rank].pop(("memory", job.iteration), None)
        self._repin()

    def _record(self, job: jobs.RecordSnapshot) -> None:
        """Save step 5: check the header, record the snapshot's regions, offer it to the replicas (7);
        release it, and hand a persistent one's rank file to the writer (6; released again once written)."""
        link, msg = job.link, job.msg
        rank = link.rank
        try:
            with self.cpu("checking"):
                checked = check_snapshot(slot_path(self.directory, rank, msg.slot), msg.iteration, link.run or "",
                                         link.job.key, self.slots,
                                         self.writer.committer.locator(rank, msg.slot, msg.places))
        except Exception as exc:  # reported to the trainer; the agent keeps serving
            self._refuse(link, msg, f"{type(exc).__name__}: {exc}")
            return
        try:
            with self.cpu("node-memory index"):
                self.memory.record_snapshot(rank, msg.slot, checked.snapshot, checked.checks, msg.places, msg.stale,
                                            link.job.key)
                self.memory.write()
        except Exception as exc:  # e.g. node memory full: not restorable, said; training goes on
            self._refuse(link, msg, f"cannot record it in node memory: {type(exc).__name__}: {exc}")
            return
        self.trainers.recorded(rank)
        faults.point("agent_recorded", iteration=msg.iteration)
        with self.cpu("replicating"):
            self.replication.offer(link.job, rank, msg.iteration, self.memory)
        if not msg.persist:
            self._release(link, msg, True, None)
            return
        # Its regions stay pinned while the write reads them, handed back item by item (``jobs.Progress``):
        # the trainer hears it recorded now, and overwrites what the write has read.
        items = checked.kept(set(msg.persist_items) if msg.persist_items is not None else None)
        where = {item: msg.places.get(item, msg.slot) for item in items}
        self.writing.setdefault(rank, {})[(msg.iteration, msg.generation)] = reading(msg.iteration, items, where)
        self._release(link, msg, True, None, persisting=True)
        self.writer.put(writer.Write(link, msg, checked))

    def _refuse(self, link: Link, msg: SnapshotReady, why: str) -> None:
        """A snapshot not recorded: its persist (if asked) fails, the trainer hears why."""
        if msg.persist:
            self.writer.put(writer.Failed(link.checkpoints.root, msg.iteration, msg.generation))
        self.trainers.recorded(link.rank)
        self._release(link, msg, False, why)

    def _progress(self, job: jobs.Progress) -> None:
        writing = self.writing.get(job.rank, {})
        key = (job.iteration, job.generation)
        if key in writing:
            read = writing[key]
            writing[key] = reading(job.iteration, job.left, dict(zip(read.items, read.slots)))
            self._repin()

    def _written(self, job: jobs.Written) -> None:
        link, msg, error = job.link, job.msg, job.error
        self.writing[link.rank].pop((msg.iteration, msg.generation), None)
        if error is None and job.committable:
            newest = self.persisted.get(link.rank)
            # (a restart's new run resumes below the old run's iterations: its own writes count from then)
            if newest is None or newest[0] != link.run or newest[1] < msg.iteration:
                self.persisted[link.rank] = (link.run, msg.iteration)
        self._release(link, msg, True, error, written=True)

    def _release(self, link: Link, msg: SnapshotReady, recorded: bool, error: str | None,
                 persisting: bool = False, written: bool = False) -> None:
        if error is not None:
            log.info(f"rank {link.rank} iteration {msg.iteration}: {error}")
        self._send(link, Released(msg.slot, msg.iteration, error, recorded, *link.told(self._pins(link)),
                                  persisting=persisting, written=written))

    # ---- the timeline and the pins ------------------------------------------------------------------
    def _resume(self, job: jobs.Resume) -> None:
        """The trainer's timeline: abandon other runs after its resume point; it reads node memory's
        regions from the index, written here first. The snapshot it resumed from, if node memory holds
        it, is persisted where storage lacks it (the restore may have read it from memory), so a second
        failure does not fall back further than it: its regions are pinned before the trainer hears
        ``Begun``."""
        link, msg = job.link, job.msg
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
                self.writing.setdefault(link.rank, {})[("memory", msg.resumed_from)] = \
                    Pin(msg.resumed_from, None, newest=True)
        finally:  # answered whatever failed: the trainer waits for it
            self._send(link, Begun(*link.told(self._pins(link))))
        if copy is not None:
            self.writer.put(writer.WriteFromMemory(link, copy, "resumed", f"{link.job.session}.resumed"))

    def _pins(self, link: Link) -> tuple[list[Pin], str | None]:
        """The rank's pins and, if the next snapshot must wait, why."""
        return (pins(link.rank, link.job, self.memory, link.checkpoints, self.replication.replicating(link.rank),
                     list(self.writing.get(link.rank, {}).values()), self.persisted.get(link.rank)),
                self.replication.hold(link.rank, link.job.replica_lag))

    def _repin(self, job: jobs.Repin | None = None) -> None:
        """Trainers hear of pins that changed since their last answer (a push ended, a newer iteration
        committed): one that waits for a region would not otherwise know it is free."""
        for link in self.trainers.connected():
            if link.run is None:
                continue
            now = self._pins(link)
            if now != link.pins:
                self._send(link, Granted(*link.told(now)))

    HANDLERS = {jobs.RecordSnapshot: _record, jobs.Written: _written, jobs.Progress: _progress, jobs.Resume: _resume,
                jobs.Flush: _flush, jobs.Drained: _drained, jobs.Settle: _settled, jobs.Pull: _pull,
                jobs.WrittenFromMemory: _written_from_memory, jobs.Repin: _repin}


def main(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool) -> int:
    return Agent(directory, node_rank, idle_timeout, keep_shm).serve()
