"""Replication between node agents: every snapshot kept in R peers' memory, over TCP, off the training path.

Three parts, all in the node agent process (no torch):

* ``Replicator`` (sender): after the agent records a snapshot, a background thread
  streams it to this node's holders (``peers.holders``), reading each item from the region
  it lies in, the dense state first, and handing each region back once read. PEC-aware: it
  sends only the items the snapshot wrote; the holder keeps every other item where its
  replica already holds it, at exactly the version the sender's record names (else it asks
  for the whole snapshot once). Bounded: an unsent snapshot is replaced by a newer one of
  the same rank; what is being sent or waits is pinned on the trainer. ``--pec-replica-mbps``
  caps its bandwidth. Failures are logged; training never waits.
* ``ReplicaStore`` (holder): one replica file per (node, rank) under ``<node dir>/replicas``,
  every item once (a replica takes the state's size, no more): a push writes each item in
  place, in batches struck from the index before they change and entered again once checked
  against the checksum the sender's record names. A torn, corrupt or foreign push never
  becomes part of the replica; what it was overwriting is restored from storage instead.
* ``pull`` (a replacement node): an agent whose memory has nothing for a rank asks that
  rank's holders for their replica (streamed as one whole file), writes each item into the
  rank's own files (the dense state into home slot 0, each expert into a pool region),
  verifies it and records it, marked with the node it came from; restore then reads it like
  local memory.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import socket
import threading
import time

from megatron_pec.agent import peers
from megatron_pec.agent.pins import reading
from megatron_pec.common import faults, log
from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import (
    JobInfo,
    PeerAddress,
    Pin,
    ProtocolError,
    ReplicaEntry,
    ReplicaIndex,
    ReplicaPull,
    ReplicaPush,
    ReplicaReply,
    Segment,
    SlotRecord,
)
from megatron_pec.format.stformat import MAX_HEADER, FormatError, decode_header, encode_header
from megatron_pec.integrity.checksum import item_checks
from megatron_pec.memory.node_files import REPLICAS, map_node_file, replace_node_file
from megatron_pec.memory.slot_map import POOL
from megatron_pec.memory.slots import SlotCache, slot_path
from megatron_pec.store.storage import Storage

INDEX = "index.json"
CONNECT_TIMEOUT = 10.0
NEED_FULL = "need the whole slot"


class ReplicaError(RuntimeError):
    """A replica that could not be sent, received or pulled; the message says why."""


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ReplicaError("the connection closed mid-transfer")
        got += n


def _read_line(sock: socket.socket, limit: int = 64 << 20) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        if not chunk:
            raise ReplicaError("the connection closed before a message")
        data += chunk
        if len(data) > limit:
            raise ReplicaError("message too long")
    return bytes(data)


def _map(path: str, length: int) -> mmap.mmap:
    return map_node_file(path, length)[0]  # (a full tmpfs fails here, not with SIGBUS later)


class ReplicaStore:
    """The replicas one node agent holds for other nodes: one file per (node, rank), each item in place."""

    def __init__(self, node_dir: str):
        self.directory = os.path.join(node_dir, REPLICAS)
        os.makedirs(self.directory, exist_ok=True)
        self.lock = threading.Lock()  # one transfer at a time touches the store
        try:
            with open(os.path.join(self.directory, INDEX), "rb") as f:
                self.index = ReplicaIndex.loads(f.read())
        except (OSError, ProtocolError):
            self.index = ReplicaIndex()

    def path(self, node: int, rank: int) -> str:
        return os.path.join(self.directory, f"node{node}.rank{rank}.replica")

    def _write_index(self, entries: dict[str, ReplicaEntry]) -> None:
        self.index = ReplicaIndex(entries)
        replace_node_file(os.path.join(self.directory, INDEX), self.index.dumps())

    def current(self, job: JobInfo, node: int, rank: int) -> ReplicaEntry | None:
        entry = self.index.entries.get(f"{node}.{rank}")
        if entry is None or entry.key != job.key:
            return None
        return entry

    def footprint(self) -> int:
        """Bytes of node memory the replicas take."""
        return sum(os.path.getsize(os.path.join(self.directory, n)) for n in os.listdir(self.directory)
                   if n.endswith(".replica"))

    def receive(self, push: ReplicaPush, sock: socket.socket) -> str | None:
        """Take a pushed snapshot into the rank's replica file, each item in place; None when it is
        complete and recorded, else why not (the bytes on the socket are consumed either way, or the
        connection is dropped). Items are received in batches, the dense state first: a batch is struck
        from the index before its bytes change and entered again once every item of it is checked, so
        the index never names a version that is not there (a node lost meanwhile restores the rest from
        here, the batch in flight from storage)."""
        with self.lock:
            record, sent = push.record, set(push.sent)
            key = f"{push.node}.{push.rank}"
            base = self.current(push.job, push.node, push.rank)
            if not 8 < push.header_len <= min(push.file_len, MAX_HEADER + 8):
                raise ReplicaError(f"implausible header length {push.header_len} for a {push.file_len}-byte replica")
            header = bytearray(push.header_len)
            _recv_into(sock, memoryview(header))
            try:
                layout = decode_header(header, file_len=push.file_len)
            except FormatError as exc:
                raise ReplicaError(f"bad replica header: {exc}") from None
            path = self.path(push.node, push.rank)
            if base is not None and (not os.path.exists(path) or os.path.getsize(path) != push.file_len
                                     or _table(path) != _table_of(header)):
                base = None  # (another layout: nothing of the old replica carries over)
            carried = set(record.items) - sent
            if carried and (base is None
                            or not any(s.admits(base.record.run, base.record.iteration) for s in push.lineage)
                            or any(base.record.items.get(i) != record.items[i]
                                   or base.record.checks.get(i) != record.checks.get(i) for i in carried)):
                _drain(sock, sum(e.end - e.begin for e in layout.tensors if e.item in sent))
                return NEED_FULL
            valid = _Valid(base.record if base is not None else None, record)
            total = sum(e.end - e.begin for e in layout.tensors if e.item in sent)
            consumed = 0
            target = _map(path, push.file_len)
            try:
                with memoryview(target) as view:
                    view[:push.header_len] = header
                    for n, batch in enumerate(_batches([e for e in layout.tensors if e.item in sent])):
                        items = {e.item for e in batch}
                        valid.strike(items)
                        self._write_index({**self.index.entries, key: self._entry(push, valid)})
                        begin, end = layout.data_start + batch[0].begin, layout.data_start + batch[-1].end
                        _recv_into(sock, view[begin:end])
                        consumed += end - begin
                        if n == 0:
                            faults.point("replica_receive", iteration=record.iteration)
                        actual = item_checks(target, layout, {i: record.checks.get(i) for i in items})
                        bad = sorted(i for i in items if actual[i] != record.checks.get(i))
                        if bad:
                            _drain(sock, total - consumed)
                            return f"checksum mismatch for {', '.join(bad[:3])}: the transfer was damaged"
                        valid.enter(items)
                self._write_index({**self.index.entries, key: self._entry(push, valid)})
            finally:
                target.close()
            return None

    @staticmethod
    def _entry(push: ReplicaPush, valid: "_Valid") -> ReplicaEntry:
        return ReplicaEntry(push.job.job_id, push.job.fingerprint, push.job.save, push.node, push.rank, 0,
                            valid.record(), list(push.lineage))

    def serve_pull(self, pull: ReplicaPull, sock: socket.socket) -> None:
        """The replica of ``pull.rank``: what the index says it holds, then the whole file."""
        with self.lock:
            entry = self.current(pull.job, pull.node, pull.rank)
            why = "no replica of that rank for this job" if entry is None else \
                "its replica of that rank has no dense state now (a push of it is landing)" \
                if NON_EXPERT not in entry.record.items else None
            if why is not None:
                sock.sendall((ReplicaReply(False, why).dumps() + "\n").encode())
                return
            path = self.path(pull.node, pull.rank)
            size = os.path.getsize(path)
            sock.sendall((ReplicaReply(True, None, entry.record, entry.lineage, size).dumps() + "\n").encode())
            with open(path, "rb") as f:
                while chunk := f.read(4 << 20):
                    sock.sendall(chunk)


class _Valid:
    """What a replica holds while a push lands: the base's items, less those in flight, plus those landed."""

    def __init__(self, base: SlotRecord | None, pushed: SlotRecord):
        self.pushed = pushed
        self.items = dict(base.items) if base is not None else {}
        self.source = {i: base for i in self.items}

    def strike(self, items) -> None:
        for item in items:
            self.items.pop(item, None)
            self.source.pop(item, None)

    def enter(self, items) -> None:
        for item in items:
            self.items[item] = self.pushed.items[item]
            self.source[item] = self.pushed

    def record(self) -> SlotRecord:
        """The replica now: its iteration is its dense state's (-1 without one: not pullable)."""
        pushed, source = self.pushed, self.source
        dense = self.items.get(NON_EXPERT, -1)
        sums = {i: source[i].sums[i] for i in self.items if i in source[i].sums}
        crcs = {i: source[i].crcs[i] for i in self.items if i in source[i].crcs}
        tokens = {i: source[i].tokens[i] for i in self.items if i in source[i].tokens}
        runs = {i: source[i].run_of(i) for i in self.items if source[i].run_of(i) != pushed.run}
        return SlotRecord(dense, pushed.run if dense >= 0 else "", dict(self.items), crcs=crcs, tokens=tokens,
                          sums=sums, runs=runs)


BATCH = 64 << 20  # bytes a replica receives between two index writes


def _batches(entries: list) -> list[list]:
    """Runs of whole items of about ``BATCH`` bytes, contiguous in the replica file (the dense state its own)."""
    out, current, size = [], [], 0
    for e in entries:
        new_item = not current or current[-1].item != e.item
        if current and new_item and (size >= BATCH or current[-1].end != e.begin or current[0].item == NON_EXPERT):
            out.append(current)
            current, size = [], 0
        current.append(e)
        size += e.end - e.begin
    return out + ([current] if current else [])


def _drain(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a push refused midway: the sender still sends them)."""
    buffer = bytearray(min(max(nbytes, 0), 4 << 20) or 1)
    while nbytes > 0:
        n = sock.recv_into(buffer, min(nbytes, len(buffer)))
        if not n:
            return
        nbytes -= n


def _table_of(header: bytes) -> bytes:
    """A header's tensor table (its JSON up to the metadata): what decides the file's layout."""
    at = header.find(b'"__metadata__"')
    return bytes(header[8:at if at >= 0 else len(header)])


def _table(path: str) -> bytes:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return _table_of(size.to_bytes(8, "little") + f.read(min(size, MAX_HEADER)))


def _decode_request(line: bytes) -> ReplicaPush | ReplicaPull:
    try:
        kind = json.loads(line).get("type")
    except (ValueError, AttributeError):
        raise ProtocolError("replica request: not a JSON object") from None
    requests = {ReplicaPush.KIND: ReplicaPush, ReplicaPull.KIND: ReplicaPull}
    if kind not in requests:
        raise ProtocolError(f"replica request: field 'type' is {kind!r}, expected one of {', '.join(requests)}")
    return requests[kind].loads(line)


class ReplicaServer:
    """Accepts pushes and pulls from other nodes' agents (one request per connection)."""

    def __init__(self, store: ReplicaStore, host: str):
        """``host``: the address this node advertises to its peers, the only one it listens on."""
        self.store = store
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(120.0)
                request = _decode_request(_read_line(conn))
                if isinstance(request, ReplicaPull):
                    self.store.serve_pull(request, conn)
                    return
                error = self.store.receive(request, conn)
                conn.sendall((ReplicaReply(error is None, error).dumps() + "\n").encode())
                if error is not None and error != NEED_FULL:
                    log.info(f"replica of node {request.node} rank {request.rank} iteration "
                             f"{request.record.iteration} refused: {error}")
            except (OSError, ProtocolError, ReplicaError, ValueError) as exc:
                log.info(f"replica transfer broke: {exc}")

    def close(self) -> None:
        self.sock.close()


class Replicator:
    """Sends recorded snapshots to this node's holders in a background thread."""

    def __init__(self, node_dir: str, job: JobInfo, storage: Storage, slots: SlotCache, on_progress=None):
        """``on_progress()``: called as a push hands regions back, and when it ends (its pins shrink)."""
        self.node_dir, self.job, self.storage, self.slots = node_dir, job, storage, slots
        self.on_progress = on_progress
        self.pending: dict[int, tuple] = {}         # rank -> newest unsent snapshot
        self.sending: dict[int, tuple[int, set, dict]] = {}  # rank -> (iteration, items not read yet,
        # item -> region) being sent
        self.synced: set[tuple[int, int]] = set()   # (holder, rank) that hold a base replica
        self.landed: dict[int, int] = {}            # rank -> iteration of its newest replica on every holder
        self.sent = {"snapshots": 0, "whole": 0, "bytes": 0}  # completed pushes (reported at exit)
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def offer(self, rank: int, home: int, places: dict[str, int], record: SlotRecord,
              lineage: list[Segment]) -> None:
        """Snapshot ``record`` (every item at its version) of ``rank``: its header and dense state in home
        slot ``home``, each expert in the region ``places`` names."""
        with self.cond:
            self.pending[rank] = (home, dict(places), record, list(lineage))
            self.cond.notify()

    def replicating(self, rank: int) -> list[Pin]:
        """The regions of ``rank``'s snapshots being sent (those still to read) or waiting to be: what the
        trainer must keep."""
        with self.cond:
            out = []
            if rank in self.sending:
                iteration, left, where = self.sending[rank]
                out.append(reading(iteration, left, where))
            if rank in self.pending:
                home, places, record, _ = self.pending[rank]
                out.append(reading(record.iteration, record.items, {i: places.get(i, home) for i in record.items}))
            return out

    def idle(self) -> bool:
        with self.cond:
            return not self.pending and not self.sending

    def busy(self, rank: int) -> bool:
        """A snapshot of ``rank`` is being sent or waits to be."""
        with self.cond:
            return rank in self.sending or rank in self.pending

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                rank = min(self.pending)
                home, places, record, lineage = self.pending.pop(rank)
                self.sending[rank] = (record.iteration, set(record.items),
                                      {i: places.get(i, home) for i in record.items})
            try:
                self._send_to_holders(rank, home, places, record, lineage)
            finally:
                with self.cond:
                    self.sending.pop(rank, None)
                if self.on_progress is not None:
                    self.on_progress()

    def _send_to_holders(self, rank: int, home: int, places: dict[str, int], record: SlotRecord,
                         lineage: list[Segment]) -> None:
        job = self.job
        addresses = peers.read_peers(job.save, job.job_id, job.num_nodes, self.storage)
        domains = {n: a.domain for n, a in addresses.items()}
        holders = peers.holders(job.node_rank, job.num_nodes, job.replicas, domains)
        landed = 0
        for n, holder in enumerate(holders):
            address = addresses.get(holder)
            if address is None:
                log.info(f"replication: node {holder}'s agent has not published its address yet; its replicas "
                         "start with a later snapshot", once=True)
                continue
            try:
                last = n == len(holders) - 1  # (regions go back as the last holder's push reads them)
                self._push(address, rank, home, places, record, lineage, (holder, rank) not in self.synced, last)
                self.synced.add((holder, rank))
                landed += 1
            except (OSError, ReplicaError, ProtocolError, FormatError) as exc:
                self.synced.discard((holder, rank))
                log.info(f"replication of rank {rank} to node {holder} failed ({exc}); training continues, a "
                         "lost node restores from storage until a replica lands", once=True)
        if holders and landed == len(holders):
            with self.cond:
                self.landed[rank] = record.iteration

    def _push(self, address: PeerAddress, rank: int, home: int, places: dict[str, int], record: SlotRecord,
              lineage: list[Segment], full: bool, hand_back: bool) -> None:
        layout = self.slots.layout(self.node_dir, rank)
        _, home_header = self.slots.open(slot_path(self.node_dir, rank, home))
        entries = layout.full_entries()
        header = encode_header(entries, home_header.metadata)
        file_len = len(header) + (entries[-1].end if entries else 0)
        source = _Source(self, rank, home, places, hand_back)
        sent = sorted(record.items) if full else sorted(i for i, v in record.items.items() if v == record.iteration)
        push = ReplicaPush(self.job, self.job.node_rank, rank, record, lineage, file_len, len(header), sent)
        reply = self._exchange(address, push, header, entries, source)
        if not reply.ok and reply.error == NEED_FULL and not full:
            push = dataclasses.replace(push, sent=sorted(record.items))
            reply = self._exchange(address, push, header, entries, source)
        if not reply.ok:
            raise ReplicaError(reply.error or "refused")
        sent = set(push.sent)
        with self.cond:
            self.sent["snapshots"] += 1
            self.sent["whole"] += len(sent) == len(record.items)
            self.sent["bytes"] += push.header_len + sum(e.end - e.begin for e in entries if e.item in sent)

    def _exchange(self, address: PeerAddress, push: ReplicaPush, header: bytes, entries, source) -> ReplicaReply:
        """Send the push: its header, then each sent item's bytes from the region it lies in, in header order."""
        cap = self.job.replica_mbps
        with socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT) as sock:
            sock.settimeout(120.0)
            sock.sendall((push.dumps() + "\n").encode())
            sock.sendall(header)
            started, sent_bytes = time.monotonic(), 0
            wanted = set(push.sent)
            for item in dict.fromkeys(e.item for e in entries if e.item in wanted):
                mapping, begin, end = source.locate(item)
                with memoryview(mapping) as whole:
                    for offset in range(begin, end, 4 << 20):
                        with whole[offset:min(offset + (4 << 20), end)] as chunk:
                            sock.sendall(chunk)
                            sent_bytes += len(chunk)
                        if cap:  # never ahead of the cap
                            ahead = sent_bytes / (cap * 1e6) - (time.monotonic() - started)
                            if ahead > 0:
                                time.sleep(ahead)
                source.done(item)
            return ReplicaReply.loads(_read_line(sock))


class _Source:
    """Where a pushed snapshot's items lie in this node's memory, and their hand-back once read."""

    EVERY_S = 0.02

    def __init__(self, replicator: Replicator, rank: int, home: int, places: dict[str, int], hand_back: bool):
        self.replicator, self.rank, self.hand_back = replicator, rank, hand_back
        self.where = replicator.slots.locator(replicator.node_dir, rank, home, places)
        self.told = time.monotonic()

    def locate(self, item: str) -> tuple[object, int, int]:
        """(mapping, first byte, end) of ``item`` in its region."""
        mapping, header = self.where(item)
        mine = [e for e in header.tensors if e.item == item]
        return mapping, header.data_start + mine[0].begin, header.data_start + mine[-1].end

    def done(self, item: str) -> None:
        if not self.hand_back:
            return
        r = self.replicator
        with r.cond:
            left = r.sending.get(self.rank, (None, set(), None))[1]
            left.discard(item)
        now = time.monotonic()
        if r.on_progress is not None and (item == NON_EXPERT or now - self.told >= self.EVERY_S):
            self.told = now
            r.on_progress()


def pull(node_dir: str, job: JobInfo, rank: int, slots: SlotCache, storage: Storage
         ) -> tuple[SlotRecord, list[Segment], dict[str, int]] | str:
    """Fetch ``rank``'s replica from this node's holders into this node's memory of ``rank`` (its trainer
    mapped the files: home slot 0 takes the dense state, the pool's first regions the experts), verified
    item by item; returns its record (``origin`` = the holder), lineage and where each expert went, or
    why nothing could be pulled."""
    addresses = peers.read_peers(job.save, job.job_id, job.num_nodes, storage)
    domains = {n: a.domain for n, a in addresses.items()}
    problems = []
    for holder in peers.holders(job.node_rank, job.num_nodes, job.replicas, domains):
        address = addresses.get(holder)
        if address is None or address.node == job.node_rank:
            problems.append(f"node {holder}: no published address")
            continue
        try:
            with socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT) as sock:
                sock.settimeout(120.0)
                sock.sendall((ReplicaPull(job, job.node_rank, rank).dumps() + "\n").encode())
                reply = ReplicaReply.loads(_read_line(sock))
                if not reply.ok:
                    problems.append(f"node {holder}: {reply.error}")
                    continue
                landed = _land(sock, reply, node_dir, rank, slots)
            if isinstance(landed, str):
                problems.append(f"node {holder}: {landed}")
                continue
            return dataclasses.replace(reply.record, origin=holder), reply.lineage, landed
        except (OSError, ReplicaError, ProtocolError, FormatError) as exc:
            problems.append(f"node {holder}: {exc}")
    return "; ".join(problems) or "no replica holder for this node"


def _land(sock: socket.socket, reply: ReplicaReply, node_dir: str, rank: int, slots: SlotCache) -> dict | str:
    """Receive a pulled replica (a whole file: header, then every item) into the rank's own files;
    item -> slot of each expert, or why it does not fit (another configuration, damaged bytes)."""
    head = bytearray(8)
    _recv_into(sock, memoryview(head))
    size = int.from_bytes(head, "little")
    if size > MAX_HEADER:
        raise ReplicaError(f"implausible replica header length {size}")
    head += bytearray(size)
    _recv_into(sock, memoryview(head)[8:])
    replica = decode_header(head, file_len=reply.file_len)
    layout = slots.layout(node_dir, rank)
    home_map, home = slots.open(slot_path(node_dir, rank, 0))
    if replica.tensors != layout.full_entries():
        _drain(sock, reply.file_len - len(head))
        return "its replica is of another configuration than this rank's node memory"
    if len(layout.experts) > layout.regions:
        _drain(sock, reply.file_len - len(head))
        return f"this rank's pool has {layout.regions} regions for {len(layout.experts)} experts"
    places = {item: POOL + j for j, item in enumerate(layout.experts)}
    held = set(reply.record.items)
    checks, at = {}, replica.data_start
    locate = slots.locator(node_dir, rank, 0, places)
    for item in dict.fromkeys(e.item for e in replica.tensors):
        mine = [e for e in replica.tensors if e.item == item]
        length = mine[-1].end - mine[0].begin
        mapping, header = (home_map, home) if item == NON_EXPERT else locate(item)
        start = header.data_start + [e for e in header.tensors if e.item == item][0].begin
        with memoryview(mapping) as view:
            _recv_into(sock, view[start:start + length])
        at += length
        if item in held:
            checks[item] = item_checks(mapping, header, {item: reply.record.checks.get(item)})[item]
    bad = sorted(i for i, value in checks.items() if value != reply.record.checks.get(i))
    if bad:
        return f"its replica fails its checksum for {', '.join(bad[:3])}"
    capacity = home.header_len
    home_map[:8 + capacity] = encode_header(home.tensors, replica.metadata, capacity=capacity)
    return {item: slot for item, slot in places.items() if item in held}
