"""Storage behind a small interface: atomic write, read, list, remove.

Used by the node agent (persist, commit) and by restore (read). Knows nothing
of Megatron. ``write_atomic`` is the only way bytes become visible: tmp file,
fsync, rename, directory fsync - so a reader never sees a torn file.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from typing import Iterable

from megatron_pec import faults
from megatron_pec.checksum import crc32

CHUNK = 8 << 20


class PosixStorage:
    """Files under a local or shared POSIX file system."""

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


class RunningCrc:
    """crc32 of a byte stream, computed in a background thread so it overlaps the writes
    (the crc releases the GIL). Pieces must stay unchanged until ``result()``."""

    def __init__(self):
        self.crc = 0
        self.pieces: queue.Queue = queue.Queue(maxsize=16)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (piece := self.pieces.get()) is not None:
            self.crc = crc32(piece, self.crc)

    def add(self, piece) -> None:
        self.pieces.put(piece)

    def result(self) -> int:
        if self.thread.is_alive():
            self.pieces.put(None)
            self.thread.join()
        return self.crc

