"""Checkpoint directories on an object store through NVIDIA's Multi-Storage Client (MSC), the client
Megatron-LM uses with ``--enable-msc``: paths are ``msc://<profile>/<key>``, the profiles come from the
file ``MSC_CONFIG`` names (``Storage`` for the scheme ``msc``).

How it keeps ``Storage``'s promises on S3:

* ``write`` streams: chunks are copied into parts of ``PART`` bytes (summed as they are copied: a chunk
  may change once the next is asked for) and uploaded as one multipart upload, up to ``IN_FLIGHT``
  parts at once - invisible until completed, so never partial under its name. An object smaller than
  one part is one PUT. MSC's own writers stage the whole object (memory or a temporary file) before
  uploading, so the parts go through the profile's boto3 client directly.
* ``create`` is a PUT with If-None-Match: *, ``commit`` a PUT with If-Match: <the ETag of what was
  read> (If-None-Match: * for ``expected=None``): the store decides the race, not a read-back. A store
  that ignores these headers would turn both into plain overwrites (last writer wins).
* ``list`` is a "/"-delimited listing; ``discard_partial`` aborts pending multipart uploads (only with
  ``live_too``: S3 does not say whether their writer still runs; a dead writer's go with
  ``delete_prefix``, or with the bucket's lifecycle rule for incomplete uploads).

Errors of the client (5xx after MSC's retries) become OSError, as the protocol asks, and
``StorageUnreachable`` (an OSError) where the endpoint cannot be reached; a missing object is
FileNotFoundError.
"""

from __future__ import annotations

import errno
import posixpath
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterable

from megatron_pec.common import faults
from megatron_pec.common.errors import StorageUnreachable
from megatron_pec.integrity.checksum import crc32

SCHEME = "msc://"
PART = 16 << 20  # bytes per uploaded part / ranged read (S3 asks at least 5 MiB of every part but the last)
IN_FLIGHT = 4  # parts uploaded (or ranges read) at once per object: memory is bounded by (IN_FLIGHT + 1) * PART
INSTALL = 'pip install "multi-storage-client[boto3]"'


def is_url(path: str | None) -> bool:
    return bool(path) and path.startswith(SCHEME)


def profile_of(url: str) -> str:
    return url[len(SCHEME):].split("/", 1)[0]


class MscStorage:
    """``Storage`` on whatever an MSC profile reaches (S3 and S3-compatible stores: conditional PUTs
    and multipart uploads need the s3 provider). ``spec``: ``msc://`` or ``msc://<profile>[/...]``
    (the profile is then checked up front); paths are full ``msc://<profile>/<key>`` URLs."""

    def __init__(self, spec: str):
        self.spec = spec
        self._pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="msc-part")
        self._lock = threading.Lock()
        self._providers: dict[str, object] = {}
        _import_msc()
        if profile_of(spec):
            self._provider(spec)

    # ---- MSC -------------------------------------------------------------------------------------
    def _provider(self, url: str):
        """(the profile's storage provider, the key under its base path) of ``url``."""
        if not is_url(url):
            raise ValueError(f"{url!r} is no msc://<profile>/<path> URL")
        profile, _, key = url[len(SCHEME):].partition("/")
        with self._lock:
            provider = self._providers.get(profile)
            if provider is None:
                provider = self._providers[profile] = _resolve(profile)
        return provider, key

    def _bucket_key(self, provider, key: str) -> tuple[str, str]:
        bucket, _, full = provider._prepend_base_path(key).lstrip("/").partition("/")
        return bucket, full

    # ---- writes ----------------------------------------------------------------------------------
    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, int]:
        provider, key = self._provider(path)
        size, crc, part, upload = 0, 0, bytearray(), None
        try:
            for chunk in chunks:
                faults.point("persist_write", path=path)
                chunk = memoryview(chunk).cast("B")
                at = 0
                while at < len(chunk):
                    piece = chunk[at:at + PART - len(part)]
                    crc = crc32(piece, crc)
                    part += piece  # (a copy: the chunk may change once the next is asked for)
                    at += len(piece)
                    if len(part) == PART:
                        upload = upload or _Multipart(self, provider, key, path)
                        upload.add(part)
                        part = bytearray()
                size += len(chunk)
            faults.point("before_rename", path=path)
            if upload is None:
                with _io(path):
                    provider.put_object(key, bytes(part))
            else:
                if part:
                    upload.add(part)
                upload.complete()
                upload = None
        finally:
            if upload is not None:
                upload.abort()
        return size, crc

    def create(self, path: str, data: bytes) -> bool:
        return self._put_if(path, data, if_none_match="*")

    def commit(self, path: str, data: bytes, expected: bytes | None) -> bool:
        if expected is None:
            return self._put_if(path, data, if_none_match="*")
        provider, key = self._provider(path)
        try:
            with _io(path):
                etag = provider.get_object_metadata(key, strict=False).etag  # (first: a change after it fails the PUT)
                current = provider.get_object(key)
        except FileNotFoundError:
            return False
        if current != expected:
            return False
        return self._put_if(path, data, if_match=etag)

    def _put_if(self, path: str, data: bytes, **condition) -> bool:
        from multistorageclient.types import PreconditionFailedError

        provider, key = self._provider(path)
        try:
            with _io(path):
                provider.put_object(key, bytes(data), **condition)
        except PreconditionFailedError:
            return False
        return True

    # ---- reads -----------------------------------------------------------------------------------
    def read(self, path: str) -> bytes:
        provider, key = self._provider(path)
        with _io(path):
            return provider.get_object(key)

    def read_range(self, path: str, offset: int, length: int) -> bytearray:
        return bytearray(self._get_range(path, offset, length)) if length else bytearray()

    def _get_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``, as the client returns them (``length`` > 0)."""
        from multistorageclient.types import Range

        provider, key = self._provider(path)
        with _io(path):
            data = provider.get_object(key, byte_range=Range(offset, length))
        if len(data) != length:
            raise OSError(errno.EIO, f"{path} ends before byte {offset + length}")
        return data

    def read_checked(self, path: str) -> tuple[memoryview, int]:
        """The object in a writable numpy-backed buffer, read in ``PART`` ranges ``IN_FLIGHT`` at once;
        each range summed as it is its turn (in order)."""
        import numpy

        length = self.size(path)
        buf = memoryview(numpy.empty(length, dtype=numpy.uint8))
        ranges = [(o, min(PART, length - o)) for o in range(0, length, PART)]

        def fetch(o: int, n: int) -> int:
            buf[o:o + n] = self._get_range(path, o, n)  # (straight into place: no bytearray between)
            return o

        crc = 0
        for future in [self._pool.submit(fetch, o, n) for o, n in ranges]:  # (in order: the crc runs in order)
            o = future.result()
            crc = crc32(buf[o:o + min(PART, length - o)], crc)
        return buf, crc

    def read_checked_into(self, path: str, pieces: Iterable) -> int:
        """``read_checked``'s parallel ranges, then copied into the pieces (a network read dwarfs the copy)."""
        buf, crc = self.read_checked(path)
        at = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            if at + len(view) > len(buf):
                raise OSError(errno.EIO, f"{path} ends before its pieces do")
            view[:] = buf[at:at + len(view)]
            at += len(view)
        return crc

    def size(self, path: str) -> int:
        provider, key = self._provider(path)
        with _io(path):
            return provider.get_object_metadata(key).content_length

    def exists(self, path: str) -> bool:
        """An object, or (like a directory) a prefix with anything under it."""
        provider, key = self._provider(path)
        try:
            with _io(path):
                provider.get_object_metadata(key)
            return True
        except FileNotFoundError:
            return bool(self.list(path))

    def list(self, prefix: str) -> list[str]:
        provider, key = self._provider(prefix)
        key = key.rstrip("/") + "/" if key.rstrip("/") else ""
        with _io(prefix):
            found = provider.list_objects(key, include_directories=True)
            # (an emptied folder of a store with real folders lists itself: not something under it)
            return sorted({posixpath.basename(o.key.rstrip("/")) for o in found if o.key.rstrip("/") + "/" != key}
                          - {""})

    # ---- deletes ---------------------------------------------------------------------------------
    def delete(self, path: str) -> None:
        provider, key = self._provider(path)
        try:
            with _io(path):
                provider.delete_object(key)
        except FileNotFoundError:
            pass

    def delete_prefix(self, prefix: str) -> None:
        provider, key = self._provider(prefix)
        key = key.rstrip("/") + "/"
        with _io(prefix):
            keys = [o.key for o in provider.list_objects(key)]
            if keys:
                provider.delete_objects(keys)
            # Stores with real folders (SeaweedFS) keep listing the emptied ones: delete them too, deepest
            # first (a "<folder>/" key; where there is none, as on AWS S3, a no-op).
            folders = {key} | {k[:i + 1] for k in keys for i in range(len(key), len(k)) if k[i] == "/"}
            bucket, _ = self._bucket_key(provider, key)
            for folder in sorted(folders, key=len, reverse=True):
                provider._s3_client.delete_object(Bucket=bucket, Key=self._bucket_key(provider, folder)[1])
        self._abort_uploads(prefix, directly_under=False)

    def discard_partial(self, prefix: str, live_too: bool) -> list[str]:
        return self._abort_uploads(prefix, directly_under=True) if live_too else []

    def _abort_uploads(self, prefix: str, directly_under: bool) -> list[str]:
        provider, key = self._provider(prefix)
        bucket, full = self._bucket_key(provider, key.rstrip("/") + "/")
        s3 = provider._s3_client
        with _io(prefix):
            uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=full).get("Uploads", [])
            names = []
            for u in uploads:
                name = u["Key"][len(full):]
                if directly_under and "/" in name:
                    continue
                s3.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
                names.append(name)
        return sorted(names)


class _Multipart:
    """One multipart upload: parts go up ``IN_FLIGHT`` at a time on the storage's pool; ``add`` waits
    while that many are in flight (the memory bound)."""

    def __init__(self, storage: MscStorage, provider, key: str, path: str):
        self.s3, self.path = provider._s3_client, path
        self.bucket, self.key = storage._bucket_key(provider, key)
        self.pool = storage._pool
        with _io(path):
            self.id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        self.parts: list = []
        self.slots = threading.Semaphore(IN_FLIGHT)

    def add(self, data: bytearray) -> None:
        self.slots.acquire()
        number = len(self.parts) + 1
        self.parts.append(self.pool.submit(self._upload, number, data))

    def _upload(self, number: int, data: bytearray) -> dict:
        try:
            with _io(self.path):
                r = self.s3.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.id, PartNumber=number,
                                        Body=data)  # (its own: ``write`` starts a new part after ``add``)
            return {"PartNumber": number, "ETag": r["ETag"]}
        finally:
            self.slots.release()

    def complete(self) -> None:
        parts = [f.result() for f in self.parts]
        with _io(self.path):
            self.s3.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.id,
                                              MultipartUpload={"Parts": parts})

    def abort(self) -> None:
        for f in self.parts:
            f.exception()  # (wait: a part finishing after the abort would be kept by some stores)
        try:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.id)
        except Exception:  # noqa: BLE001 (best effort: the write's own error is what is raised)
            pass


def _import_msc():
    try:
        import multistorageclient
    except ImportError as exc:
        raise ValueError(f"msc:// paths need the Multi-Storage Client, which is not importable here ({exc}): "
                         f"{INSTALL}") from None
    return multistorageclient


def _resolve(profile: str):
    msc = _import_msc()
    try:
        client, _ = msc.resolve_storage_client(f"{SCHEME}{profile}/")
        provider = client.delegate._storage_provider  # (conditional PUTs and multipart: the provider's own)
    except Exception as exc:  # noqa: BLE001 (MSC raises ValueError, KeyError, ... for a bad config)
        raise ValueError(f"msc://{profile}/: MSC has no usable profile {profile!r} ({exc}); define it in the "
                         "YAML file the environment variable MSC_CONFIG names") from None
    if not hasattr(provider, "_s3_client"):
        raise ValueError(f"msc://{profile}/: megatron-pec needs an S3 profile (type: s3) for conditional puts "
                         f"and multipart uploads; {profile!r} is {type(provider).__name__}")
    return provider


@contextmanager
def _io(path: str):
    """The client's errors as OSError (the protocol's); FileNotFoundError and PreconditionFailed pass."""
    from multistorageclient.types import PreconditionFailedError

    try:
        yield
    except (OSError, PreconditionFailedError):
        raise
    except Exception as exc:  # noqa: BLE001 (botocore, MSC's RetryableError, ...)
        error = StorageUnreachable if _unreachable(exc) else OSError
        raise error(errno.EIO, f"{path}: {type(exc).__name__}: {exc}") from exc


# botocore's names for an endpoint that cannot be reached (MSC wraps them in its own errors, naming them)
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError", "ReadTimeoutError",
                "ConnectionRefusedError", "NewConnectionError")


def _unreachable(exc: BaseException) -> bool:
    """``exc`` (or an error it was raised from) says the endpoint could not be reached."""
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__ in _UNREACHABLE or any(f"error type: {name}" in str(exc) for name in _UNREACHABLE):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


__all__ = ["MscStorage", "is_url", "profile_of", "SCHEME", "PART", "IN_FLIGHT"]
