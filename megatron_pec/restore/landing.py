"""A persisted rank file read straight into the host tensors a restore writes: no buffer between, no copy
after (load step 6 for a host rank's whole file: ``Source.read_into``, called by ``restore.FileReads``).

Reading a rank file into a buffer and then copying it into the optimizer costs a second pass over every
byte and a second copy of the state in memory while it runs. Here each tensor of the file lands in the
live tensor the restore would copy it into (runs that follow each other in the file and in memory are one
read), the file's CRC-32 computed while it is read, as before. On a GPU rank a tensor on the device lands
through a ring of page-locked buffers, each copied to the device while the next is read
(``restore/read_ring.py``). A tensor without such a destination (another dtype or size, on a device without
a staging) lands in a buffer of its own and is copied later, as every tensor was.

The restore reads it once the ranks agreed on the plan (the loader read and checked only its header): a
file that fails its checksum there is refused as a node-memory item is where it landed, the iteration
excluded and the state restored again from what the restore takes instead.
"""

from __future__ import annotations

import numpy
import torch

from megatron_pec.format.protocol import RankFile
from megatron_pec.format.stformat import Header, TensorEntry, torch_dtype
from megatron_pec.restore.read_ring import DeviceReadRing
from megatron_pec.store.storage import Storage


class LandingError(RuntimeError):
    """The file is not what its manifest entry says (the message says how); nothing or part of it landed."""


def land_rank_file(path: str, entry: RankFile, header: Header, storage: Storage,
                   destinations: dict[str, torch.Tensor],
                   staging: DeviceReadRing | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read the whole file ``path`` (its manifest ``entry``; ``header``: its header, read and checked before,
    whose bytes are read again in the checksum's stream but not parsed again) into ``destinations`` (slice
    name -> tensor) where they fit: host tensors directly, ``staging``'s device tensors through it; returns
    (name -> the destination it landed in, name -> (buffer, offset) of the tensors that did not land). Raises
    LandingError or OSError (part of it may have landed)."""
    size = storage.size(path)
    if size != entry.size:  # (it changed since its header was read)
        raise LandingError(f"{path} is {size} bytes, the manifest says {entry.size} (truncated?)")
    pieces, landed, kept = [bytearray(header.data_start)], {}, {}
    for entries, target in _runs(header.tensors, destinations, staging):
        if target is None:  # (one buffer for each stretch of tensors that do not land)
            target = numpy.empty(entries[-1].end - entries[0].begin, dtype=numpy.uint8)
            kept.update((e.name, (target, e.begin - entries[0].begin)) for e in entries)
        else:
            landed.update((e.name, destinations[e.name]) for e in entries)
        pieces.append(target)
    try:
        actual = storage.read_checked_into(path, _through(pieces, staging))
    finally:
        if staging is not None:
            staging.finish()
    if actual != entry.crc32:
        raise LandingError(f"{path} fails its checksum (crc32 {actual:08x}, recorded {entry.crc32:08x}): the "
                           "file is corrupt")
    return landed, kept


def _through(pieces: list, staging: DeviceReadRing | None):
    """``pieces`` as the storage fills them: a device stretch (a uint8 tensor on the device) through
    ``staging``'s buffers, the others as they are."""
    for piece in pieces:
        if isinstance(piece, torch.Tensor):
            yield from staging.through(piece)
        else:
            yield piece


def _runs(entries: tuple[TensorEntry, ...], destinations: dict[str, torch.Tensor], staging: DeviceReadRing | None):
    """(entries, the bytes they land in, or None) for each stretch of consecutive entries (the file's data
    is contiguous) whose destinations follow each other in one storage, or that have none."""
    stretch, first, end = [], None, 0
    for e in entries:
        target = _destination(e, destinations.get(e.name), staging)
        if stretch and not _continues(first, end, target):
            yield stretch, _bytes(first, end, _staged(first, staging))
            stretch = []
        if not stretch:
            first = target
        stretch.append(e)
        if target is not None:
            end = target.data_ptr() + target.numel() * target.element_size()
    if stretch:
        yield stretch, _bytes(first, end, _staged(first, staging))


def _continues(first: torch.Tensor | None, end: int, target: torch.Tensor | None) -> bool:
    """``target`` extends the stretch that starts at ``first``: both land nowhere, or it starts at ``end`` in
    ``first``'s storage."""
    if first is None or target is None:
        return first is None and target is None
    return target.data_ptr() == end and target.device == first.device \
        and target.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def _destination(e: TensorEntry, live: torch.Tensor | None, staging: DeviceReadRing | None) -> torch.Tensor | None:
    """``live`` where ``e``'s bytes can be read straight into it: a flat tensor of its dtype and size, on the
    host or reached through ``staging``."""
    if live is None or live.dim() != 1 or not live.is_contiguous() or live.numel() != e.numel \
            or live.dtype != torch_dtype(e.dtype) or e.numel == 0:
        return None
    if live.device.type != "cpu" and not _staged(live, staging):
        return None
    return live.detach()


def _staged(target: torch.Tensor | None, staging: DeviceReadRing | None) -> bool:
    return target is not None and staging is not None and staging.takes(target)


def _bytes(first: torch.Tensor | None, end: int | None, staged: bool):
    """The bytes from the start of ``first`` to ``end``: writable host memory, or a uint8 tensor where they
    are ``staged`` (None: a stretch that does not land)."""
    if first is None:
        return None
    flat = first.view(torch.uint8)
    run = flat.as_strided((end - first.data_ptr(),), (1,), flat.storage_offset())
    return run if staged else run.numpy()


__all__ = ["LandingError", "land_rank_file"]
