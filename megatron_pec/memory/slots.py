"""Node memory files: a rank's two home slots and its expert pool, tmpfs files laid out as safetensors,
memory-mapped (layout: ``memory/slot_map.py``).

Trainer side (every rank, for its own files): ``SlotFiles`` allocates the rank's files once (after a
tmpfs space preflight), maps them and gives tensor views of an item in a slot, so a snapshot is one
copy per run of slices and a header rewrite. Which regions a snapshot may overwrite is
``regions.RegionBook``'s, following what the agent records and pins (``memory/history.py``,
``agent/pins.py``).

Reader side (agent, restore): ``open_slot`` maps a slot and parses its header; ``read_slot_metadata``
reads only the metadata; ``SlotCache`` keeps the agent's mappings and each rank's ``SlotMap``.
Whether a slot's contents are complete and restorable is decided by the agent's record of node memory,
never by the slot file alone.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import threading

from megatron_pec.format.protocol import SlotHeader
from megatron_pec.format.stformat import (
    MAX_HEADER,
    FormatError,
    Header,
    TensorEntry,
    decode_header,
    decode_metadata,
    encode_header,
    header_tail,
    read_head,
    read_header,
    tensor_table,
    tensor_views,
)
from megatron_pec.memory.node_files import home_slot_name, map_node_file, pool_name
from megatron_pec.memory.slot_map import HOMES_MAX, SlotMap, is_pool

HEADER_RESERVE = 256 << 10  # default room for metadata (small state, token counts) beyond the tensor table
HEADER_ALIGN = 4 << 10      # header sizes are rounded up to pages (node memory holds two home headers per rank)
VIEWS_KEPT = 4              # tensor views of pool regions kept per expert (a region holds one at a time)


class SlotSpaceError(RuntimeError):
    """The tmpfs cannot hold the slots; raised at start-up, before anything could SIGBUS."""


def slot_path(node_dir: str, rank: int, slot: int) -> str:
    """The file slot ``slot`` of ``rank`` lies in (every pool region: the pool file)."""
    return pool_path(node_dir, rank) if is_pool(slot) else os.path.join(node_dir, home_slot_name(rank, slot))


def pool_path(node_dir: str, rank: int) -> str:
    return os.path.join(node_dir, pool_name(rank))


def node_dir(shm_dir: str, job_id: str, node_rank: int) -> str:
    return os.path.join(shm_dir, job_id, f"node{node_rank}")


class SlotFiles:
    """One rank's node-memory files (two home slots, the expert pool), mapped into the trainer."""

    def __init__(self, directory: str, rank: int, layout: SlotMap, local_ranks: int,
                 replica_bytes: int = 0, reserve: int = HEADER_RESERVE):
        """``reserve``: header bytes for a save's metadata beyond the tensor table (its bound);
        ``replica_bytes``: what this node keeps of peers' snapshots per local rank (the preflight)."""
        self.directory, self.rank = directory, rank
        entries = layout.dense
        table = tensor_table(entries)
        needed = len(encode_header(entries, {}, table=table)) - 8 + reserve
        # Existing slots of this layout (a restart restores from them) keep their header size when it
        # is large enough: the reserve is partly measured, and a different size would move every tensor.
        self.capacity = self._existing_capacity(directory, rank, table, needed) or home_header_capacity(
            entries, reserve, table)
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
        # A restart keeps a larger pool than it plans (its regions may hold what it restores from).
        self.layout = _existing_pool(directory, rank, layout)
        self.pool_header = decode_header(self._pool_head(), None)
        self.pool_len = self.pool_header.data_start + self.layout.regions * self.layout.region_bytes
        self.homes = self.layout.homes
        self._preflight(local_ranks, replica_bytes)
        self.maps: list[mmap.mmap] = []
        self.views: list[dict[str, object]] = []  # home slot -> name -> view
        self._table_written: list[bool] = []  # whether a home slot's prefix already holds this table
        self._files: list[tuple[int, int]] = []  # (st_dev, st_ino) of each mapped file
        for s in range(self.homes):
            self.maps.append(self._map(slot_path(directory, rank, s), self.file_len))
            # (views of one tensor per dtype, so that runs of them coalesce: see coalesce.py)
            self.views.append(dict(zip([e.name for e in entries], tensor_views(self.maps[s], self.header, entries))))
            self._table_written.append(self.maps[s][:len(self.prefix)] == self.prefix)
        self.pool = self._map(pool_path(directory, rank), self.pool_len)
        self.maps.append(self.pool)
        head = self._pool_head()
        if self.pool[:len(head)] != head:
            self.pool[:len(head)] = head
        unknown = 8 + self.capacity - len(self.prefix)
        self._tail_len = [unknown] * self.homes  # unknown yet: blank it all once
        for s in range(self.homes):
            if not self._table_written[s]:  # (a new file: readable as holding no snapshot, by the agent too)
                self.write_header(s, {})
        # Still unknown: a replacement node's agent pulls a peer's replica into slot 0 after this (a
        # whole header of its own), so the first save in each slot blanks the whole header again.
        self._tail_len = [unknown] * self.homes
        self._region_views: dict[str, dict[int, dict[str, object]]] = {}  # expert -> region slot -> views

    def _pool_head(self) -> bytes:
        return encode_header(self.layout.pool_entries(), self.layout.pool_metadata())

    @property
    def footprint(self) -> int:
        """Bytes of node memory this rank's files take."""
        return self.homes * self.file_len + self.pool_len

    def item_views(self, slot: int, item: str) -> dict[str, object]:
        """name -> tensor view of ``item``'s tensors in ``slot`` (a home slot: the dense state)."""
        if not is_pool(slot):
            return {name: view for name, view in self.views[slot].items() if name.split("/", 1)[0] == item}
        kept = self._region_views.setdefault(item, {})
        views = kept.get(slot)
        if views is None:
            if len(kept) >= VIEWS_KEPT:
                kept.pop(next(iter(kept)))
            header = self.layout.item_header(slot, item, self.header, self.pool_header)
            views = kept[slot] = dict(zip([e.name for e in header.tensors],
                                          tensor_views(self.pool, header, header.tensors)))
        return views

    def item_header(self, slot: int, item: str) -> Header:
        """The header that places ``item`` in ``slot`` (see ``SlotMap.item_header``)."""
        return self.layout.item_header(slot, item, self.header, self.pool_header)

    def mapping(self, slot: int) -> mmap.mmap:
        return self.pool if is_pool(slot) else self.maps[slot]

    @staticmethod
    def _existing_capacity(directory: str, rank: int, table: bytes, needed: int) -> int | None:
        for s in range(HOMES_MAX):
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

    def _preflight(self, local_ranks: int, replica_bytes: int) -> None:
        """Node memory must hold this node's files and, with replication, the replicas it keeps of
        peers' ranks (peers' ranks are assumed the size of ours)."""
        os.makedirs(self.directory, exist_ok=True)
        paths = [slot_path(self.directory, self.rank, s) for s in range(self.homes)] + \
            [pool_path(self.directory, self.rank)]
        reusable = sum(os.path.getsize(p) for p in paths if os.path.exists(p))
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize + reusable
        need = self.footprint
        if free < (need + replica_bytes) * local_ranks and free < need + replica_bytes:
            raise SlotSpaceError(_space_message(self.directory, free, need, local_ranks, replica_bytes))
        # tmpfs pages (page-locked or not) are charged to the container's memory cgroup: a limit below
        # them is an OOM kill mid-training, so it is checked here too.
        limit = cgroup_memory()
        if limit is not None:
            room = limit[0] - limit[1] + reusable
            if room < (need + replica_bytes) * local_ranks and room < need + replica_bytes:
                raise SlotSpaceError(_cgroup_message(limit, room, free, need + replica_bytes, local_ranks,
                                                     bool(replica_bytes)))

    def mapped(self) -> dict[str, mmap.mmap]:
        """path -> this process's mapping of each of its files that is still the file at that path: a
        restore reads through them, its pages already mapped (a fresh mapping faults on every page)."""
        maps = {slot_path(self.directory, self.rank, s): self.maps[s] for s in range(self.homes)}
        maps[pool_path(self.directory, self.rank)] = self.pool
        return {path: maps[path] for path in self._still_mapped()}

    def mapped_views(self) -> dict[str, tuple[int, dict]]:
        """path -> (where the data starts, name -> view) of each home slot still at that path: a
        restore through this process's mapping takes these views instead of building them again."""
        still = set(self._still_mapped())
        return {path: (self.header.data_start, self.views[s]) for s in range(self.homes)
                if (path := slot_path(self.directory, self.rank, s)) in still}

    def _still_mapped(self) -> list[str]:
        paths = [slot_path(self.directory, self.rank, s) for s in range(self.homes)] + \
            [pool_path(self.directory, self.rank)]
        out = []
        for path, identity in zip(paths, self._files):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == identity:
                out.append(path)
        return out

    def _map(self, path: str, length: int) -> mmap.mmap:
        try:
            # (every page mapped now: a page first touched during a save costs a fault - regions this process
            # has not written yet, e.g. those a restart restores from)
            mapping, st = map_node_file(path, length, populate=True)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            stats = os.statvfs(self.directory)
            raise SlotSpaceError(_space_message(self.directory, stats.f_bavail * stats.f_frsize,
                                               self.footprint, 1) + f" ({exc.strerror})") from None
        self._files.append((st.st_dev, st.st_ino))
        return mapping

    def write_header(self, slot: int, metadata: dict[str, str]) -> None:
        """Rewrite a home slot's metadata (and, the first time, its length prefix and tensor table)."""
        start = len(self.prefix)
        tail = header_tail(metadata, 8 + self.capacity - start, after_entries=bool(self.header.tensors))
        # Blank only what the previous metadata covered beyond this one (the rest is blank already).
        end = start + max(len(tail), self._tail_len[slot])
        self.maps[slot][start:end] = tail + b" " * (end - start - len(tail))
        self._tail_len[slot] = len(tail)
        if not self._table_written[slot]:
            self.maps[slot][:start] = self.prefix
            self._table_written[slot] = True

    def invalidate(self, slot: int) -> None:
        """Mark a home slot as being written before its bytes change (a kill mid-copy leaves it invalid)."""
        self.write_header(slot, SlotHeader.WRITING)

    def close(self) -> None:
        self.views, self._region_views = [], {}  # tensor views export the maps' buffers; drop them before closing
        for m in self.maps:
            m.close()
        self.maps = []


def home_header_capacity(entries, reserve: int, table: bytes | None = None) -> int:
    """Header bytes (after the length prefix) of a slot file of ``entries``: their tensor table (``table``,
    if encoded already) and ``reserve`` for a save's metadata, aligned. The one computation of a slot's size."""
    table = tensor_table(entries) if table is None else table
    return _aligned(len(encode_header(entries, {}, table=table)) - 8 + reserve)


def home_file_bytes(entries, reserve: int) -> int:
    """A home slot file of ``entries`` (a rank's dense state) with ``reserve`` header bytes for metadata."""
    return 8 + home_header_capacity(entries, reserve) + (entries[-1].end if entries else 0)


def snapshot_file_bytes(layout: SlotMap, reserve: int) -> int:
    """One complete snapshot of a rank as a slot file of its own, its header naming every tensor (what a
    replica of the rank holds, and each slot of the three-region layout before the pool): the state
    that node memory is measured against."""
    return 8 + home_header_capacity(layout.full_entries(), reserve) + layout.state_bytes


def _aligned(header_bytes: int) -> int:
    return -(-header_bytes // HEADER_ALIGN) * HEADER_ALIGN


def _existing_pool(directory: str, rank: int, planned: SlotMap) -> SlotMap:
    """``planned``, or with the regions of an existing pool of the same experts if it has more."""
    try:
        with open(pool_path(directory, rank), "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            head = struct.pack("<Q", size) + f.read(min(size, MAX_HEADER))
        existing = SlotMap.from_headers(Header(planned.dense, {}, 0), decode_header(head, None))
    except (OSError, FormatError, struct.error):
        return planned
    if existing.experts != planned.experts or existing.region_bytes != planned.region_bytes \
            or existing.homes != planned.homes or existing.regions <= planned.regions:
        return planned
    return SlotMap(planned.dense, planned.experts, existing.regions, planned.region_bytes, planned.homes)


def _space_message(directory: str, free: int, need: int, local_ranks: int, replica_need: int = 0) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    total = (need + replica_need) * local_ranks
    text = (f"node memory {directory} has {mib(free)} free, but the snapshot files of {mib(need)} for each of "
            f"{local_ranks} local rank(s) need {mib(need * local_ranks)}. "
            f"Enlarge the tmpfs (for Docker: --shm-size={max(1, -(-total * 5 // 4 // 2**30))}g), "
            f"point --pec-shm-dir at a larger tmpfs, or give --pec-node-memory a smaller budget")
    if replica_need:
        text += (f"; the replicas this node keeps of peer nodes' snapshots need {mib(replica_need * local_ranks)} "
                 "more (--pec-replicas 0 turns them off)")
    return text + "."


def tmpfs_room(directory: str) -> tuple[int, int | None]:
    """(free bytes of the tmpfs ``directory`` is on, the memory the container's cgroup still allows or None)."""
    stats = os.statvfs(directory)
    limit = cgroup_memory()
    return stats.f_bavail * stats.f_frsize, (limit[0] - limit[1]) if limit is not None else None


def cgroup_memory() -> tuple[int, int, str] | None:
    """(limit, usage, where) of this process's memory cgroup (v2 files memory.max and memory.current,
    v1 memory.limit_in_bytes and memory.usage_in_bytes); None without a limit.
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
                    replicas: bool) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    total = need * local_ranks
    docker_gib = max(1, -(-(limit[0] + total) * 5 // 4 // 2**30))
    return (f"the container's memory limit ({limit[2]}: {mib(limit[0])}, {mib(limit[1])} in use) "
            f"leaves {mib(room)}, but the snapshot slots{' and replicas' if replicas else ''} of {local_ranks} local "
            f"rank(s) need {mib(total)} of node memory, which counts against that limit (the tmpfs itself has "
            f"{mib(free)} free). Raise the container's memory limit (for Docker: --memory={docker_gib}g)"
            + (", or lower --pec-replicas" if replicas else "") + ", or give --pec-node-memory a smaller budget.")


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
        self._layouts: dict[tuple, SlotMap] = {}  # (pool path, its metadata, home table) -> layout

    def layout(self, directory: str, rank: int) -> SlotMap:
        """The rank's node-memory layout, as its pool file and home slot 0 say (parsed once per layout)."""
        _, home = self.open(slot_path(directory, rank, 0))
        _, pool = self.open(pool_path(directory, rank))
        key = (pool_path(directory, rank), pool.metadata.get("experts"), pool.tensors, home.tensors)
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) > 64:
                self._layouts.clear()
            found = self._layouts[key] = SlotMap.from_headers(home, pool)
        return found

    def item(self, directory: str, rank: int, slot: int, item: str) -> tuple[mmap.mmap, Header]:
        """The mapping of the file ``item``'s region in ``slot`` lies in, and a header that places it there;
        raises OSError, ValueError or FormatError. (Many items: ``locator``.)"""
        return self.locator(directory, rank, slot, {item: slot})(item)

    def locator(self, directory: str, rank: int, home: int, places: dict[str, int]):
        """``locate(item)`` -> (mapping, header placing it) for the items of one snapshot (``places``: where
        not in ``home``): each file opened, and the pool's layout parsed, once for all of them."""
        opened: dict = {}

        def locate(item: str) -> tuple[mmap.mmap, Header]:
            slot = places.get(item, home)
            path = slot_path(directory, rank, slot)
            if path not in opened:
                opened[path] = self.open(path)
            mapping, header = opened[path]
            if not is_pool(slot):
                return mapping, header
            if "layout" not in opened:
                opened["layout"] = self.layout(directory, rank)
            return mapping, opened["layout"].item_header(slot, item, None, header)

        return locate

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
