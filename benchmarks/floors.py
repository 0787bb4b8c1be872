"""The hardware limits a checkpoint method is measured against, in the same run.

* memcpy floor: both ranks at once copy N bytes (their own optimizer-shard size) from an
  ordinary tensor into a pre-allocated tmpfs mapping with one ``copy_`` - the least a snapshot
  to node memory can cost.
* write floor: one writer streams the node's bytes from tmpfs to a file on the checkpoint
  storage in 8 MiB writes, then fsyncs - the least a persist by the node agent can cost. The
  same with one writer per rank in parallel is recorded too.
* read floor: that file read back in 8 MiB reads with its pages dropped from the page cache first -
  the least a restore from storage can cost.

Runs in the torchrun worker; every function is collective.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from benchmarks.collective import broadcast_value, reduce_max
from benchmarks.common import drop_file_cache

CHUNK = 8 << 20


def _tmpfs_map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def memcpy_floor(shm_dir: str, rank: int, nbytes: int, reps: int = 5) -> dict:
    """Seconds for one ``copy_`` of ``nbytes`` into a tmpfs mapping (median over reps of the
    slower rank), and back out of it (``memcpy_from_tmpfs_s``, a restore's copy); both ranks copy
    at the same time, as they do in a save and a restore."""
    os.makedirs(shm_dir, exist_ok=True)
    path = os.path.join(shm_dir, f"floor_rank{rank}")
    numel = nbytes // 4
    src = torch.empty(numel, dtype=torch.float32).uniform_()
    m = _tmpfs_map(path, numel * 4)
    dst = torch.frombuffer(m, dtype=torch.float32, count=numel)
    dst.copy_(src)  # warm-up: page tables populated as they are for reused snapshot slots
    times, back = [], []
    for _ in range(reps):
        torch.distributed.barrier()
        t = time.perf_counter()
        dst.copy_(src)
        times.append(reduce_max(time.perf_counter() - t))
    for _ in range(reps):  # the other direction: what a restore from node memory copies
        torch.distributed.barrier()
        t = time.perf_counter()
        src.copy_(dst)
        back.append(reduce_max(time.perf_counter() - t))
    del dst
    median, back_median = sorted(times)[len(times) // 2], sorted(back)[len(back) // 2]
    return {"memcpy_s": median, "memcpy_bytes_per_rank": numel * 4,
            "memcpy_GBps_per_rank": numel * 4 / median / 1e9, "memcpy_from_tmpfs_s": back_median,
            "_map": m, "_path": path}


def slices_memcpy(m: mmap.mmap, tensors: list, reps: int = 5) -> float:
    """Seconds to copy each of ``tensors`` (this rank's optimizer-shard slices) back to back into the
    tmpfs mapping ``m``: the data movement of a full snapshot without any bookkeeping."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.frombuffer(m, dtype=torch.uint8, count=total)
    dsts, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dsts.append(flat[offset:offset + n].view(t.dtype))
        offset += n
    for d, t in zip(dsts, tensors):
        d.copy_(t)
    times = []
    for _ in range(reps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for d, t in zip(dsts, tensors):
            d.copy_(t)
        times.append(reduce_max(time.perf_counter() - t0))
    del dsts, flat
    return sorted(times)[len(times) // 2]


def _write_file(path: str, sources: list, fsync: bool = True) -> int:
    written = 0
    with open(path, "wb", buffering=0) as f:
        for src in sources:
            view = memoryview(src)
            for start in range(0, len(view), CHUNK):
                written += f.write(view[start:start + CHUNK])
        if fsync:
            os.fsync(f.fileno())
    return written


def _read_file(path: str) -> int:
    """Read ``path`` start to end in CHUNK-sized reads into one reused buffer."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            total += n
    return total


def cold_read_floor(files: list[str] | None, rank: int) -> float | None:
    """Seconds one reader (rank 0) takes to read ``files`` cold, start to end, one after another: the floor
    of a restore that reads them. Every rank calls it (None on every rank without ``files``)."""
    if not files:
        return None
    torch.distributed.barrier()
    elapsed = 0.0
    if rank == 0:
        drop_file_cache(files)
        t = time.perf_counter()
        for path in files:
            _read_file(path)
        elapsed = time.perf_counter() - t
        drop_file_cache(files)  # (the restore after it reads them cold too)
    return broadcast_value(elapsed)


def storage_floors(storage_dir: str, rank: int, world: int, shm_paths: list[str], reps: int = 3) -> dict:
    """Sequential write + fsync of the node's bytes (every rank's memcpy buffer) by one writer (rank 0),
    and by one writer per rank in parallel; then the read floor: rank 0 reads the file it wrote back
    cold (page cache dropped), as a restore from storage reads."""
    os.makedirs(storage_dir, exist_ok=True)
    single, parallel, read = [], [], []
    total = sum(os.path.getsize(p) for p in shm_paths)
    for _ in range(reps):
        torch.distributed.barrier()
        if rank == 0:
            maps = []
            for p in shm_paths:
                with open(p, "rb") as f:
                    maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
            target = os.path.join(storage_dir, "floor_single")
            t = time.perf_counter()
            n = _write_file(target, maps)
            elapsed = time.perf_counter() - t
            for m in maps:
                m.close()
            single.append(n / elapsed / 1e6)
            drop_file_cache([target])
            t = time.perf_counter()
            n = _read_file(target)
            read.append(n / (time.perf_counter() - t) / 1e6)
            os.unlink(target)
        torch.distributed.barrier()
        with open(shm_paths[rank], "rb") as f:
            mine = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        target = os.path.join(storage_dir, f"floor_parallel_{rank}")
        torch.distributed.barrier()
        t = time.perf_counter()
        _write_file(target, [mine])
        elapsed = reduce_max(time.perf_counter() - t)
        mine.close()
        os.unlink(target)
        parallel.append(total / elapsed / 1e6)
    middle = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0
    return {"write_MBps": broadcast_value(middle(single)), "write_MBps_parallel": middle(parallel),
            "read_MBps": broadcast_value(middle(read)), "write_bytes": total,
            "write_reps_MBps": single if rank == 0 else None, "read_reps_MBps": read if rank == 0 else None}
