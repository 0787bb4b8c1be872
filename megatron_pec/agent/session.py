"""A trainer's session with its node agent: the connection and the lease of snapshot slots.

The engine calls a session, never raw messages. Call order:

1. ``start``          start or reuse the node's agent, connect, say ``Hello``;
2. ``begin``          a new timeline (after every restore, or from scratch); its ``Begun`` is taken
                      before the next slot (``take_slot``), so a restore does not wait for it;
3. per snapshot:      ``take_slot`` (a slot the agent granted; the session reconnects to a new
                      agent first when the old one died), ``wrote`` before each copy into it,
                      then ``announce`` (the slot goes back to the agent) or ``keep`` (a skipped
                      snapshot: the slot stays this trainer's, its header says "being written");
4. ``settle``/``flush`` wait until the agent has recorded / finished everything announced;
5. ``close``          detach (a clean exit) or just leave (a crash: the agent keeps node memory).

A slot is written only while granted; every grant heard before the answer to the last ``Begin``
is void. Thread-safe: a snapshot may be announced from a background thread.
"""

from __future__ import annotations

import threading
import time
import uuid

from megatron_pec import log
from megatron_pec.agent.client import AgentClient, AgentUnavailable, ensure_agent
from megatron_pec.protocol import Begin, Begun, Flush, Flushed, Granted, Hello, Record, Released, Settle, SnapshotReady
from megatron_pec.slots import SlotGrants

PERSISTENT_SLOT_WAIT_S = 10.0  # how long a persistent save waits for a slot before it is skipped


class AgentSession:
    def __init__(self, node_dir: str, rank: int, node_rank: int, hello: Hello, *, idle_timeout: float,
                 keep_shm: bool, wait_for_slot: bool):
        self.node_dir, self.rank, self.node_rank, self.hello = node_dir, rank, node_rank, hello
        self.idle_timeout, self.keep_shm, self.wait_for_slot = idle_timeout, keep_shm, wait_for_slot
        self.client = AgentClient(node_dir, rank)
        self.grants = SlotGrants()
        self.run: str | None = None            # this process's timeline, from its first begin
        self.resumed_from: int | None = None
        self.begins_unanswered = 0             # Begins sent whose Begun has not arrived
        self.written_into: dict[int, set[str]] = {}  # slot -> items written since the agent last had it
        self.persist_errors = 0
        self._lock = threading.RLock()

    @property
    def connected(self) -> bool:
        return self.client.connected

    @property
    def agent_pid(self) -> int | None:
        return self.client.pid

    def start(self, timeout: float = 60.0) -> None:
        """Start or reuse the agent and connect; raises AgentUnavailable."""
        ensure_agent(self.node_dir, self.node_rank, self.idle_timeout, self.keep_shm, timeout=timeout)
        self.client.connect(self.hello, timeout=min(30.0, timeout))

    # ---- the timeline --------------------------------------------------------------------------------
    def begin(self, resumed_from: int | None) -> None:
        """Start this process's next timeline: snapshots of other timelines after ``resumed_from`` are
        abandoned (never restored, overwritten first)."""
        with self._lock:
            self.run, self.resumed_from = uuid.uuid4().hex[:16], resumed_from
            self._tell_timeline()

    def _tell_timeline(self) -> None:
        # (again after a reconnect: repeating it changes nothing on the agent's side)
        if not self.client.connected:
            return
        self.grants.revoke_all()
        if self.client.send(Begin(self.run, self.resumed_from)):
            self.begins_unanswered += 1

    # ---- the slot lease --------------------------------------------------------------------------------
    def take_slot(self, persistent: bool) -> tuple[int | None, str | None]:
        """(a granted slot, None) or (None, why there is none). With --pec-wait-for-slot a save waits
        for one; without, a persistent save (what the user asked to keep, e.g. the last one of
        training) waits up to PERSISTENT_SLOT_WAIT_S, a memory snapshot not at all."""
        with self._lock:
            self._collect()
            if self.run is None:
                self.begin(None)  # no load_checkpoint before: this run starts from scratch
            if not self.client.connected and not self._reconnect():
                return None, "the node agent is not running"
            self._await_begun()
            slot = self.grants.take()
            deadline = time.monotonic() + (PERSISTENT_SLOT_WAIT_S if persistent else 0.0)
            while slot is None and (self.wait_for_slot or time.monotonic() < deadline) and self.client.connected:
                self._collect(block_s=1.0)
                slot = self.grants.take()
            if slot is None:
                return None, ("all snapshot slots are still held by the node agent (being persisted or sent to a "
                              "peer, or kept for recovery); raise the save interval or pass --pec-wait-for-slot")
            return slot, None

    def keep(self, slot: int) -> None:
        """A snapshot into ``slot`` was skipped: the slot stays this trainer's (its header says "being
        written", never restorable)."""
        with self._lock:
            self.grants.add([slot])

    def wrote(self, slot: int, items) -> None:
        """``items`` are about to change in ``slot`` (said before the copy: one cut short changed them too)."""
        with self._lock:
            self.written_into.setdefault(slot, set()).update(items)

    def announce(self, slot: int, iteration: int, persistent: bool, persist_items: list[str] | None,
                 written) -> bool:
        """Hand the slot, holding the complete snapshot of ``iteration`` (``written``: its items), to the
        agent; False when the agent is gone (the snapshot is lost, the caller warns)."""
        with self._lock:
            # (only what skipped attempts wrote besides ``written``: usually nothing, the header names the rest)
            also = sorted(self.written_into.get(slot, set()) - set(written))
            if not self.client.send(SnapshotReady(slot, iteration, persistent, persist_items, also)):
                self.grants.revoke_all()
                return False
            self.written_into.pop(slot, None)  # the agent's now; its next grant starts clean
            return True

    # ---- waiting for the agent -------------------------------------------------------------------------
    def settle(self, timeout: float = 300.0) -> None:
        """Until the agent has recorded every snapshot announced so far (what a restore reads)."""
        self._request(Settle(), timeout)

    def flush(self, timeout: float = 300.0) -> None:
        """Until the agent has finished everything announced so far (by earlier trainers too)."""
        self._request(Flush(), timeout)

    def _request(self, msg: Record, timeout: float) -> None:
        with self._lock:
            _, others = self.client.request(msg, Flushed, timeout)
            self._handle(others)

    def close(self, detach: bool) -> None:
        """``detach=False`` (the trainer is crashing): leave without a clean detach, so the agent keeps
        node memory for the restart."""
        with self._lock:
            if self.client.connected:
                if detach:
                    self.flush()
                self.client.close(detach=detach)

    # ---- messages ---------------------------------------------------------------------------------------
    def _await_begun(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while self.begins_unanswered and self.client.connected and time.monotonic() < deadline:
            self._collect(block_s=0.5)

    def _collect(self, block_s: float = 0.0) -> None:
        self._handle(self.client.poll(block_s))

    def _handle(self, messages: list[Record]) -> None:
        for msg in messages:
            if isinstance(msg, Begun):
                # Only the answer to the last Begin grants: slots granted before the agent knew this
                # timeline, or under an earlier Begin of it, were revoked when it was sent.
                self.begins_unanswered -= 1
                if not self.begins_unanswered:
                    self.grants.add(msg.grants)
                continue
            if not isinstance(msg, (Released, Granted)):
                continue
            if not self.begins_unanswered:
                self.grants.add(msg.grants)
            if isinstance(msg, Released) and msg.error is not None:
                self.persist_errors += 1
                log.warning(f"snapshot of iteration {msg.iteration} was not persisted: {msg.error}; training "
                            "continues and the next save tries again", rank=self.rank)
        if not self.client.connected:
            self.grants.revoke_all()
            self.begins_unanswered = 0

    def _reconnect(self) -> bool:
        try:
            self.start(timeout=10.0)
        except AgentUnavailable:
            return False
        log.info(f"connected to a new node agent (pid {self.client.pid})", rank=self.rank)
        self.begins_unanswered = 0  # the old agent's answers will never come
        if self.run is not None:
            self._tell_timeline()  # same timeline, new agent
        return True
