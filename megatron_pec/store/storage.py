"""Storage behind one small interface (``Storage``): atomic write, read, list, remove, lock.

Everything megatron-pec reads or writes under a checkpoint directory (--save, --load) goes through a
``Storage``, injected once where a process starts using it - the engine (``api``), the node agent and
the command line (``__main__``), which all take ``default_storage()`` - and handed on from there,
mostly inside a ``checkpoint_dir.CheckpointDir``. Knows nothing of Megatron. ``write_atomic`` is the
only way bytes become visible: tmp file, fsync, rename, directory fsync - so a reader never sees a
torn file. Node memory (tmpfs slots) is not storage: ``memory/slots.py`` and ``memory/history.py`` own it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import queue
import threading
from contextlib import contextmanager
from typing import ContextManager, Iterable, Protocol

from megatron_pec.common import faults
from megatron_pec.integrity.checksum import crc32

CHUNK = 8 << 20


class Storage(Protocol):
    """What megatron-pec asks of the storage that holds checkpoint directories (paths are absolute).

    Reads raise OSError (``FileNotFoundError`` for a missing file); writes raise OSError and leave
    nothing partial visible."""

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview],
                     before_rename=None) -> tuple[int, int]:
        """``chunks`` become ``path`` at once, durable; returns (size, crc32). A chunk is written and
        summed before the next is asked for (its bytes may change then). ``before_rename()`` runs
        once the bytes are durable and may raise to keep them from becoming ``path``."""

    def write_text_atomic(self, path: str, text: str) -> None: ...

    def write_text_once(self, path: str, text: str) -> None:
        """``text`` becomes ``path`` atomically unless ``path`` exists (a record written once)."""

    def read(self, path: str) -> bytes: ...

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        """``length`` bytes from ``offset``; EIO when the file ends before."""

    def read_checked(self, path: str) -> tuple[memoryview, int]:
        """The whole file and its crc32, computed while it is read."""

    def size(self, path: str) -> int: ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Sorted names in ``path``; empty when it does not exist."""

    def remove(self, path: str) -> None:
        """Remove a file; nothing when it does not exist."""

    def remove_empty_dirs(self, path: str) -> None: ...

    def fsync_dir(self, path: str) -> None: ...

    def lock(self, path: str) -> ContextManager:
        """An exclusive lock named ``path``, held for the ``with`` block (serialises commits)."""


def default_storage() -> Storage:
    """The storage the entry points inject: POSIX files, local or shared. The one place that builds it."""
    return PosixStorage()


class PosixStorage:
    """Files under a local or shared POSIX file system (``Storage``)."""

    def write_atomic(self, path: str, chunks: Iterable[bytes | memoryview], before_rename=None) -> tuple[int, int]:
        """Write ``chunks`` to ``path`` atomically; returns (size, crc32). ``before_rename()``, if given, runs
        once the bytes are durable and may raise to keep them from becoming ``path``. Raises OSError."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        size, crc = 0, RunningCrc()
        try:
            with open(tmp, "wb", buffering=0) as f:
                for chunk in chunks:
                    faults.point("persist_write", path=path)
                    for start in range(0, len(chunk), CHUNK):  # bounded syscalls, steady progress
                        piece = chunk[start:start + CHUNK]
                        crc.add(piece)
                        f.write(piece)
                        size += len(piece)
                    # A chunk's bytes may change once the next one is asked for (a persist hands
                    # each item's node-memory region back as soon as it is written).
                    crc.caught_up()
                os.fsync(f.fileno())
            if before_rename is not None:
                before_rename()
            faults.point("before_rename", path=path)
            os.replace(tmp, path)
        except BaseException:
            crc.result()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self.fsync_dir(directory)
        return size, crc.result()

    def write_text_atomic(self, path: str, text: str) -> None:
        self.write_atomic(path, [text.encode()])

    def write_text_once(self, path: str, text: str) -> None:
        # (not through write_atomic: the trainer writes these records, outside the agents' fault points)
        if os.path.exists(path):
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``path`` from ``offset``, in a writable buffer; raises EIO if the
        file ends before (it shrank while being read)."""
        return self._read(path, offset, length, None)

    def read_checked(self, path: str) -> tuple[memoryview, int]:
        """The whole file in a writable buffer (tensors view it without copies) and its crc32, each
        chunk's checksum computed while the next one is read (one pass's time, not two).

        The buffer is not zero-filled first (``bytearray(n)`` is: page faults and a memset, a third
        of a cold read): the read fills every byte or raises."""
        import numpy  # (not at module level: the agent starts without it)

        crc = RunningCrc()
        try:
            length = os.path.getsize(path)
            buf = self._read(path, 0, length, crc, memoryview(numpy.empty(length, dtype=numpy.uint8)))
        finally:
            actual = crc.result()
        return buf, actual

    @staticmethod
    def _read(path: str, offset: int, length: int, crc: "RunningCrc | None", buf=None):
        buf = bytearray(length) if buf is None else buf
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            view, got = memoryview(buf), 0
            while got < length:
                n = f.readinto(view[got:got + CHUNK])
                if not n:
                    raise OSError(errno.EIO, f"{path} ends before byte {offset + length}")
                if crc is not None:
                    crc.add(view[got:got + n])
                got += n
        return buf

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def remove_empty_dirs(self, path: str) -> None:
        for root, _, _ in sorted(os.walk(path), key=lambda t: -len(t[0])):
            try:
                os.rmdir(root)
            except OSError:
                pass

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextmanager
    def lock(self, path: str):
        with open(path, "a") as f:  # (flock: every process of this host; a shared file system's own rules beyond)
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


class RunningCrc:
    """crc32 of a byte stream, computed in a background thread so it overlaps the writes
    (the crc releases the GIL). A piece must stay unchanged until ``caught_up()`` or ``result()``."""

    def __init__(self):
        self.crc = 0
        self.pieces: queue.Queue = queue.Queue(maxsize=16)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (piece := self.pieces.get()) is not None:
            self.crc = crc32(piece, self.crc)
            self.pieces.task_done()

    def add(self, piece) -> None:
        self.pieces.put(piece)

    def caught_up(self) -> None:
        """Wait until every piece added is summed (its bytes may change from then on)."""
        self.pieces.join()

    def result(self) -> int:
        if self.thread.is_alive():
            self.pieces.put(None)
            self.thread.join()
        return self.crc


__all__ = ["Storage", "PosixStorage", "RunningCrc", "default_storage", "CHUNK"]
