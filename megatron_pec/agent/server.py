"""The node agent: one process per node that persists snapshots and commits checkpoints.

Started detached by a trainer (or by hand with ``python -m megatron_pec agent``),
it outlives trainer crashes so their snapshots stay in node memory. It never
imports torch or Megatron. Phases:

5. persist  for each announced snapshot, in arrival order: check the slot and,
            for persistent saves, write the rank file (tmp, fsync, rename).
6. commit   when all local ranks of an iteration are persisted, write this node's
            marker; whichever node completes last writes manifest and tracker.
7. carry    copy the experts the snapshot did not write forward from the previous
            slot (``carry.py``), record the slot and its per-item crcs in
            ``slots.json``, and release it to its trainer. Carries wait while other
            snapshots queue up for phases 5-6, so they never delay a commit.

Protocol (newline-delimited JSON over ``<node dir>/agent.sock``): trainer sends
``hello``, ``snapshot``, ``flush``, ``detach``, ``stop``; the agent answers
``hello`` with ``ready``, each ``snapshot`` with ``released`` (``error`` set if it
failed) and ``flush`` with ``flushed`` once all earlier work is done.
A failed persist is reported and the agent keeps serving.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import signal
import socket
import sys
import threading
import time

from megatron_pec import faults, manifest
from megatron_pec.agent.carry import carry_forward
from megatron_pec.agent.persist import check_and_persist
from megatron_pec.slots import INDEX, read_index, slot_path
from megatron_pec.stformat import FormatError
from megatron_pec.storage import PosixStorage

SOCKET = "agent.sock"
PIDFILE = "agent.pid"


def log(message: str) -> None:
    print(f"[megatron-pec agent {os.getpid()}] {message}", file=sys.stderr, flush=True)


class Agent:
    def __init__(self, directory: str, node_rank: int, idle_timeout: float, keep_shm: bool):
        self.directory, self.node_rank = directory, node_rank
        self.idle_timeout, self.keep_shm = idle_timeout, keep_shm
        self.storage = PosixStorage()
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.clients: dict[int, socket.socket] = {}   # rank -> connection
        self.detached: set[int] = set()
        self.index: dict[str, dict] = self._load_index()
        self.pending: dict[tuple[str, int], dict] = {}  # (save root, iteration) -> {rank: file entry}
        self.failed: set[tuple[str, int]] = set()
        self.pending_work = False  # a job is queued or running
        self.last_activity = time.monotonic()
        self.stopping = threading.Event()

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
        self.jobs.put(None)
        worker.join(timeout=300)
        server.close()
        self._cleanup()
        return 0

    def _check_idle(self) -> None:
        with self.lock:
            busy = bool(self.clients) or not self.jobs.empty() or self.pending_work
            everyone_left = self.detached and not self.clients
        if busy:
            self.last_activity = time.monotonic()
        elif everyone_left:
            log("all trainers detached cleanly; exiting")
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
                if ".slot" in name or name == INDEX:
                    os.unlink(os.path.join(self.directory, name))
            log("removed node-memory slots")

    def _remove_stale_tmp(self) -> None:
        for name in os.listdir(self.directory):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(self.directory, name))

    # ---- connections ----------------------------------------------------------------------------
    def _client(self, conn: socket.socket) -> None:
        rank = None
        try:
            for line in conn.makefile("r"):
                msg = json.loads(line)
                kind = msg["type"]
                if kind == "hello":
                    rank = msg["rank"]
                    with self.lock:
                        self.clients[rank] = conn
                        self.detached.discard(rank)
                    self._send(conn, {"type": "ready", "pid": os.getpid()})
                elif kind in ("snapshot", "flush"):
                    with self.lock:
                        self.pending_work = True
                    self.jobs.put((conn, msg))
                elif kind == "detach":
                    with self.lock:
                        self.detached.add(rank)
                elif kind == "stop":
                    self.stopping.set()
        except (OSError, ValueError) as exc:
            log(f"connection from rank {rank} broke: {exc}")
        finally:
            with self.lock:
                if rank is not None and self.clients.get(rank) is conn:
                    del self.clients[rank]
            conn.close()

    def _send(self, conn: socket.socket, msg: dict) -> None:
        try:
            conn.sendall((json.dumps(msg) + "\n").encode())
        except OSError:
            pass  # the trainer is gone; its snapshot is still recorded

    # ---- phases 5 to 7 ---------------------------------------------------------------------------
    def _work(self) -> None:
        """Jobs in arrival order. A snapshot's carry (phase 7) waits while other snapshots queue
        up to be persisted, so it never delays another rank's commit; carries keep their order
        (each one's base is the slot the previous one completed), and a flush waits for them."""
        carries: collections.deque = collections.deque()
        while True:
            try:
                job = self.jobs.get_nowait() if carries else self.jobs.get()
            except queue.Empty:
                job = "carry"
            if job is None:
                while carries:
                    self._finish(*carries.popleft())
                return
            if job == "carry":
                self._finish(*carries.popleft())
            elif job[1]["type"] == "flush":  # everything queued before it is done
                while carries:
                    self._finish(*carries.popleft())
                self._send(job[0], {"type": "flushed"})
            else:
                conn, msg = job
                try:
                    carries.append((conn, msg, *self._persist(msg)))
                except Exception as exc:  # reported to the trainer; the agent keeps serving
                    self._send(conn, self._released(msg, f"{type(exc).__name__}: {exc}"))
            with self.lock:  # after every step: a stale "busy" kept the agent alive forever
                self.pending_work = bool(carries) or not self.jobs.empty()

    def _released(self, msg: dict, error: str | None) -> dict:
        reply = {"type": "released", "slot": msg["slot"], "iteration": msg["iteration"]}
        if error is not None:
            reply["error"] = error
            log(f"rank {msg['rank']} iteration {msg['iteration']}: {error}")
        return reply

    def _persist(self, msg: dict) -> tuple[dict, str | None]:
        """Phases 5 and 6; returns the slot's record (completed by ``_finish``) and the commit's
        error, if any. Raises if the slot cannot be checked or its rank file not written."""
        rank, slot, iteration = msg["rank"], msg["slot"], msg["iteration"]
        self.index.setdefault(str(rank), {}).pop(str(slot), None)  # the old contents are gone
        root = msg.get("save")
        target = manifest.rank_file(root, iteration, rank) if msg.get("persist") else None
        persist_items = set(msg["persist_items"]) if msg.get("persist_items") is not None else None
        try:
            record = check_and_persist(slot_path(self.directory, rank, slot), iteration, persist_items,
                                       target, self.storage)
        except Exception:
            if target is not None:
                self.failed.add((root, iteration))
            self._write_index()
            raise
        entry = record.pop("file", None)
        if target is None:
            return record, None
        try:
            self._node_progress(root, iteration, rank, entry, msg)
        except Exception as exc:  # the snapshot itself is sound: it still serves node memory
            return record, f"{type(exc).__name__}: {exc}"
        return record, None

    def _finish(self, conn: socket.socket, msg: dict, record: dict, error: str | None) -> None:
        """Phase 7: carry experts forward, record the slot, release it to its trainer."""
        rank, slot = msg["rank"], msg["slot"]
        self._carry(rank, slot_path(self.directory, rank, slot), record, msg.get("carry"))
        faults.point("agent_carried", iteration=msg["iteration"])
        self.index.setdefault(str(rank), {})[str(slot)] = record
        self._write_index()
        self._send(conn, self._released(msg, error))

    def _carry(self, rank: int, path: str, record: dict, carry: dict | None) -> None:
        """Carry the experts this snapshot did not write forward from its base slot, if the agent
        recorded that base as the trainer expects; on any failure they restore from storage."""
        if not carry:
            return
        base = self.index.get(str(rank), {}).get(str(carry["slot"]))
        if base is None or base["iteration"] != carry["iteration"]:
            log(f"rank {rank}: previous snapshot (iteration {carry['iteration']}) is not in node memory; "
                "the experts this snapshot did not write restore from storage")
            return
        try:
            carry_forward(path, record, slot_path(self.directory, rank, carry["slot"]), base, carry["items"])
        except (OSError, FormatError, ValueError) as exc:
            log(f"rank {rank}: cannot carry experts forward into iteration {record['iteration']}: {exc}")

    def _node_progress(self, root: str, iteration: int, rank: int, entry: dict, msg: dict) -> None:
        job = (root, iteration)
        if job in self.failed:
            return
        done = self.pending.setdefault(job, {})
        done[str(rank)] = {"file": manifest.relative(root, manifest.rank_file(root, iteration, rank)), **entry}
        if len(done) < msg["local_world_size"]:
            return
        del self.pending[job]
        marker = {"iteration": iteration, "node": msg["node_rank"], "job_id": msg["job_id"],
                  "fingerprint": msg["fingerprint"], "topology": msg["topology"], "ranks": done}
        manifest.write_node_marker(root, iteration, msg["node_rank"], marker, self.storage)
        if manifest.try_commit(root, iteration, msg["num_nodes"], msg.get("keep", 0), self.storage):
            log(f"committed iteration {iteration}")

    def _write_index(self) -> None:
        tmp = os.path.join(self.directory, INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.index, f)
        os.replace(tmp, os.path.join(self.directory, INDEX))

    def _load_index(self) -> dict:
        return read_index(self.directory)


def main(directory: str, node_rank: int, idle_timeout: float, keep_shm: bool) -> int:
    return Agent(directory, node_rank, idle_timeout, keep_shm).serve()
