"""Storage behind one seam shaped for objects (``Storage``): write an object whole or streamed in
parts, create it once, commit it atomically, read it or ranges of it, list a prefix, delete.

Everything megatron-pec reads or writes under a checkpoint directory (--save, --load) goes through
the job's one ``Storage``: built from its description (``open_storage(spec)``, ``--pec-storage``) where
a process starts using it - the engine (``api``), the command line (``__main__``) - and rebuilt by the
node agent from the same description, which travels in the job description (``JobInfo.storage``). It
is handed on from there, mostly inside a ``checkpoint_dir.CheckpointDir``. Knows nothing of Megatron.

The protocol asks nothing an object store cannot do: no rename, no directory fsync, no lock, no
temporary names. Those are ``PosixStorage``'s way of keeping the promises (a write becomes visible
whole or not at all; ``commit`` is a compare-and-swap), and telling a dead writer's leftovers from a
live writer's is its question too (``discard_partial``). An object store keeps them with whole or
multipart uploads (invisible until completed), conditional puts (If-None-Match / If-Match) or, where
the store has none, a read-back of what was written. A storage that cannot be reached now (an object
store's outage) raises ``common.errors.StorageUnreachable``: training goes on from node memory. Node
memory (tmpfs slots) is not storage: ``memory/`` owns it.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import importlib
import os
import queue
import re
import shutil
import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Protocol

from megatron_pec.common import faults
from megatron_pec.integrity.checksum import CHUNK, crc32


class Storage(Protocol):
    """What megatron-pec asks of the storage that holds checkpoint directories. Paths are strings
    (absolute POSIX paths, or an object store's keys: "/"-separated names under a prefix).

    Reads raise OSError (``FileNotFoundError`` for a missing object); writes raise OSError and leave
    nothing partial visible under the object's name."""

    spec: str
    """The description ``open_storage`` rebuilds this storage from in another process (the node agent)."""

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, int]:
        """``chunks`` become the object ``path`` at once, durable, replacing what it held; returns (size,
        crc32). Streamed: a chunk is written and summed before the next is asked for (its bytes may
        change then); the whole object is never staged in memory."""

    def create(self, path: str, data: bytes) -> bool:
        """``data`` becomes ``path`` unless ``path`` exists (a record written once); True if this call
        created it."""

    def commit(self, path: str, data: bytes, expected: bytes | None) -> bool:
        """Atomically and durably replace ``path`` by ``data`` if it holds ``expected`` now (None: if it
        does not exist); False, writing nothing, if it holds anything else (another writer won). The
        one switch of what a checkpoint directory holds (manifests, the tracker)."""

    def read(self, path: str) -> bytes: ...

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        """``length`` bytes from ``offset``; EIO when the object ends before."""

    def read_checked(self, path: str) -> tuple[memoryview, int]:
        """The whole object and its crc32, computed while it is read."""

    def prefetch(self, path: str) -> None:
        """Optional (``prefetch`` below): ``path`` will be read whole soon; start fetching it now, in the
        background (a restore decides and allocates meanwhile). A hint: errors show when it is read."""

    def read_checked_into(self, path: str, pieces: Iterable) -> int:
        """The whole object into ``pieces`` (writable buffers whose sizes add up to the object's), filled
        in turn, and its crc32, computed while it is read; EIO when the object ends before. A piece is
        filled before the next one is asked for, which may hand out the same buffer again (a ring of
        staging buffers: ``restore/read_ring.py``)."""

    def size(self, path: str) -> int: ...

    def exists(self, path: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """Sorted names directly under ``prefix`` (objects and deeper prefixes, like a "/"-delimited
        listing); empty when there are none. Partial writes are not listed."""

    def delete(self, path: str) -> None:
        """Delete an object; nothing when it does not exist."""

    def delete_prefix(self, prefix: str) -> None:
        """Delete everything under ``prefix``, partial writes included."""

    def discard_partial(self, prefix: str, live_too: bool) -> list[str]:
        """Remove the leftovers of writes directly under ``prefix`` that never completed: those whose
        writer is gone (a killed agent's), and with ``live_too`` those still being written as well.
        Returns the names of the objects they were to become."""


def open_storage(spec: str) -> Storage:
    """The storage ``spec`` describes - the one place that builds one: "" or "posix" for POSIX files
    (local or shared); "<scheme>://..." for a scheme registered with ``register_scheme``; or
    "package.module:Class" (optionally followed by "?<anything>"), a class built as ``Class(spec)``
    - how a test or a site plugs its own storage into the trainer and its node agent. Raises
    ValueError for a spec it cannot build."""
    if spec in ("", "posix"):
        return PosixStorage()
    scheme, sep, _ = spec.partition("://")
    if sep:
        if scheme not in SCHEMES:
            raise ValueError(f"--pec-storage {spec!r}: no storage for the scheme {scheme!r} "
                             f"(known: posix, {', '.join(sorted(SCHEMES)) or 'none registered'})")
        return SCHEMES[scheme](spec)
    module, colon, name = spec.partition("?")[0].partition(":")
    if not colon or not module or not name:
        raise ValueError(f"--pec-storage {spec!r}: give 'posix', '<scheme>://...' or 'package.module:Class'")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--pec-storage {spec!r}: cannot import {module}:{name} ({exc})") from None
    return factory(spec)


def prefetch(storage: Storage, path: str) -> None:
    """``storage.prefetch(path)`` where the storage has it (a site's own storage may not)."""
    fetch = getattr(storage, "prefetch", None)
    if fetch is not None:
        fetch(path)


def spec_argument(spec: str, what: str) -> str:
    """What a ``package.module:Class?<argument>`` description gives its class after "?" (``what`` names it in
    the error); ValueError when there is none."""
    _, sep, argument = spec.partition("?")
    if not sep or not argument:
        raise ValueError(f"{spec!r}: give {what} after '?'")
    return argument


SCHEMES: dict[str, Callable[[str], Storage]] = {}
"""URL scheme -> the factory of its storage (called with the whole spec)."""


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    SCHEMES[scheme] = factory


def _msc(spec: str) -> Storage:
    from megatron_pec.store.msc_storage import MscStorage  # (MSC itself is imported only when used)

    return MscStorage(spec)


register_scheme("msc", _msc)  # Megatron's --enable-msc paths, msc://<profile>/<path>


PREFETCH_PIECE = 4 << 20  # bytes asked for per call (within any kernel's readahead limit)
_PARTIAL = re.compile(r"\.tmp(\d+)$")  # PosixStorage's temporary name: <name>.tmp<writer's pid>
_LOCK = ".pec.lock"


class PosixStorage:
    """Files under a local or shared POSIX file system (``Storage``). A write goes to
    ``<path>.tmp<pid>``, is fsynced, renamed over ``path`` and its directory fsynced; ``commit`` does so
    under an exclusive lock on ``<directory>/.pec.lock`` (flock: every process of this host; a shared
    file system's own rules beyond), which serialises the compare and the swap."""

    spec = "posix"

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, int]:
        """Raises OSError (the temporary file is removed)."""
        return self._put(path, chunks, faults.point)

    def create(self, path: str, data: bytes) -> bool:
        with self._lock(os.path.dirname(path)):
            if os.path.exists(path):
                return False
            # (no fault points: the trainer writes these records, outside the agents' fault points)
            self._put(path, [data], lambda *_, **__: None)
        return True

    def commit(self, path: str, data: bytes, expected: bytes | None) -> bool:
        with self._lock(os.path.dirname(path)):
            try:
                current = self.read(path)
            except FileNotFoundError:
                current = None
            if current != expected:
                return False
            self.write(path, [data])
        return True

    def _put(self, path: str, chunks: Iterable[bytes | memoryview], point) -> tuple[int, int]:
        """tmp, fsync, rename, directory fsync; ``point``: the fault points on the way."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        size, crc = 0, RunningCrc()
        try:
            with open(tmp, "wb", buffering=0) as f:
                for chunk in chunks:
                    point("persist_write", path=path)
                    for start in range(0, len(chunk), CHUNK):  # bounded syscalls, steady progress
                        piece = chunk[start:start + CHUNK]
                        crc.add(piece)
                        f.write(piece)
                        size += len(piece)
                    # A chunk's bytes may change once the next one is asked for (a persist hands
                    # each item's node-memory region back as soon as it is written).
                    crc.caught_up()
                os.fsync(f.fileno())
            point("before_rename", path=path)
            os.replace(tmp, path)
        except BaseException:
            crc.result()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._fsync_dir(directory)
        return size, crc.result()

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``path`` from ``offset``, in a writable buffer; raises EIO if the
        file ends before (it shrank while being read)."""
        return self._read(path, offset, length, None)

    def prefetch(self, path: str) -> None:
        """The kernel reads the file into the page cache (POSIX_FADV_WILLNEED), asked from a thread: for a
        large file the call itself waits while the disk's queue is full."""
        threading.Thread(target=_will_need, args=(path,), name="pec-prefetch", daemon=True).start()

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

    def read_checked_into(self, path: str, pieces: Iterable) -> int:
        """Each piece filled straight from the file (no buffer between), its crc32 summed in the background
        while the next is read; a buffer handed out again waits until the crc has taken its earlier bytes."""
        crc, summing = RunningCrc(), set()  # (the addresses of the pieces the crc may not have taken yet)
        try:
            with open(path, "rb", buffering=0) as f:
                for piece in pieces:
                    view, got = memoryview(piece).cast("B"), 0
                    address = _address(view)
                    if address in summing:
                        crc.caught_up()
                        summing.clear()
                    summing.add(address)
                    while got < len(view):
                        n = f.readinto(view[got:got + CHUNK])
                        if not n:
                            raise OSError(errno.EIO, f"{path} ends before its pieces do")
                        crc.add(view[got:got + n])
                        got += n
        finally:
            actual = crc.result()
        return actual

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

    def list(self, prefix: str) -> list[str]:
        try:
            names = os.listdir(prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if n != _LOCK and not _PARTIAL.search(n))

    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        self._fsync_dir(os.path.dirname(path))  # durable, in order: a manifest goes before its files

    def delete_prefix(self, prefix: str) -> None:
        try:
            shutil.rmtree(prefix)
        except FileNotFoundError:
            pass

    def discard_partial(self, prefix: str, live_too: bool) -> list[str]:
        try:
            names = os.listdir(prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for name in sorted(names):
            m = _PARTIAL.search(name)
            if m and (live_too or not _writer_alive(int(m.group(1)))):
                self.delete(os.path.join(prefix, name))
                found.append(name[:m.start()])
        return found

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    @contextmanager
    def _lock(directory: str):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, _LOCK), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _will_need(path: str) -> None:
    """Ask for the whole file a piece at a time: the kernel reads at most its readahead size per call (8 MiB
    where this was measured)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # (the read says what is wrong)
    try:
        for offset in range(0, os.fstat(fd).st_size, PREFETCH_PIECE):
            os.posix_fadvise(fd, offset, PREFETCH_PIECE, os.POSIX_FADV_WILLNEED)
    except (OSError, AttributeError):
        pass  # (a file system or a platform without it: read as before)
    finally:
        os.close(fd)


def _writer_alive(pid: int) -> bool:
    """Whether the process writing a temporary file (named after its pid) still runs on this host: an
    agent persisting while a trainer restarts. (A writer on another node is not seen: its file goes,
    and its write fails with an error.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _address(view: memoryview) -> int:
    """Where a writable buffer's bytes start."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0


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


__all__ = ["Storage", "PosixStorage", "RunningCrc", "open_storage", "prefetch", "register_scheme", "spec_argument",
           "SCHEMES", "CHUNK"]
