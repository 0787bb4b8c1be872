"""Helpers shared by the benchmark driver and its torchrun workers: machine facts, load
waiting, statistics, file-system helpers. Imports neither torch nor Megatron.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SHM_ROOT = "/dev/shm/bench_helper"
STORAGE_ROOT = "/tmp/bench_helper_ckpt"


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def wait_for_quiet(limit: float = 1.5, max_wait_s: float = 180.0, log=print) -> dict:
    """Wait (up to ``max_wait_s``) until the 1-minute load average drops below ``limit``.

    Other work on this machine (test suites of other engineers) inflates every
    timing; the load seen before a measurement is recorded next to it.
    """
    start = time.monotonic()
    first = loadavg()
    while loadavg() >= limit and time.monotonic() - start < max_wait_s:
        time.sleep(5)
    now = loadavg()
    waited = time.monotonic() - start
    if now >= limit:
        log(f"[bench] WARNING: 1-min load still {now:.2f} after {waited:.0f}s; measuring anyway")
    elif waited > 1:
        log(f"[bench] waited {waited:.0f}s for the load to drop ({first:.2f} -> {now:.2f})")
    return {"load_1min_before": now, "waited_s": round(waited, 1)}


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "os": platform.platform(),
            "python": sys.version.split()[0], "gpu": None,
            "storage": _fs_of(STORAGE_ROOT), "node_memory": _fs_of("/dev/shm"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    try:
        import importlib.metadata as md

        info["packages"] = {p: md.version(p) for p in ("torch", "megatron-core", "dlrover", "nvidia-resiliency-ext")
                            if _has_dist(md, p)}
    except Exception:  # informational only
        pass
    return info


def _has_dist(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def _fs_of(path: str) -> str:
    os.makedirs(path, exist_ok=True) if path.startswith("/tmp") else None
    try:
        out = subprocess.run(["df", "-hT", path], capture_output=True, text=True, timeout=10).stdout.splitlines()
        fields = out[-1].split()
        return f"{fields[1]} on {fields[0]} ({fields[2]} total)"
    except Exception:
        return "unknown"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def p90(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    # nearest-rank percentile: with few samples this is the second-largest or the largest
    k = max(0, min(len(xs) - 1, int(round(0.9 * len(xs) + 0.5)) - 1))
    return xs[k]


def drop_file_cache(paths) -> None:
    """Evict files from the page cache so a restore really reads storage (they are fsynced or
    written back first; POSIX_FADV_DONTNEED only drops clean pages)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def files_under(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out.extend(os.path.join(dirpath, n) for n in names)
    return out


def allocated_bytes(paths) -> int:
    """Bytes the files hold in their file system (tmpfs: node memory used), not their sizes: a slot file
    is as large as its tensors from the start, its pages come as they are written."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            pass
    return total


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(p) for p in files_under(root) if os.path.isfile(p))
