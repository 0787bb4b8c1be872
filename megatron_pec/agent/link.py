"""A trainer's session with its node agent: the connection and the lease of node-memory regions.

The engine calls a session, never raw messages. Call order:

1. ``start``          start or reuse the node's agent, connect, say ``Hello``;
2. ``begin``          a new timeline (after every restore, or from scratch); its ``Begun`` is taken
                      before the next lease, so a restore does not wait for it;
3. per snapshot:      ``lease`` (the home slot for its header and dense state; the session reconnects
                      to a new agent first when the old one died), ``place`` its items into regions and
                      say ``writing`` before each copy, then ``announce`` (the regions go to the agent)
                      or ``skipped`` (they hold nothing now; the agent hears at the next announcement);
4. ``settle``/``flush`` wait until the agent has recorded / finished everything announced;
5. ``close``          detach (a clean exit) or just leave (a crash: the agent keeps node memory).

Which regions may be overwritten is the ``RegionBook``'s (``memory/regions.py``): it follows the agent's
``Begun``, ``Released`` and ``Granted`` (pins); what it heard before the answer to the last ``Begin``
is void. Thread-safe: a snapshot may be announced from a background thread. The agent's messages are read
and decoded by a listener thread of the session (decoding one takes ~0.16 ms: off the training thread's save);
the training thread waits for what it needs on a condition the listener signals.
"""

from __future__ import annotations

import threading
import time
import uuid

from megatron_pec.agent.client import AgentClient, AgentUnavailable, ensure_agent
from megatron_pec.common import log
from megatron_pec.format.protocol import (
    Begin,
    Begun,
    Flush,
    Flushed,
    Granted,
    Hello,
    Record,
    Released,
    Settle,
    SnapshotReady,
)
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.regions import RegionBook

PERSISTENT_SLOT_WAIT_S = 10.0  # how long a persistent save waits for regions before it is skipped
REPLICA_WAIT_S = 120.0  # how long a snapshot waits for a replica push that holds the regions it needs
RELEASE_WAIT_S = 2.0  # how long a snapshot waits for the agent to record the one before (it has had a step)
WRITE_WAIT_S = 2.0  # ... for a write to storage to hand the dense state back (the first thing it reads)
# A round of a save in rounds waits only while the agent holds what will free a region (the last round
# until recorded, a persist or push until it hands its regions back: one persist at most); this bound is
# for an agent that never answers (its storage hangs), not the wait's length.
ROUND_WAIT_S = 120.0
# ... and how long a memory snapshot under a budget waits for them (its spares are what one snapshot writes:
# a persist still reading the last one's regions is handed back in well under this; slower storage is a
# fault, and the snapshot then takes fewer experts rather than hold training longer)
SNAPSHOT_ROOM_WAIT_S = 10.0
LISTEN_WAKE_S = 0.5  # how often an idle listener looks whether its connection was replaced (a message wakes it)


class AgentLink:
    def __init__(self, node_dir: str, rank: int, node_rank: int, hello: Hello, items: list[str], *,
                 idle_timeout: float, keep_shm: bool, wait_for_slot: bool):
        """``items``: the rank's items in slot order."""
        self.node_dir, self.rank, self.node_rank, self.hello = node_dir, rank, node_rank, hello
        self.idle_timeout, self.keep_shm, self.wait_for_slot = idle_timeout, keep_shm, wait_for_slot
        self.client = AgentClient(node_dir, rank)
        self.items = list(items)
        self.regions = RegionBook(self.items, 0)
        self.run: str | None = None            # this process's timeline, from its first begin
        self.resumed_from: int | None = None
        self.begins_unanswered = 0             # Begins sent whose Begun has not arrived
        self.persist_errors = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # the listener handled messages (or the agent was lost)
        self._requests = self._answered = 0  # Settle/Flush sent, and answered (the agent answers in order)
        self._settled_on = None  # the connection whose agent answered a Settle (its pull, if any, ended)
        self._listener: threading.Thread | None = None

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
        self._listener = threading.Thread(target=self._listen, args=(self.client.sock,), daemon=True,
                                          name=f"pec-agent-listener-{self.rank}")
        self._listener.start()

    def use_pool(self, regions: int, homes: int) -> None:
        """The rank's expert pool has ``regions`` regions, and it has ``homes`` home slots (its files are
        mapped: before ``start``)."""
        self.regions = RegionBook(self.items, regions, homes)

    def capacity(self) -> int:
        """Experts the snapshot just leased can write (pool regions it may overwrite)."""
        with self._lock:
            return self.regions.capacity()

    def await_capacity(self, least: int = 1, timeout: float = ROUND_WAIT_S) -> int:
        """``capacity()``, waiting for the agent to hand regions back until ``least`` are free (a persist or a
        replica push still reads them): a later round of a save in rounds, a snapshot under a budget. It
        waits only while a region can be freed (``RegionBook.may_free``): never for regions that every
        expert's newest version holds."""
        with self._lock:
            self._collect_until(lambda: self.regions.capacity() >= least or not self.regions.may_free(), timeout)
            return self.regions.capacity()

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
        if self.client.send(Begin(self.run, self.resumed_from)):
            self.begins_unanswered += 1

    # ---- the lease of regions -------------------------------------------------------------------------
    def lease(self, persistent: bool) -> tuple[int | None, str | None]:
        """(the home slot of the next snapshot, None) or (None, why there is none). With
        --pec-wait-for-slot a save waits for one; without, a persistent save (what the user asked to
        keep, e.g. the last one of training) waits up to PERSISTENT_SLOT_WAIT_S, a memory snapshot only
        when a replica push holds the regions it needs (the replicas' lag is bounded: the snapshot waits,
        up to REPLICA_WAIT_S, rather than letting a node loss lose more)."""
        with self._lock:
            if self.run is None:
                self.begin(None)  # no load_checkpoint before: this run starts from scratch
            if not self.client.connected and not self._reconnect():
                return None, "the node agent is not running"
            self._await_begun()
            self._await_released()
            home = self._home()
            started = time.monotonic()
            deadline = started + (PERSISTENT_SLOT_WAIT_S if persistent else 0.0)
            while home is None and self.client.connected and (
                    self.wait_for_slot or time.monotonic() < deadline
                    or (self.regions.held_by_replicas() and time.monotonic() < started + REPLICA_WAIT_S)
                    or (self.regions.held_by_writes() and time.monotonic() < started + WRITE_WAIT_S)):
                self._changed.wait(0.05)
                home = self._home()
            if home is None and self.regions.hold:
                return None, f"{self.regions.hold} for {REPLICA_WAIT_S:.0f} s"
            if home is None:
                return None, ("node memory has no free region for some item (all held by the node agent: being "
                              "persisted or sent to a peer, or kept for recovery); raise the save interval or pass "
                              "--pec-wait-for-slot")
            return home, None

    def _home(self) -> int | None:
        return self.regions.home() if self.client.connected and not self.begins_unanswered else None

    def place(self, home: int, items) -> dict[str, int]:
        """item -> the slot its bytes go to in the snapshot leased with ``home``."""
        with self._lock:
            return self.regions.place(home, items)

    def writing(self, iteration: int, placement: dict[str, int]) -> None:
        """These regions are about to change (said before the copy: one cut short changed them too)."""
        with self._lock:
            self.regions.writing(iteration, placement)

    def skipped(self, placement: dict[str, int]) -> None:
        """The snapshot that wrote these regions is not announced: they hold nothing now."""
        with self._lock:
            self.regions.skipped(placement)

    def announce(self, home: int, iteration: int, persistent: bool, persist_items: list[str] | None,
                 placement: dict[str, int], generation: str = "") -> bool:
        """Hand the complete snapshot of ``iteration`` (header and dense state in ``home``, its items where
        ``placement`` says) to the agent; False when the agent is gone (the snapshot is lost, the caller
        warns)."""
        with self._lock:
            places = {item: slot for item, slot in placement.items() if slot != home}
            stale = self.regions.announced(iteration, placement)
            if not self.client.send(SnapshotReady(home, iteration, persistent, persist_items, places, stale,
                                                  generation)):
                self.regions.agent_lost()
                return False
            return True

    # ---- waiting for the agent -------------------------------------------------------------------------
    def settle(self, timeout: float = 300.0) -> None:
        """Until the agent has recorded every snapshot announced so far (what a restore reads). The first
        time on a connection the agent is asked (it also waits for a pull from peers' replicas, which it
        starts at the connection's Hello); after that, what is left is this trainer's own snapshots,
        recorded once their Released came (the agent writes its index before): no round trip."""
        with self._lock:
            if self._settled_on is not None and self._settled_on is self.client.sock:
                self._collect_until(lambda: not self.regions.pending, timeout)
                if self.client.connected:
                    return
            sock = self.client.sock
            self._request(Settle(), timeout)
            if self.client.connected and self.client.sock is sock and self._answered >= self._requests:
                self._settled_on = sock

    def flush(self, timeout: float = 300.0) -> None:
        """Until the agent has finished everything announced so far (by earlier trainers too)."""
        self._request(Flush(), timeout)

    def _request(self, msg: Record, timeout: float) -> None:
        with self._lock:
            if not self.client.send(msg):
                return
            self._requests += 1
            asked = self._requests
            self._collect_until(lambda: self._answered >= asked, timeout)

    def close(self, detach: bool) -> None:
        """``detach=False`` (the trainer is crashing): leave without a clean detach, so the agent keeps
        node memory for the restart."""
        with self._lock:
            if self.client.connected:
                if detach:
                    self.flush()
                self.client.close(detach=detach)
        if self._listener is not None and self._listener is not threading.current_thread():
            self._listener.join(timeout=2 * LISTEN_WAKE_S)

    # ---- messages ---------------------------------------------------------------------------------------
    def _await_begun(self, timeout: float = 300.0) -> None:
        self._collect_until(lambda: not self.begins_unanswered, timeout)

    def _await_released(self, timeout: float = RELEASE_WAIT_S) -> None:
        """The snapshots announced before are recorded (their answers are usually in already): until then
        their regions are in flight, and with two home slots the next snapshot would find no dense region."""
        self._collect_until(lambda: not self.regions.pending, timeout)

    def _listen(self, sock) -> None:
        """The listener thread of one connection: handles the agent's messages as they come, until the
        connection is lost or replaced (then once more: a lost agent's regions are handled)."""
        while True:
            messages = self.client.receive(LISTEN_WAKE_S)
            with self._lock:
                if self.client.sock is sock or not self.client.connected:
                    self._handle(messages)
                self._changed.notify_all()
            if self.client.sock is not sock:
                return

    def _collect_until(self, done, timeout: float) -> None:
        """Wait (the lock held, released while waiting) until ``done()``, the agent is lost, or ``timeout``
        seconds pass; the listener handles the agent's messages meanwhile."""
        self._changed.wait_for(lambda: done() or not self.client.connected, timeout)

    def _handle(self, messages: list[Record]) -> None:
        for msg in messages:
            if isinstance(msg, Begun):
                # Only the answer to the last Begin counts: the agent's index is current then.
                self.begins_unanswered -= 1
                if not self.begins_unanswered:
                    self.regions.reset(NodeMemory.read(self.node_dir, self.rank), self.rank)
                    self.regions.pin(msg.pins, msg.hold)
                continue
            if isinstance(msg, Released):
                if not msg.written:  # (a write's end: its regions were answered for when it was recorded)
                    self.regions.released(msg.iteration, msg.recorded)
                if msg.error is not None:
                    self.persist_errors += 1
                    # (a snapshot that failed its record check is neither restorable from node memory nor persisted)
                    lost = "persisted" if msg.recorded else "recorded in node memory (nor persisted)"
                    log.warning(f"snapshot of iteration {msg.iteration} was not {lost}: {msg.error}; training "
                                "continues and the next save tries again", rank=self.rank)
            if isinstance(msg, Flushed):
                self._answered += 1
            if isinstance(msg, (Released, Granted)) and not self.begins_unanswered:
                self.regions.pin(msg.pins, msg.hold)
        if not self.client.connected:
            self.regions.agent_lost()
            self.begins_unanswered = 0

    def _reconnect(self) -> bool:
        self.regions.agent_lost()  # (the old listener may not have handled the loss yet)
        self.begins_unanswered, self._answered = 0, self._requests  # (the old agent's answers never come)
        try:
            self.start(timeout=10.0)
        except AgentUnavailable:
            return False
        log.info(f"connected to a new node agent (pid {self.client.pid})", rank=self.rank)
        if self.run is not None:
            self._tell_timeline()  # same timeline, new agent
        return True
