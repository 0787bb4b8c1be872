"""Agent phase 5: check a snapshot slot and persist its persist-level items as a rank file.

Runs in the node agent process, one slot at a time. Reads the slot's bytes
straight from the tmpfs mapping; writes a compact safetensors file (the slot's
non-expert tensors plus the persist-level experts) atomically.
"""

from __future__ import annotations

import json
import zlib
from concurrent.futures import ThreadPoolExecutor

from megatron_pec.slots import open_slot
from megatron_pec.stformat import FormatError, encode_header
from megatron_pec.storage import CHUNK, PosixStorage


class SnapshotMismatch(RuntimeError):
    """The slot's header does not describe the snapshot the trainer announced."""


def item_checksums(buffer, header, items: set[str]) -> dict[str, int]:
    """crc32 of each item's data (its tensors in header order): what a restore verifies, for
    just the items it reads. The same bytes in a slot or a compact rank file give the same value."""
    crcs, view = {}, memoryview(buffer)
    for entry in header.tensors:
        if entry.item in items:
            crc, end = crcs.get(entry.item, 0), header.data_start + entry.end
            for offset in range(header.data_start + entry.begin, end, CHUNK):
                crc = zlib.crc32(view[offset:min(offset + CHUNK, end)], crc)
            crcs[entry.item] = crc
    return {i: crcs.get(i, 0) for i in items}


def check_and_persist(path: str, iteration: int, persist_items: set[str] | None, target: str | None,
                      storage: PosixStorage) -> dict:
    """Validate the slot at ``path`` for ``iteration``; persist it to ``target`` if given.

    Returns the slot record ``{iteration, items, crcs, tokens}`` (the items the snapshot wrote,
    their crc32s; tokens stays empty until experts are carried in) plus, when persisted,
    ``file: {size, crc32, items, header_crc32, item_crc32}`` (whole-file, header and per-item
    checksums). Raises SnapshotMismatch, FormatError or OSError.
    """
    mapping, header = open_slot(path)
    try:
        meta = header.metadata
        if meta.get("state") != "complete" or meta.get("iteration") != str(iteration):
            raise SnapshotMismatch(f"{path} holds {meta.get('state')} iteration {meta.get('iteration')}, "
                                   f"expected complete iteration {iteration}")
        written = json.loads(meta["items"])
        record = {"iteration": iteration, "items": written, "tokens": {}}
        # The memory checksum runs beside the write (both release the GIL): one pass's time, not two.
        with ThreadPoolExecutor(1) as pool:
            checksums = pool.submit(item_checksums, mapping, header, set(written))
            if target is not None:
                keep = set(written) if persist_items is None else \
                    {i for i in written if i == "dense" or i in persist_items}
                record["file"] = _write_compact(mapping, header, keep, target, storage)
            record["crcs"] = checksums.result()
        if target is not None:
            record["file"]["item_crc32"] = {i: record["crcs"][i] for i in record["file"]["items"]}
        return record
    finally:
        try:
            mapping.close()
        except BufferError:
            # A write that failed mid-file (ENOSPC, EIO) leaves views of the mapping in its traceback;
            # closing now would replace that error with this one. The mapping closes when they go.
            pass


def _write_compact(mapping, header, keep: set[str], target: str, storage: PosixStorage) -> dict:
    entries, offset = [], 0
    chosen = [e for e in header.tensors if e.item in keep]
    for e in chosen:
        entries.append(type(e)(e.name, e.dtype, e.numel, offset, offset + (e.end - e.begin)))
        offset = entries[-1].end
    meta = dict(header.metadata)
    meta["items"] = json.dumps({i: v for i, v in json.loads(meta["items"]).items() if i in keep})
    head = encode_header(entries, meta)

    def chunks():
        yield head
        view = memoryview(mapping)  # zero-copy; dropped before the mapping closes
        for e in chosen:
            yield view[header.data_start + e.begin: header.data_start + e.end]

    size, crc = storage.write_atomic(target, chunks())
    return {"size": size, "crc32": crc, "items": sorted(keep), "header_crc32": zlib.crc32(head)}


__all__ = ["check_and_persist", "item_checksums", "SnapshotMismatch", "FormatError"]
