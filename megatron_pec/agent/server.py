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
import sys
import threading
import time
from dataclasses import dataclass, field

from megatron_pec import faults, manifest
from megatron_pec.agent.carry import carry_forward
from megatron_pec.agent.cpu import FILE as CPU_LEDGER, CpuLedger
from megatron_pec.agent.memory import INDEX, JobKey, NodeMemory
from megatron_pec.agent import peers
from megatron_pec.agent.persist import check_and_persist
from megatron_pec.agent.replicas import ReplicaServer, ReplicaStore, Replicator, pull
from megatron_pec.protocol import (Begin, Begun, Detach, Flush, Flushed, Granted, Hello, JobInfo, NodeMarker,
                                   PeerAddress, ProtocolError, RankFile, Ready, Record, Released, Settle, SlotRecord,
                                   SnapshotReady, Stop, decode_message)
from megatron_pec.slots import SlotCache, slot_path
from megatron_pec.stformat import FormatError
from megatron_pec.storage import PosixStorage

SOCKET = "agent.sock"
PIDFILE = "agent.pid"
LOCKFILE = "agent.lock"  # held by a trainer starting an agent, and by an agent from its last job to its exit
GRANT_CHECK_S = 0.25  # how often an idle agent looks for a slot to give a trainer that holds none
RESTORE_HOLD_S = 5.0  # carries wait for a restore (Settle to Begin) at most this long


def log(message: str) -> None:
    print(f"[megatron-pec agent {os.getpid()}] {message}", file=sys.stderr, flush=True)


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

    @property
    def key(self) -> JobKey:
        return JobKey(self.job.job_id, self.job.fingerprint, self.job.save)

    def begin(self, run: str) -> None:
        """The trainer writes ``run`` from now on; it dropped its grants when it sent Begin."""
        self.run, self.granted = run, set()


class Agent:
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
        # (rank, slot) this agent recorded complete -> serials of the links granted it since: a slot
        # granted to one trainer only still holds its record's bytes outside what that trainer wrote
        self.granted_since: dict[tuple[int, int], set[int]] = {}
        self.in_place: dict[tuple[int, int], tuple[SlotRecord, frozenset[str]]] = {}  # see _note_in_place
        self.served: dict[int, Link] = {}               # rank -> its latest trainer, connected or not
        self.detached: set[int] = set()
        self.planned_exit = False                       # every trainer detached cleanly
        self.replicator: Replicator | None = None       # replication to peers, once a job asks for it
        self.replica_store: ReplicaStore | None = None
        self.replica_server: ReplicaServer | None = None
        self.address: PeerAddress | None = None
        self.published = False
        self.memory = NodeMemory.read(directory)        # changed only by the worker thread
        self.in_flight: dict[int, set[int]] = {}        # rank -> slots announced and not yet released
        self.pending: dict[tuple[str, int], dict] = {}  # (save root, iteration) -> {rank: RankFile}
        self.failed: set[tuple[str, int]] = set()
        self.pending_work = False  # a job is queued or running
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()
        self.cpu = CpuLedger(directory)                 # the worker's CPU time by phase (benchmarks)

    # ---- lifecycle -------------------------------------------------------------------------------
    def serve(self) -> int:
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
        log(f"serving {self.directory} (node {self.node_rank})")
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
            self.jobs.put(None)
            worker.join(timeout=300)
            server.close()
            os.unlink(sock_path)  # no longer serving: a trainer must not find a socket to connect to
            if self.planned_exit:
                self._persist_newest()
            if self.replicator is not None:
                sent = self.replicator.sent
                log(f"replication: sent {sent['snapshots']} snapshot(s) to peers, {sent['whole']} of them whole, "
                    f"{sent['bytes']} bytes")
            self._cleanup()
        return 0

    def _check_idle(self) -> None:
        with self.lock:
            busy = bool(self.links) or not self.jobs.empty() or self.pending_work
            everyone_left = bool(self.served) and set(self.served) <= self.detached and not self.links
        if busy:
            self.last_activity = time.monotonic()
        elif everyone_left:
            log("all trainers detached cleanly; exiting")
            self.planned_exit = True
            self.stopping.set()
        elif time.monotonic() - self.last_activity > self.idle_timeout:
            log(f"no trainer for {self.idle_timeout:.0f}s; exiting")
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
            if self.replica_store is not None:
                self.replica_store.clear()
            log("removed node-memory slots")

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
                    link = Link(conn, msg.rank, msg.job)
                    with self.lock:
                        self.links[msg.rank] = link  # a new trainer: grants of the old one are void
                        self.served[msg.rank] = link
                        self.detached.discard(msg.rank)
                    self._send(conn, Ready(os.getpid()))
                    if msg.job.replicas and msg.job.num_nodes > 1:
                        # After Ready, before this trainer's next message is read: the pull is the first
                        # job of this trainer, and a failure here cannot break its handshake.
                        self._start_replication(msg.job)
                        if not self.memory.slots.get(msg.rank):  # e.g. a replacement node: ask the peers
                            with self.lock:
                                self.pending_work = True
                                self.unrecorded[msg.rank] += 1  # a restore waits for what the pull brings
                            self.jobs.put((link, "pull"))
                elif link is None and not isinstance(msg, Stop):
                    raise ProtocolError(f"{msg.KIND} before hello")
                elif isinstance(msg, Settle):
                    self._settle(link, msg)
                elif isinstance(msg, (Begin, SnapshotReady, Flush)):
                    with self.lock:
                        self.pending_work = True
                        if isinstance(msg, SnapshotReady):
                            self.unrecorded[link.rank] += 1
                    self.jobs.put((link, msg))
                elif isinstance(msg, Detach):
                    with self.lock:
                        self.detached.add(link.rank)
                elif isinstance(msg, Stop):
                    self.stopping.set()
        except (OSError, ValueError) as exc:
            log(f"connection from rank {link.rank if link else None} broke: {exc}")
        finally:
            with self.lock:
                if link is not None and self.links.get(link.rank) is link:
                    del self.links[link.rank]
                    self.restoring.pop(link.rank, None)
                self.send_locks.pop(conn, None)
            conn.close()

    def _send(self, conn: socket.socket, msg: Record) -> None:
        with self.lock:
            lock = self.send_locks.setdefault(conn, threading.Lock())
        with lock:  # whole lines: the worker and the connection's own thread may answer at once
            try:
                conn.sendall((msg.dumps() + "\n").encode())
            except OSError:
                pass  # the trainer is gone; its snapshot is still recorded

    def _settle(self, link: Link, msg: Settle) -> None:
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
            self.jobs.put((link, msg))

    def _restore_running(self) -> bool:
        """A trainer of this node is restoring (between its Settle and its Begin): the CPU and memory
        bandwidth a carry would take are its, on a small node (carries wait; no restore needs them)."""
        with self.lock:
            now = time.monotonic()
            return any(until > now for until in self.restoring.values())

    # ---- phases 5 to 7 ---------------------------------------------------------------------------
    def _work(self) -> None:
        """Jobs in arrival order. A snapshot's carry (phase 7) waits while other snapshots queue
        up to be persisted, so it never delays another rank's commit; carries keep their order
        (each one's base is the slot the previous one completed), and a flush or begin waits for them."""
        carries: collections.deque = collections.deque()
        while True:
            held = bool(carries) and self._restore_running()
            try:
                job = self.jobs.get_nowait() if carries and not held else self.jobs.get(timeout=GRANT_CHECK_S)
            except queue.Empty:
                if not carries:
                    self._grant_starved()
                if not carries or held:
                    continue
                job = "carry"
            if job is None:
                while carries:
                    self._finish(*carries.popleft())
                return
            if job == "carry":
                self._finish(*carries.popleft())
            elif job[1] == "pull":
                try:
                    self._pull(job[0])
                finally:
                    self._recorded(job[0].rank)
            elif isinstance(job[1], SnapshotReady):
                link, msg = job
                self.in_flight.setdefault(link.rank, set()).add(msg.slot)
                try:
                    carries.append((link, msg, *self._persist(link, msg)))
                except Exception as exc:  # reported to the trainer; the agent keeps serving
                    self._release(link, msg, f"{type(exc).__name__}: {exc}")
            elif isinstance(job[1], (Settle, Begin)):  # every earlier snapshot is recorded: carries may wait
                link, msg = job
                if isinstance(msg, Begin):  # the restore (if any) is over
                    with self.lock:
                        self.restoring.pop(link.rank, None)
                self._send(link.conn, self._begin(link, msg) if isinstance(msg, Begin) else Flushed())
                if isinstance(msg, Begin) and msg.resumed_from:
                    self._persist_resumed(link, msg.resumed_from)
            else:  # Flush: everything queued before it is done first
                while carries:
                    self._finish(*carries.popleft())
                self._write_cpu_ledger()
                self._send(job[0].conn, Flushed())
            with self.lock:  # after every step: a stale "busy" kept the agent alive forever
                self.pending_work = bool(carries) or not self.jobs.empty()

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
        in_flight = self.in_flight.get(link.rank, set())
        busy = in_flight | link.granted | self._newest_committed(link)
        if self.replicator is not None:
            busy |= self.replicator.busy(link.rank)  # being sent to a peer
        grants = self.memory.grantable(link.rank, busy, uncarried=in_flight)
        link.granted.update(grants)
        for slot in grants:
            self.granted_since.get((link.rank, slot), set()).add(link.serial)
        return grants

    def _grant_starved(self) -> None:
        """Trainers holding no slot and with nothing in flight hear of none until told: a slot held
        for a replica push or as the newest committed one may have become free since."""
        with self.lock:
            links = list(self.links.values())
        for link in links:
            if link.granted or self.in_flight.get(link.rank):
                continue
            grants = self._grant(link)
            if grants:
                self._send(link.conn, Granted(grants))

    # ---- replication ------------------------------------------------------------------------------
    def _start_replication(self, job: JobInfo) -> None:
        """Once per agent: accept peers' replicas, publish where, send ours."""
        with self.lock:
            if self.replicator is not None:
                return
            self.replica_store = ReplicaStore(self.directory)
            self.replica_server = ReplicaServer(self.replica_store, log)
            self.address = PeerAddress(job.node_rank, peers.advertised_host(), self.replica_server.port,
                                       job.domain or f"node {job.node_rank}", os.getpid())
            self.replicator = Replicator(self.directory, job, self.storage, log)
        self._publish(job)  # storage I/O: outside the lock

    def _publish(self, job: JobInfo) -> None:
        """Tell the peers where this agent takes replicas (again at every snapshot until storage takes it)."""
        if self.published:
            return
        try:
            peers.publish(job.save, job.job_id, self.address, self.storage)
        except OSError as exc:
            log(f"replication: cannot publish this agent's address under {job.save} ({exc}); retrying at the "
                "next snapshot")
            return
        self.published = True
        domains = {n: a.domain for n, a in peers.read_peers(job.save, job.job_id, job.num_nodes, self.storage).items()}
        log(f"replication: {job.replicas} replica(s) of node {job.node_rank}'s snapshots go to node(s) "
            f"{peers.holders(job.node_rank, job.num_nodes, job.replicas, domains)} (failure domain "
            f"{self.address.domain}; address in {peers.address_path(job.save, job.job_id, job.node_rank)})")

    def _pull(self, link: Link) -> None:
        """This node's memory has nothing for the rank (a replacement node): take the rank's newest
        replica from a peer's memory, verified, as this node's own slot 0."""
        rank = link.rank
        path = slot_path(self.directory, rank, 0)
        if self.memory.slots.get(rank) or not os.path.exists(path):
            return
        result = pull(self.directory, link.job, rank, path, self.storage)
        if isinstance(result, str):
            log(f"rank {rank}: nothing pulled from peer memory ({result}); it restores from storage")
            return
        record, lineage = result
        self.memory.adopt(rank, 0, record, lineage)
        self.memory.write()
        log(f"rank {rank}: pulled iteration {record.iteration} from node {record.origin}'s memory")

    def _newest_committed(self, link: Link) -> set[int]:
        """The slot of the rank's newest snapshot that is committed on storage: kept, so that after a
        node loss the survivors restore the iteration the lost node restores from storage from memory,
        whatever the ratio of snapshot and persist intervals."""
        root = link.job.save
        kept = self.memory.newest(link.rank, lambda r: self.storage.exists(manifest.manifest_path(root, r.iteration)))
        return {kept[0]} if kept else set()

    def _persist_newest(self) -> None:
        """A planned exit (every trainer detached cleanly): persist and commit each rank's newest
        snapshot if storage has nothing as new, so the restart loses nothing."""
        for rank, link in sorted(self.served.items()):
            newest = self.memory.newest(rank)
            if newest is not None:
                self._persist_uncommitted(link, *newest, "planned exit")

    def _persist_resumed(self, link: Link, iteration: int) -> None:
        """A restart restored ``iteration`` from node memory: persist it if it never was, so a second
        failure does not fall back further than it."""
        resumed = self.memory.newest(link.rank, lambda r: r.iteration == iteration)
        if resumed is not None:
            self._persist_uncommitted(link, *resumed, "resumed")

    def _persist_uncommitted(self, link: Link, slot: int, record: SlotRecord, why: str) -> None:
        """Persist and commit a snapshot held in node memory unless storage commits it or a newer
        iteration. Only what that snapshot wrote is persisted (a rank file holds one iteration); the
        experts it carried keep their persisted versions, and a restore accounts their PLT as usual."""
        rank, root, iteration = link.rank, link.job.save, record.iteration
        committed = manifest.committed_iterations(root, self.storage)
        if committed and committed[0] >= iteration:
            return
        if self.storage.exists(manifest.node_marker(root, iteration, link.job.node_rank)):
            return  # persisted by this node already; another node's agent has yet to commit it
        self.failed.discard((root, iteration))  # a failed persist of it is retried now
        target = manifest.rank_file(root, iteration, rank)
        try:
            _, file = check_and_persist(slot_path(self.directory, rank, slot), iteration, record.run, link.key,
                                        None, target, self.storage, self.slots)
            log(f"{why}: persisted rank {rank}'s snapshot of iteration {iteration}")
            self._node_progress(link.job, iteration, rank, RankFile(file=manifest.relative(root, target), **file))
        except Exception as exc:  # storage keeps what it had: said, never hidden
            log(f"{why}: cannot persist rank {rank}'s iteration {iteration}: {type(exc).__name__}: {exc}")

    def _release(self, link: Link, msg: SnapshotReady, error: str | None) -> None:
        self.in_flight.get(link.rank, set()).discard(msg.slot)
        if error is not None:
            log(f"rank {link.rank} iteration {msg.iteration}: {error}")
        self._send(link.conn, Released(msg.slot, msg.iteration, error, self._grant(link)))

    def _persist(self, link: Link, msg: SnapshotReady) -> tuple[SlotRecord, str | None]:
        """Phases 5 and 6; returns the slot's record (completed by ``_finish``) and the commit's
        error, if any. Raises if the slot cannot be checked or its rank file not written."""
        rank, root = link.rank, link.job.save
        link.granted.discard(msg.slot)
        self._note_in_place(link, msg)
        self.memory.forget(rank, msg.slot)  # the old contents are gone (but for what _note_in_place kept)
        target = manifest.rank_file(root, msg.iteration, rank) if msg.persist else None
        persist_items = set(msg.persist_items) if msg.persist_items is not None else None
        try:
            with self.cpu("checking and writing"):
                record, file = check_and_persist(slot_path(self.directory, rank, msg.slot), msg.iteration,
                                                 link.run or "", link.key, persist_items, target, self.storage,
                                                 self.slots)
        except Exception:
            if target is not None:
                self.failed.add((root, msg.iteration))
            self.memory.write()
            self._recorded(rank)
            raise
        with self.cpu("node-memory index"):
            self.memory.record(rank, msg.slot, record)  # restorable now; phase 7 adds the carried experts
            self.memory.write()
        self._recorded(rank)
        if target is None:
            return record, None
        try:
            entry = RankFile(file=manifest.relative(root, target), **file)
            with self.cpu("committing"):
                self._node_progress(link.job, msg.iteration, rank, entry)
        except Exception as exc:  # the snapshot itself is sound: it still serves node memory
            return record, f"{type(exc).__name__}: {exc}"
        return record, None

    def _note_in_place(self, link: Link, msg: SnapshotReady) -> None:
        """Keep the slot's previous record for its carry when its bytes are still that record's
        outside what the snapshot wrote and ``msg.also_written``: this agent recorded it complete and
        granted it since to this trainer only (another trainer, e.g. one killed mid-copy, may have
        written anything)."""
        key = (link.rank, msg.slot)
        previous = self.memory.slots.get(link.rank, {}).get(msg.slot)
        if self.granted_since.pop(key, None) == {link.serial} and previous is not None \
                and msg.also_written is not None:
            self.in_place[key] = (previous, frozenset(msg.also_written))
        else:
            self.in_place.pop(key, None)

    def _recorded(self, rank: int) -> None:
        with self.lock:
            self.unrecorded[rank] -= 1

    def _finish(self, link: Link, msg: SnapshotReady, record: SlotRecord, error: str | None) -> None:
        """Phase 7: carry experts forward, record the slot, release it, grant what is free now."""
        rank = link.rank
        with self.cpu("carrying"):
            record = self._carry(rank, msg.slot, record, link.key)
        faults.point("agent_carried", iteration=msg.iteration)
        with self.cpu("node-memory index"):
            self.memory.record(rank, msg.slot, record)
            self.memory.write()
        self.granted_since[(rank, msg.slot)] = set()
        if self.replicator is not None and self.memory.on_lineage(rank, record):
            self._publish(link.job)
            self.replicator.offer(rank, slot_path(self.directory, rank, msg.slot), msg.slot, record,
                                  self.memory.lineage.get(rank, []))
        self._release(link, msg, error)

    def _carry(self, rank: int, slot: int, record: SlotRecord, job: JobKey) -> SlotRecord:
        """The record completed with the experts this snapshot did not write, carried from the rank's
        newest complete slot (carries run in order: every older snapshot's is done, newer ones are
        still in flight); on any failure they restore from storage."""
        path = slot_path(self.directory, rank, slot)
        in_place = self.in_place.pop((rank, slot), None)
        newest = self.memory.newest(rank, exclude=self.in_flight.get(rank, set()))
        if newest is None:
            return record
        verdict = self.memory.is_restorable(rank, newest[0], job)
        if isinstance(verdict, str):
            log(f"rank {rank}: the previous snapshot {verdict}; the experts iteration {record.iteration} "
                "did not write restore from storage")
            return record
        base_record, base_header = verdict
        try:
            return carry_forward(path, record, slot_path(self.directory, rank, newest[0]), base_record, base_header,
                                 self.slots, in_place)
        except (OSError, FormatError, ValueError) as exc:
            log(f"rank {rank}: cannot carry experts forward into iteration {record.iteration}: {exc}")
            return record

    def _write_cpu_ledger(self) -> None:
        try:
            self.cpu.write()
        except OSError as exc:  # (only the benchmarks read it)
            log(f"cannot write {self.cpu.path}: {exc}")

    def _node_progress(self, job: JobInfo, iteration: int, rank: int, entry: RankFile) -> None:
        key = (job.save, iteration)
        if key in self.failed:
            return
        done = self.pending.setdefault(key, {})
        done[str(rank)] = entry
        if len(done) < job.local_world_size:
            return
        del self.pending[key]
        marker = NodeMarker(iteration=iteration, node=job.node_rank, job_id=job.job_id,
                            fingerprint=job.fingerprint, topology=job.topology, ranks=done)
        manifest.write_node_marker(job.save, marker, self.storage)
        try:
            committed = manifest.try_commit(job.save, iteration, job.num_nodes, job.keep, self.storage)
        except OSError as exc:
            if not self.storage.exists(manifest.manifest_path(job.save, iteration)):
                raise
            # every node's marker was durable and another node's agent wrote the same manifest
            log(f"could not write the commit of iteration {iteration} ({exc}); another node's agent did")
            return
        if committed:
            log(f"committed iteration {iteration}")


def main(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool) -> int:
    return Agent(directory, node_rank, idle_timeout, keep_shm).serve()
