"""The names of what a job keeps in a node's memory directory (``<shm dir>/<job id>/node<k>/``), the lock
that serialises starting and stopping its node agent, and the clean-up at the job's end.

Everything in that directory belongs to one job: its trainers' home slots, expert pools and memory plans,
its agent's socket, pid, lock, index, CPU ledger and the replicas it keeps for peers. Stdlib only: the
agent imports it before anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import shutil

SOCKET = "agent.sock"
PIDFILE = "agent.pid"
LOCKFILE = "agent.lock"  # held by a trainer starting an agent, and by an agent from its last job to its exit
AGENT_LOG = "agent.log"  # the one file a job leaves behind (without --pec-keep-shm)
REPLICAS = "replicas"    # the folder of the replicas this node keeps for its peers

RANK_FILE = re.compile(r"rank(\d+)\.(slot\d+|pool)")  # a rank's node memory: home slots and expert pool


def replace_node_file(path: str, text: str) -> None:
    """``text`` becomes the node-memory file ``path`` at once (``<path>.tmp``, then a rename; tmpfs: no
    fsync). The one way the agent and the trainers write node memory's small files (indexes, the pid,
    the CPU ledger); node memory is not checkpoint storage, which goes through ``store.storage``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def map_node_file(path: str, length: int, populate: bool = False) -> tuple[mmap.mmap, os.stat_result]:
    """(a shared mapping of the node-memory file ``path``, created or resized to ``length`` bytes, the file's
    stat). Its pages are reserved first: a full tmpfs fails here with OSError (ENOSPC), not with SIGBUS at
    a later write. ``populate``: map every page now (a page first touched in a save would cost a fault)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_size != length:
            os.ftruncate(fd, length)
        os.posix_fallocate(fd, 0, length)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, length, flags=flags), st
    finally:
        os.close(fd)


def home_slot_name(rank: int, slot: int) -> str:
    return f"rank{rank}.slot{slot}"


def pool_name(rank: int) -> str:
    return f"rank{rank}.pool"


def memory_sizing_name(rank: int) -> str:
    """The node memory a rank planned at start-up (for ``inspect``)."""
    return f"rank{rank}.memory.json"


@contextlib.contextmanager
def agent_lock(directory: str):
    """Hold the node's agent lock. The lock file is removed at the job's end by whoever holds it, so a
    waiter may wake holding a file no longer in the directory: it then locks the one that is."""
    path = os.path.join(directory, LOCKFILE)
    while True:
        with open(path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _is_in_place(lock, path):
                yield
                return


def _is_in_place(opened, path: str) -> bool:
    try:
        return os.fstat(opened.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def remove_stale_tmp(directory: str) -> None:
    """Half-written node files (``*.tmp``) a killed agent left behind (``replace_node_file``'s)."""
    for name in os.listdir(directory):
        if name.endswith(".tmp"):
            os.unlink(os.path.join(directory, name))


def remove_job_files(directory: str) -> None:
    """Everything a job created in its node directory but the agent's log (called with ``agent_lock`` held,
    by the agent at its exit: the lock file goes last, unlocked by the exit)."""
    for entry in os.scandir(directory):
        if entry.name == AGENT_LOG:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


__all__ = ["SOCKET", "PIDFILE", "LOCKFILE", "AGENT_LOG", "REPLICAS", "RANK_FILE", "map_node_file", "home_slot_name",
           "pool_name",
           "memory_sizing_name", "agent_lock", "remove_job_files", "remove_stale_tmp"]
