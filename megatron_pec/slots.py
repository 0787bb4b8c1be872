"""Snapshot slots: tmpfs files laid out as safetensors, memory-mapped, triple-buffered.

Trainer side (every rank, for its own slots): ``SlotFiles`` allocates the
rank's three slot files once (after a tmpfs space preflight), maps them and
gives a tensor view per slice, so a snapshot is one copy per slice and a
header rewrite. ``SlotRing`` decides which slot the next snapshot may use: never
one the agent still reads, never the newest complete snapshot.

Reader side (agent, restore): ``open_slot`` maps a slot read-only and parses
its header. Whether a slot's contents are complete is decided by the agent's
slot index (``slots.json``), never by the slot file alone.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass, field

from megatron_pec.stformat import Header, TensorEntry, decode_header, encode_header, tensor_table, tensor_view

NUM_SLOTS = 3
HEADER_RESERVE = 256 << 10  # room for metadata (small state, token counts) beyond the tensor table
INDEX = "slots.json"


class SlotSpaceError(RuntimeError):
    """The tmpfs cannot hold the slots; raised at start-up, before anything could SIGBUS."""


def slot_path(node_dir: str, rank: int, slot: int) -> str:
    return os.path.join(node_dir, f"rank{rank}.slot{slot}")


def node_dir(shm_dir: str, job_id: str, node_rank: int) -> str:
    return os.path.join(shm_dir, job_id, f"node{node_rank}")


class SlotFiles:
    """The three slot files of one rank, mapped into the trainer."""

    def __init__(self, directory: str, rank: int, entries: tuple[TensorEntry, ...], local_ranks: int):
        self.directory, self.rank, self.entries = directory, rank, entries
        self.table = tensor_table(entries)  # encoded once; each save only encodes its metadata
        self.capacity = len(encode_header(entries, {}, table=self.table)) - 8 + HEADER_RESERVE
        self.capacity = (self.capacity + 7) // 8 * 8
        self.header = Header(entries, {}, self.capacity)
        self.file_len = self.header.file_len
        self._preflight(local_ranks)
        self.maps: list[mmap.mmap] = []
        self.views: list[dict[str, object]] = []
        for s in range(NUM_SLOTS):
            self.maps.append(self._map(slot_path(directory, rank, s)))
            self.views.append({e.name: tensor_view(self.maps[s], self.header, e) for e in entries})

    def _preflight(self, local_ranks: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        reusable = sum(os.path.getsize(p) for s in range(NUM_SLOTS)
                       if os.path.exists(p := slot_path(self.directory, self.rank, s)))
        stats = os.statvfs(self.directory)
        free = stats.f_bavail * stats.f_frsize + reusable
        need = NUM_SLOTS * self.file_len
        if free < need * local_ranks and free < need:
            raise SlotSpaceError(_space_message(self.directory, free, need, local_ranks))

    def _map(self, path: str) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != self.file_len:
                os.ftruncate(fd, self.file_len)
            try:
                # Reserve the pages now: a full tmpfs fails here with a message, not with SIGBUS later.
                os.posix_fallocate(fd, 0, self.file_len)
            except OSError as exc:
                stats = os.statvfs(self.directory)
                raise SlotSpaceError(_space_message(self.directory, stats.f_bavail * stats.f_frsize,
                                                   NUM_SLOTS * self.file_len, 1) + f" ({exc.strerror})") from None
            # Map every page now: a page first touched during a save costs a fault (the experts the
            # agent carried in were never touched by this process) - ~10 ms per 30 MB on CPU.
            return mmap.mmap(fd, self.file_len, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)

    def write_header(self, slot: int, metadata: dict[str, str]) -> None:
        self.maps[slot][:8 + self.capacity] = encode_header(self.entries, metadata, self.capacity, self.table)

    def invalidate(self, slot: int) -> None:
        """Mark a slot as being written before its bytes change (a kill mid-copy leaves it invalid)."""
        self.write_header(slot, {"state": "writing"})

    def close(self) -> None:
        self.views = []  # tensor views export the maps' buffers; drop them before closing
        for m in self.maps:
            m.close()
        self.maps = []


def _space_message(directory: str, free: int, need: int, local_ranks: int) -> str:
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    return (f"megatron-pec: node memory {directory} has {mib(free)} free, but {NUM_SLOTS} snapshot slots of "
            f"{mib(need // NUM_SLOTS)} for each of {local_ranks} local rank(s) need {mib(need * local_ranks)}. "
            f"Enlarge the tmpfs (for Docker: --shm-size={max(1, -(-need * local_ranks * 5 // 4 // 2**30))}g) "
            f"or point --pec-shm-dir at a larger tmpfs.")


@dataclass
class SlotRing:
    """Which slot the next snapshot writes (triple buffering, PEC section 3.2)."""

    iteration: list[int]  # iteration held by each slot, -1 if none
    held: list[bool]      # the agent is still reading it
    latest: int | None = None
    base: list[int | None] = field(default_factory=lambda: [None] * NUM_SLOTS)  # carry-forward source

    @classmethod
    def empty(cls) -> "SlotRing":
        return cls([-1] * NUM_SLOTS, [False] * NUM_SLOTS)

    def choose(self) -> int | None:
        """The free slot with the oldest contents: never the newest complete snapshot, nor one the
        agent still copies unwritten experts from (the base of a slot it has not released)."""
        busy = {self.base[s] for s in range(NUM_SLOTS) if self.held[s]}
        free = [s for s in range(NUM_SLOTS) if not self.held[s] and s != self.latest and s not in busy]
        return min(free, key=lambda s: self.iteration[s]) if free else None

    def filled(self, slot: int, iteration: int) -> int | None:
        """Record a new snapshot; returns its base: the previous newest snapshot, from which the
        agent carries forward the experts this one did not write."""
        base = self.latest if self.latest is not None and self.iteration[self.latest] >= 0 else None
        self.iteration[slot], self.held[slot], self.latest, self.base[slot] = iteration, True, slot, base
        return base

    def released(self, slot: int) -> None:
        self.held[slot] = False

    def forget_after(self, iteration: int) -> None:
        """Treat slots holding iterations after ``iteration`` as empty (overwritten first)."""
        self.iteration = [-1 if i > iteration else i for i in self.iteration]
        kept = [s for s in range(NUM_SLOTS) if self.iteration[s] >= 0]
        self.latest = max(kept, key=lambda s: self.iteration[s]) if kept else None

    def agent_lost(self) -> None:
        """A dead agent reads nothing any more."""
        self.held = [False] * NUM_SLOTS


def open_slot(path: str) -> tuple[mmap.mmap, Header]:
    """Map a slot file and parse its header; raises OSError or FormatError."""
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    try:
        # A copy of just the header, not a memoryview: a view kept alive by a FormatError's
        # traceback would make m.close() raise BufferError instead (slots of another configuration).
        size = int.from_bytes(m[:8], "little")
        return m, decode_header(m[: min(len(m), 8 + min(size, 64 << 20))], file_len=len(m))
    except Exception:
        m.close()
        raise


def read_index(directory: str) -> dict:
    """The agent's record of complete slots: {rank: {slot: {iteration, crc32, ...}}}."""
    try:
        with open(os.path.join(directory, INDEX)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
