"""Snapshot slots: tmpfs files laid out as safetensors, memory-mapped, triple-buffered.

Trainer side (every rank, for its own slots): ``SlotFiles`` allocates the
rank's three slot files once (after a tmpfs space preflight), maps them and
gives a tensor view per slice, so a snapshot is one copy per run of slices and a
header rewrite. Each slot file holds a region for every item; which regions a
snapshot may overwrite is ``regions.RegionBook``'s, following what the agent
records and pins (``agent/memory.py``, ``agent/pins.py``).

Reader side (agent, restore): ``open_slot`` maps a slot and parses its header; ``read_slot_metadata``
reads only the metadata.
Whether a slot's contents are complete and restorable is decided by the agent's
record of node memory, never by the slot file alone.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

from megatron_pec.protocol import SlotHeader
from megatron_pec.stformat import (MAX_HEADER, Header, TensorEntry, decode_metadata, encode_header, header_tail,
                                  read_head, read_header, tensor_table, tensor_views)

NUM_SLOTS = 3
REPLICA_SLOTS = 2  # per replicated rank: the complete replica and the one being received
HEADER_RESERVE = 256 << 10  # default room for metadata (small state, token counts) beyond the tensor table
HEADER_ALIGN = 64 << 10     # header sizes are rounded up to this (the reserve varies a little between runs)


class SlotSpaceError(RuntimeError):
    """The tmpfs cannot hold the slots; raised at start-up, before anything could SIGBUS."""


def slot_path(node_dir: str, rank: int, slot: int) -> str:
    return os.path.join(node_dir, f"rank{rank}.slot{slot}")


def node_dir(shm_dir: str, job_id: str, node_rank: int) -> str:
    return os.path.join(shm_dir, job_id, f"node{node_rank}")


class SlotFiles:
    """The three slot files of one rank, mapped into the trainer."""

    def __init__(self, directory: str, rank: int, entries: tuple[TensorEntry, ...], local_ranks: int,
                 replicas: int = 0, reserve: int = HEADER_RESERVE):
        """``reserve``: header bytes for a save's metadata beyond the tensor table (its bound)."""
        self.directory, self.rank, self.entries = directory, rank, entries
        table = tensor_table(entries)
        needed = len(encode_header(entries, {}, table=table)) - 8 + reserve
        # Existing slots of this layout (a restart restores from them) keep their header size when it
        # is large enough: the reserve is partly measured, and a different size would move every tensor.
        self.capacity = (self._existing_capacity(directory, rank, table, needed)
                         or -(-needed // HEADER_ALIGN) * HEADER_ALIGN)
        if self.capacity > MAX_HEADER:
            raise SlotSpaceError(
                f"rank {rank}'s snapshot header would need {self.capacity / 2**20:.1f} MiB "
                f"({len(entries)} tensor slices, {len(table) / 2**20:.1f} MiB of them the tensor table), more than "
                f"the {MAX_HEADER >> 20} MiB a header may have; spread the experts over more ranks "
                "(--expert-model-parallel-size) or more data-parallel ranks")
        # The length prefix and the tensor table never change: a save rewrites only what follows them.
        self.prefix = struct.pack("<Q", self.capacity) + table
        self.table = (table, entries)  # a restore reading these slots need not parse the table again
        self.header = Header(entries, {}, self.capacity)
        self.file_len = self.header.file_len
        self._preflight(local_ranks, replicas)
        self.maps: list[mmap.mmap] = []
        self.views: list[dict[str, object]] = []
        self._table_written: list[bool] = []  # whether a slot's prefix already holds this table
        self._files: list[tuple[int, int]] = []  # (st_dev, st_ino) of each mapped file
        for s in range(NUM_SLOTS):
            self.maps.append(self._map(slot_path(directory, rank, s)))
            # (views of one tensor per dtype, so that runs of them coalesce: see coalesce.py)
            self.views.append(dict(zip([e.name for e in entries], tensor_views(self.maps[s], self.header, entries))))
            self._table_written.append(self.maps[s][:len(self.prefix)] == self.prefix)
        self._tail_len = [8 + self.capacity - len(self.prefix)] * NUM_SLOTS  # unknown yet: blank it all once

    @staticmethod
    def _existing_capacity(directory: str, rank: int, table: bytes, needed: int) -> int | None:
        for s in range(NUM_SLOTS):
            try:
                with open(slot_path(directory, rank, s), "rb") as f:
                    head = f.read(8 + len(table))
            except OSError:
                continue
            if len(head) == 8 + len(table) and head[8:] == table:
                size = int.from_bytes(head[:8], "little")
                if needed <= size <= MAX_HEADER:
                    return size
        return None

    def _preflight(self, local_ranks: int, replicas: int) -> None:
        """Node memory must hold this node's slots and, with replication, the replicas it keeps of
        peers' ranks (two slots per replicated rank; peers' ranks are assumed the size of ours)."""
        os.makedirs(self.directory, exist_ok=True)
        reusable = sum(os.path.getsize(p) for s in range(NUM_SLOTS)
                       if os.path.exists(p := slot_path(self.directory, self.rank, s)))
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize + reusable
        need = NUM_SLOTS * self.file_len
        replica_need = REPLICA_SLOTS * replicas * self.file_len
        if free < (need + replica_need) * local_ranks and free < need + replica_need:
            raise SlotSpaceError(_space_message(self.directory, free, need, local_ranks, replicas, replica_need))
        # tmpfs pages (page-locked or not) are charged to the container's memory cgroup: a limit below
        # them is an OOM kill mid-training, so it is checked here too.
        limit = cgroup_memory()
        if limit is not None:
            room = limit[0] - limit[1] + reusable
            if room < (need + replica_need) * local_ranks and room < need + replica_need:
                raise SlotSpaceError(_cgroup_message(limit, room, free, need + replica_need, local_ranks, replicas))

    def mapped(self) -> dict[str, mmap.mmap]:
        """path -> this process's mapping of each slot file that is still the file at that path: a
        restore reads through them, its pages already mapped (a fresh mapping faults on every page)."""
        return {path: self.maps[s] for s, path in self._still_mapped()}

    def mapped_views(self) -> dict[str, tuple[int, dict]]:
        """path -> (where the data starts, name -> view) of each slot file still at that path: a
        restore through this process's mapping takes these views instead of building them again
        (90k of them on a large MoE rank)."""
        return {path: (self.header.data_start, self.views[s]) for s, path in self._still_mapped()}

    def _still_mapped(self) -> list[tuple[int, str]]:
        out = []
        for s, identity in enumerate(self._files):
            path = slot_path(self.directory, self.rank, s)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == identity:
                out.append((s, path))
        return out

    def _map(self, path: str) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            self._files.append((st.st_dev, st.st_ino))
            if st.st_size != self.file_len:
                os.ftruncate(fd, self.file_len)
            try:
                # Reserve the pages now: a full tmpfs fails here with a message, not with SIGBUS later.
                os.posix_fallocate(fd, 0, self.file_len)
            except OSError as exc:
                stats = os.statvfs(self.directory)
                raise SlotSpaceError(_space_message(self.directory, stats.f_bavail * stats.f_frsize,
                                                   NUM_SLOTS * self.file_len, 1) + f" ({exc.strerror})") from None
            # Map every page now: a page first touched during a save costs a fault (regions this
            # process has not written yet, e.g. those a restart restores from).
            return mmap.mmap(fd, self.file_len, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)

    def write_header(self, slot: int, metadata: dict[str, str]) -> None:
        """Rewrite the slot's metadata (and, the first time, its length prefix and tensor table)."""
        start = len(self.prefix)
        tail = header_tail(metadata, 8 + self.capacity - start, after_entries=bool(self.entries))
        # Blank only what the previous metadata covered beyond this one (the rest is blank already).
        end = start + max(len(tail), self._tail_len[slot])
        self.maps[slot][start:end] = tail + b" " * (end - start - len(tail))
        self._tail_len[slot] = len(tail)
        if not self._table_written[slot]:
            self.maps[slot][:start] = self.prefix
            self._table_written[slot] = True

    def invalidate(self, slot: int) -> None:
        """Mark a slot as being written before its bytes change (a kill mid-copy leaves it invalid)."""
        self.write_header(slot, SlotHeader.WRITING)

    def close(self) -> None:
        self.views = []  # tensor views export the maps' buffers; drop them before closing
        for m in self.maps:
            m.close()
        self.maps = []


def _space_message(directory: str, free: int, need: int, local_ranks: int, replicas: int = 0,
                   replica_need: int = 0) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    total = (need + replica_need) * local_ranks
    text = (f"node memory {directory} has {mib(free)} free, but {NUM_SLOTS} snapshot slots of "
            f"{mib(need // NUM_SLOTS)} for each of {local_ranks} local rank(s) need {mib(need * local_ranks)}. "
            f"Enlarge the tmpfs (for Docker: --shm-size={max(1, -(-total * 5 // 4 // 2**30))}g) "
            f"or point --pec-shm-dir at a larger tmpfs")
    if replicas:
        text += (f", or lower --pec-replicas {replicas}: the replicas this node keeps of peer nodes' snapshots "
                 f"need {mib(replica_need * local_ranks)} more")
    return text + "."


def cgroup_memory() -> tuple[int, int, str] | None:
    """(limit, usage, where) of this process's memory cgroup (v2 ``memory.max``/``memory.current``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``); None without a limit.
    ``MEGATRON_PEC_CGROUP_DIR`` points the check at another directory holding those files."""
    for directory in _cgroup_dirs():
        for limit_name, usage_name in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            try:
                with open(os.path.join(directory, limit_name)) as f:
                    limit = f.read().strip()
                with open(os.path.join(directory, usage_name)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
                return None
            return int(limit), usage, os.path.join(directory, limit_name)
    return None


def _cgroup_dirs() -> list[str]:
    override = os.environ.get("MEGATRON_PEC_CGROUP_DIR")
    if override:
        return [override]
    dirs = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    dirs.append("/sys/fs/cgroup" + path)
                elif "memory" in controllers.split(","):
                    dirs.append("/sys/fs/cgroup/memory" + path)
    except OSError:
        pass
    return dirs + ["/sys/fs/cgroup", "/sys/fs/cgroup/memory"]


def _cgroup_message(limit: tuple[int, int, str], room: int, free: int, need: int, local_ranks: int,
                    replicas: int) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    total = need * local_ranks
    docker_gib = max(1, -(-(limit[0] + total) * 5 // 4 // 2**30))
    return (f"the container's memory limit ({limit[2]}: {mib(limit[0])}, {mib(limit[1])} in use) "
            f"leaves {mib(room)}, but the snapshot slots{' and replicas' if replicas else ''} of {local_ranks} local "
            f"rank(s) need {mib(total)} of node memory, which counts against that limit (the tmpfs itself has "
            f"{mib(free)} free). Raise the container's memory limit (for Docker: --memory={docker_gib}g)"
            + (f", or lower --pec-replicas {replicas}" if replicas else "") + ".")


class SlotCache:
    """The node agent's mappings of slot files, each with its parsed tensor table.

    The agent reads a slot's header at every snapshot and its bytes at persists: a mapping kept keeps
    the pages a persist faulted in, and a large MoE rank's table is megabytes of JSON that stays the
    same for a configuration. A slot file replaced or resized (another configuration) is mapped and parsed
    anew. Mappings are the cache's: callers never close them.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}
        self._known: dict[str, tuple[bytes, tuple[TensorEntry, ...]]] = {}

    def open(self, path: str) -> tuple[mmap.mmap, Header]:
        """The slot's mapping and parsed header; raises OSError, ValueError or FormatError."""
        with self._lock:
            st = os.stat(path)
            identity = (st.st_dev, st.st_ino, st.st_size)
            cached = self._maps.get(path)
            if cached is None or cached[0] != identity:
                if cached is not None:
                    _close_quietly(cached[1])
                with open(path, "r+b") as f:  # (not populated: a memory-only snapshot's bytes are never touched)
                    mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)
                self._maps[path] = cached = (identity, mapping)
            known = self._known.get(path)
            _, header = open_slot(path, cached[1], known)
            if known is None or header.tensors is not known[1]:
                self._known[path] = (tensor_table(header.tensors), header.tensors)
            return cached[1], header


def _close_quietly(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view of it is still referenced (a traceback): it is unmapped when that goes


def read_slot_metadata(path: str) -> dict[str, str]:
    """A slot header's metadata, read without mapping the file or parsing its tensor table; raises
    OSError or FormatError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return decode_metadata(read_head(lambda offset, length: os.pread(fd, length, offset), os.fstat(fd).st_size))
    finally:
        os.close(fd)


def open_slot(path: str, mapping: mmap.mmap | None = None,
              known: tuple[bytes, tuple[TensorEntry, ...]] | None = None) -> tuple[mmap.mmap, Header]:
    """Map a slot file (or take ``mapping``, an existing one of it, which stays open on errors) and
    parse its header (``known``: the table this process writes, see ``decode_header``); raises
    OSError or FormatError."""
    m = mapping
    if m is None:
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), 0)
    try:
        # Copies of the header bytes, not memoryviews: a view kept alive by a FormatError's
        # traceback would make m.close() raise BufferError instead (slots of another configuration).
        return m, read_header(lambda offset, length: m[offset:offset + length], len(m), known)[1]
    except Exception:
        if mapping is None:
            m.close()
        raise
