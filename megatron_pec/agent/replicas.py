"""Replication between node agents: every snapshot kept in R peers' memory, over TCP, off the training path.

Three parts, all in the node agent process (no torch):

* ``Replicator`` (sender): after the agent records a snapshot, a background thread
  streams it to this node's holders (``peers.holders``), reading each item from the slot
  its region is in. PEC-aware: it sends only the items the snapshot wrote; the holder keeps
  every other item where its replica already holds it, at exactly the version the sender's
  record names (else it asks for the whole snapshot once). Bounded: an unsent snapshot is
  replaced by a newer one of the same rank; what is being sent or waits is pinned on the
  trainer. ``--pec-replica-mbps`` caps its bandwidth. Failures are logged; training never waits.
* ``ReplicaStore`` (holder): two replica files per (node, rank) under ``<node dir>/replicas``;
  a pushed item is written into the file that does not hold its current version (nothing is
  copied between them), every received item is checked against the checksum the sender's
  record names, and only then is the index (the marker) switched to the new replica. A torn,
  corrupt or foreign push never becomes the replica.
* ``pull`` (a replacement node): an agent whose memory has nothing for a rank asks that
  rank's holders for their replica (streamed as one whole slot file), verifies every item and
  records it as its own slot, marked with the node it came from; restore then reads it like
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

from megatron_pec import faults, log
from megatron_pec.agent import peers
from megatron_pec.byteruns import runs
from megatron_pec.checksum import item_checks
from megatron_pec.protocol import (
    JobInfo,
    PeerAddress,
    ProtocolError,
    ReplicaEntry,
    ReplicaIndex,
    ReplicaPull,
    ReplicaPush,
    ReplicaReply,
    Segment,
    SlotRecord,
)
from megatron_pec.slots import REPLICA_SLOTS
from megatron_pec.stformat import MAX_HEADER, FormatError, decode_header
from megatron_pec.storage import Storage

REPLICA_DIR = "replicas"
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != length:
            os.ftruncate(fd, length)
        os.posix_fallocate(fd, 0, length)  # a full tmpfs fails here, not with SIGBUS later
        return mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


class ReplicaStore:
    """The replicas one node agent holds for other nodes."""

    def __init__(self, node_dir: str):
        self.directory = os.path.join(node_dir, REPLICA_DIR)
        os.makedirs(self.directory, exist_ok=True)
        self.lock = threading.Lock()  # one transfer at a time touches the store
        try:
            with open(os.path.join(self.directory, INDEX), "rb") as f:
                self.index = ReplicaIndex.loads(f.read())
        except (OSError, ProtocolError):
            self.index = ReplicaIndex()

    def path(self, node: int, rank: int, slot: int) -> str:
        return os.path.join(self.directory, f"node{node}.rank{rank}.slot{slot}")

    def _write_index(self, entries: dict[str, ReplicaEntry]) -> None:
        self.index = ReplicaIndex(entries)
        tmp = os.path.join(self.directory, INDEX + ".tmp")
        with open(tmp, "w") as f:
            f.write(self.index.dumps())
        os.replace(tmp, os.path.join(self.directory, INDEX))

    def current(self, job: JobInfo, node: int, rank: int) -> ReplicaEntry | None:
        entry = self.index.entries.get(f"{node}.{rank}")
        if entry is None or entry.key != job.key:
            return None
        return entry

    def receive(self, push: ReplicaPush, sock: socket.socket) -> str | None:
        """Take a pushed snapshot into the replica files; None when it is complete and recorded, else
        why not (the bytes on the socket are consumed either way, or the connection is dropped)."""
        with self.lock:
            record, sent = push.record, set(push.sent)
            base = self.current(push.job, push.node, push.rank)
            carried = set(record.items) - sent
            if carried and (base is None
                            or not any(s.admits(base.record.run, base.record.iteration) for s in push.lineage)
                            or any(base.record.items.get(i) != record.items[i]
                                   or base.record.checks.get(i) != record.checks.get(i) for i in carried)):
                return NEED_FULL
            home = (base.slot + 1) % REPLICA_SLOTS if base is not None else 0
            # Each item into the file that does not hold its current version; the rest stay where they are.
            held = {} if base is None else {i: base.places.get(i, base.slot) for i in base.record.items}
            placed = {i: (1 - held[i] if i in held else home) for i in sent}
            placed.update({i: held[i] for i in carried})
            if not 8 < push.header_len <= min(push.file_len, MAX_HEADER + 8):
                raise ReplicaError(f"implausible header length {push.header_len} for a {push.file_len}-byte slot")
            header = bytearray(push.header_len)
            _recv_into(sock, memoryview(header))
            try:
                layout = decode_header(header, file_len=push.file_len)
            except FormatError as exc:
                raise ReplicaError(f"bad slot header: {exc}") from None
            files = [_map(self.path(push.node, push.rank, slot), push.file_len) for slot in range(REPLICA_SLOTS)]
            checks = record.checks
            views = [memoryview(f) for f in files]
            try:
                views[home][:push.header_len] = header
                pieces = runs([e for e in layout.tensors if e.item in sent],
                              lambda a, b: a.end == b.begin and placed[a.item] == placed[b.item])
                for n, piece in enumerate(pieces):
                    begin, end = layout.data_start + piece[0].begin, layout.data_start + piece[-1].end
                    _recv_into(sock, views[placed[piece[0].item]][begin:end])
                    if n == 0:
                        faults.point("replica_receive", iteration=record.iteration)
                actual = {}
                for slot in range(REPLICA_SLOTS):
                    here = {i: checks.get(i) for i in sent if placed[i] == slot}
                    if here:
                        actual.update(item_checks(files[slot], layout, here))
            finally:
                for view in views:
                    view.release()
                for f in files:
                    f.close()
            bad = sorted(i for i in sent if actual[i] != checks.get(i))
            if bad:
                return f"checksum mismatch for {', '.join(bad[:3])}: the transfer was damaged"
            entries = dict(self.index.entries)
            entries[f"{push.node}.{push.rank}"] = ReplicaEntry(
                push.job.job_id, push.job.fingerprint, push.job.save, push.node, push.rank, home, record,
                list(push.lineage), {i: slot for i, slot in placed.items() if slot != home})
            self._write_index(entries)  # the marker, last: the replica is complete
            return None

    def serve_pull(self, pull: ReplicaPull, sock: socket.socket) -> None:
        """The replica of ``pull.rank`` as one whole slot file: the header of its home file, then every
        item from the file it is in."""
        with self.lock:
            entry = self.current(pull.job, pull.node, pull.rank)
            if entry is None:
                sock.sendall((ReplicaReply(False, "no replica of that rank for this job").dumps() + "\n").encode())
                return
            paths = [self.path(pull.node, pull.rank, slot) for slot in range(REPLICA_SLOTS)]
            with open(paths[entry.slot], "rb") as f:
                head = f.read(8)
                head += f.read(int.from_bytes(head, "little"))
            layout = decode_header(head, file_len=os.path.getsize(paths[entry.slot]))
            sock.sendall((ReplicaReply(True, None, entry.record, entry.lineage, layout.file_len).dumps()
                          + "\n").encode())
            sock.sendall(head)
            where = {i: entry.places.get(i, entry.slot) for i in entry.record.items}
            handles = [open(p, "rb") for p in paths]
            try:
                for piece in runs(layout.tensors, lambda a, b: where.get(a.item, entry.slot) == where.get(b.item,
                                                                                                       entry.slot)):
                    f = handles[where.get(piece[0].item, entry.slot)]
                    f.seek(layout.data_start + piece[0].begin)
                    left = piece[-1].end - piece[0].begin
                    while left:
                        chunk = f.read(min(left, 4 << 20))
                        if not chunk:
                            raise ReplicaError(f"{f.name} ends early")
                        sock.sendall(chunk)
                        left -= len(chunk)
            finally:
                for f in handles:
                    f.close()

    def clear(self) -> None:
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))


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

    def __init__(self, store: ReplicaStore):
        self.store = store
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
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

    def __init__(self, node_dir: str, job: JobInfo, storage: Storage, on_done=None):
        """``on_done()``: called after each push ends (its pins are gone)."""
        self.node_dir, self.job, self.storage, self.on_done = node_dir, job, storage, on_done
        self.pending: dict[int, tuple] = {}         # rank -> newest unsent snapshot
        self.sending: dict[int, int] = {}           # rank -> iteration being read now (pinned)
        self.synced: set[tuple[int, int]] = set()   # (holder, rank) that hold a base replica
        self.landed: dict[int, int] = {}            # rank -> iteration of its newest replica on every holder
        self.sent = {"snapshots": 0, "whole": 0, "bytes": 0}  # completed pushes (reported at exit)
        self.cond = threading.Condition()
        threading.Thread(target=self._run, daemon=True).start()

    def offer(self, rank: int, home: str, elsewhere: dict[str, str], record: SlotRecord,
              lineage: list[Segment]) -> None:
        """Snapshot ``record`` (every item at its version) of ``rank``: its header and dense state in the
        slot file ``home``, its other items there too or in the files ``elsewhere`` names."""
        with self.cond:
            self.pending[rank] = (home, elsewhere, record, list(lineage))
            self.cond.notify()

    def replicating(self, rank: int) -> list[int]:
        """The iterations of ``rank`` being sent or waiting to be: what the trainer must keep."""
        with self.cond:
            out = [self.sending[rank]] if rank in self.sending else []
            if rank in self.pending:
                out.append(self.pending[rank][2].iteration)
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
                home, elsewhere, record, lineage = self.pending.pop(rank)
                self.sending[rank] = record.iteration
            try:
                self._send_to_holders(rank, home, elsewhere, record, lineage)
            finally:
                with self.cond:
                    self.sending.pop(rank, None)
                if self.on_done is not None:
                    self.on_done()

    def _send_to_holders(self, rank: int, home: str, elsewhere: dict[str, str], record: SlotRecord,
                         lineage: list[Segment]) -> None:
        job = self.job
        addresses = peers.read_peers(job.save, job.job_id, job.num_nodes, self.storage)
        domains = {n: a.domain for n, a in addresses.items()}
        holders = peers.holders(job.node_rank, job.num_nodes, job.replicas, domains)
        landed = 0
        for holder in holders:
            address = addresses.get(holder)
            if address is None:
                log.info(f"replication: node {holder}'s agent has not published its address yet; its replicas "
                         "start with a later snapshot", once=True)
                continue
            try:
                self._push(address, rank, home, elsewhere, record, lineage, full=(holder, rank) not in self.synced)
                self.synced.add((holder, rank))
                landed += 1
            except (OSError, ReplicaError, ProtocolError, FormatError) as exc:
                self.synced.discard((holder, rank))
                log.info(f"replication of rank {rank} to node {holder} failed ({exc}); training continues, a "
                         "lost node restores from storage until a replica lands", once=True)
        if holders and landed == len(holders):
            with self.cond:
                self.landed[rank] = record.iteration

    def _push(self, address: PeerAddress, rank: int, home: str, elsewhere: dict[str, str], record: SlotRecord,
              lineage: list[Segment], full: bool) -> None:
        paths = {home, *elsewhere.values()}
        mappings = {}
        try:
            for path in paths:
                with open(path, "rb") as f:
                    mappings[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            mapping = mappings[home]
            size = int.from_bytes(mapping[:8], "little")
            header = mapping[:8 + size]
            layout = decode_header(header, file_len=len(mapping))
            sent = sorted(record.items) if full else sorted(i for i, v in record.items.items()
                                                             if v == record.iteration)
            source = {i: mappings[elsewhere.get(i, home)] for i in record.items}
            push = ReplicaPush(self.job, self.job.node_rank, rank, record, lineage, len(mapping), len(header), sent)
            reply = self._exchange(address, push, mapping, source, layout)
            if not reply.ok and reply.error == NEED_FULL and not full:
                push = ReplicaPush(self.job, self.job.node_rank, rank, record, lineage, len(mapping), len(header),
                                   sorted(record.items))
                reply = self._exchange(address, push, mapping, source, layout)
            if not reply.ok:
                raise ReplicaError(reply.error or "refused")
            sent = set(push.sent)
            with self.cond:
                self.sent["snapshots"] += 1
                self.sent["whole"] += len(sent) == len(record.items)
                self.sent["bytes"] += push.header_len + sum(e.end - e.begin for e in layout.tensors if e.item in sent)
        finally:
            for m in mappings.values():
                m.close()

    def _exchange(self, address: PeerAddress, push: ReplicaPush, home, source: dict, layout) -> ReplicaReply:
        """Send the push: its header from the ``home`` mapping, each sent item's bytes from ``source``
        (item -> the mapping of the slot file it is in)."""
        cap = self.job.replica_mbps
        with socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT) as sock:
            sock.settimeout(120.0)
            sock.sendall((push.dumps() + "\n").encode())
            sock.sendall(home[:push.header_len])
            started, sent_bytes = time.monotonic(), 0
            wanted = set(push.sent)
            for piece in runs([e for e in layout.tensors if e.item in wanted],
                              lambda a, b: a.end == b.begin and source[a.item] is source[b.item]):
                start, end = layout.data_start + piece[0].begin, layout.data_start + piece[-1].end
                with memoryview(source[piece[0].item]) as whole:
                    for offset in range(start, end, 4 << 20):
                        with whole[offset:min(offset + (4 << 20), end)] as chunk:
                            sock.sendall(chunk)
                            sent_bytes += len(chunk)
                        if cap:  # never ahead of the cap
                            ahead = sent_bytes / (cap * 1e6) - (time.monotonic() - started)
                            if ahead > 0:
                                time.sleep(ahead)
            return ReplicaReply.loads(_read_line(sock))


def pull(node_dir: str, job: JobInfo, rank: int, slot_path: str, storage: Storage
         ) -> tuple[SlotRecord, list[Segment]] | str:
    """Fetch ``rank``'s replica from this node's holders into ``slot_path`` (a slot file of the same
    layout), verified item by item; returns its record (``origin`` = the holder) and lineage, or why
    nothing could be pulled."""
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
                if os.path.getsize(slot_path) != reply.file_len:
                    problems.append(f"node {holder}: its replica is {reply.file_len} bytes, this rank's slot "
                                    f"{os.path.getsize(slot_path)} (another configuration)")
                    continue
                target = _map(slot_path, reply.file_len)
                try:
                    with memoryview(target) as view:
                        _recv_into(sock, view)
                    layout = decode_header(target[:8 + int.from_bytes(target[:8], "little")], file_len=len(target))
                    checks = reply.record.checks
                    actual = item_checks(target, layout, {i: checks.get(i) for i in reply.record.items})
                finally:
                    target.close()
            bad = sorted(i for i, value in actual.items() if value != checks.get(i))
            if bad:
                problems.append(f"node {holder}: replica fails its checksum for {', '.join(bad[:3])}")
                continue
            record = dataclasses.replace(reply.record, origin=holder)
            return record, reply.lineage
        except (OSError, ReplicaError, ProtocolError, FormatError) as exc:
            problems.append(f"node {holder}: {exc}")
    return "; ".join(problems) or "no replica holder for this node"
