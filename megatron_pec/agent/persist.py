"""Agent phase 5: check a snapshot slot and persist its persist-level items as a rank file.

Runs in the node agent process, one slot at a time. Reads the slot's bytes
straight from the tmpfs mapping; writes a compact safetensors file (the slot's
non-expert tensors plus the persist-level experts) atomically.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from megatron_pec.agent.memory import JobKey, header_problem
from megatron_pec.checksum import crc32
from megatron_pec.items import NON_EXPERT
from megatron_pec.protocol import ProtocolError, SlotHeader, SlotRecord
from megatron_pec.slots import SlotCache
from megatron_pec.stformat import encode_header, item_checksums
from megatron_pec.storage import PosixStorage


class SnapshotMismatch(RuntimeError):
    """The slot's header does not describe the snapshot the trainer announced."""


def check_and_persist(path: str, iteration: int, run: str, job: JobKey, persist_items: set[str] | None,
                      target: str | None, storage: PosixStorage, slots: SlotCache) -> tuple[SlotRecord, dict | None]:
    """Validate the slot at ``path`` as the complete snapshot ``iteration`` of ``run`` and ``job``;
    persist it to ``target`` if given (the dense state plus ``persist_items``, None: all it wrote).

    Returns the slot's record (the items the snapshot wrote and their crc32s; carried experts
    are added later) and, when persisted, the rank file's ``size``, ``crc32``, ``items``,
    ``header_crc32`` and ``item_crc32``. Raises SnapshotMismatch, FormatError or OSError.
    """
    mapping, header = slots.open(path)
    try:
        snapshot = SlotHeader.from_metadata(header.metadata)
    except ProtocolError as exc:
        snapshot = str(exc)
    problem = header_problem(snapshot, iteration, run, job)
    if problem is not None:
        raise SnapshotMismatch(f"{path} {problem}")
    written = snapshot.items
    file = None
    # The memory checksum runs beside the write (both release the GIL): one pass's time, not two.
    with ThreadPoolExecutor(1) as pool:
        checksums = pool.submit(item_checksums, mapping, header, set(written))
        if target is not None:
            keep = set(written) if persist_items is None else \
                {i for i in written if i == NON_EXPERT or i in persist_items}
            file = _write_compact(mapping, header, snapshot, keep, target, storage)
        crcs = checksums.result()
    if file is not None:
        file["item_crc32"] = {i: crcs[i] for i in file["items"]}
    return SlotRecord(iteration, run, dict(written), crcs), file


def _write_compact(mapping, header, snapshot: SlotHeader, keep: set[str], target: str,
                   storage: PosixStorage) -> dict:
    entries, offset = [], 0
    chosen = [e for e in header.tensors if e.item in keep]
    for e in chosen:
        entries.append(type(e)(e.name, e.dtype, e.numel, offset, offset + (e.end - e.begin)))
        offset = entries[-1].end
    kept = snapshot.with_items({i: v for i, v in snapshot.items.items() if i in keep})
    head = encode_header(entries, kept.to_metadata())

    def chunks():
        yield head
        view = memoryview(mapping)  # zero-copy; dropped before the mapping closes
        for e in chosen:
            yield view[header.data_start + e.begin: header.data_start + e.end]

    size, crc = storage.write_atomic(target, chunks())
    return {"size": size, "crc32": crc, "items": sorted(keep), "header_crc32": crc32(head)}


__all__ = ["check_and_persist", "SnapshotMismatch"]
