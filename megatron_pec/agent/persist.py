"""Agent phase 5: check a snapshot's header and persist its persist-level items as a rank file.

Runs in the node agent process, one snapshot at a time. The header (in the snapshot's home slot)
carries each written item's checksum, computed by the trainer where the bytes came from (``sum64``):
that is the snapshot's record, and a memory-only snapshot is recorded without reading its bytes. A
persisted item is read once, from the slot its region is in, to write the rank file (a compact
safetensors file: the non-expert tensors plus the persist-level experts, written atomically), and
checked against the trainer's checksum on the way: bytes that changed in node memory never become a
rank file.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from megatron_pec.agent.memory import header_problem
from megatron_pec.checksum import crc32, item_checks, mismatch
from megatron_pec.items import NON_EXPERT
from megatron_pec.protocol import JobKey, ProtocolError, SlotHeader
from megatron_pec.slots import SlotCache
from megatron_pec.stformat import encode_header, item_checksums
from megatron_pec.storage import PosixStorage


class SnapshotMismatch(RuntimeError):
    """The slot's header or bytes do not hold the snapshot the trainer announced."""


def check_and_persist(path: str, iteration: int, run: str, job: JobKey, persist_items: set[str] | None,
                      target: str | None, storage: PosixStorage, slots: SlotCache,
                      elsewhere: dict[str, str] | None = None) -> tuple[SlotHeader, dict, dict | None]:
    """Validate the home slot at ``path`` as holding the complete snapshot ``iteration`` of ``run`` and
    ``job`` (its items there, or in the slot files ``elsewhere`` names); persist it to ``target`` if
    given (the dense state plus ``persist_items``, None: all it wrote).

    Returns the snapshot's header, its items' checksums and, when persisted, the rank file's ``size``,
    ``crc32``, ``items``, ``header_crc32`` and ``item_sums`` (``item_crc32`` for a slot of an older
    trainer). Raises SnapshotMismatch, FormatError or OSError.
    """
    elsewhere = elsewhere or {}
    mapping, header = slots.open(path)
    try:
        snapshot = SlotHeader.from_metadata(header.metadata)
    except ProtocolError as exc:
        snapshot = str(exc)
    problem = header_problem(snapshot, iteration, run, job)
    if problem is not None:
        raise SnapshotMismatch(f"{path} {problem}")
    written = snapshot.items
    if snapshot.sums:
        unsummed = sorted(set(written) - set(snapshot.sums))
        if unsummed:
            raise SnapshotMismatch(f"{path} has no checksum for {', '.join(unsummed[:3])}")
        checks = {i: snapshot.sums[i] for i in written}
    else:  # a trainer of an older release: its bytes are checked here, as it did
        checks = item_checksums(mapping, header, set(written))
    file = None
    if target is not None:
        keep = set(written) if persist_items is None else \
            {i for i in written if i == NON_EXPERT or i in persist_items}
        expected = {i: checks[i] for i in keep}
        mappings = {path: mapping, **{p: slots.open(p)[0] for p in set(elsewhere.values())}}
        where = {i: mappings[elsewhere.get(i, path)] for i in keep}
        # The persisted items are checked beside the write (both release the GIL), before the rename.
        with ThreadPoolExecutor(1) as pool:
            computing = pool.submit(_checks_in, mappings, elsewhere, path, header, expected)
            file = _write_compact(where, header, snapshot, keep, target, storage,
                                  lambda: _check(path, computing.result(), expected))
        file["item_sums" if snapshot.sums else "item_crc32"] = expected
    return snapshot, checks, file


def _checks_in(mappings: dict, elsewhere: dict[str, str], home: str, header, expected: dict) -> dict:
    """``item_checks`` of items spread over several slot files (one layout)."""
    out = {}
    for path, mapping in mappings.items():
        here = {i: v for i, v in expected.items() if elsewhere.get(i, home) == path}
        if here:
            out.update(item_checks(mapping, header, here))
    return out


def _check(path: str, actual: dict, expected: dict) -> None:
    for item in sorted(expected):
        if actual[item] != expected[item]:
            raise SnapshotMismatch(mismatch(f"{path} (in node memory)", item, actual[item], expected[item]))


def _write_compact(where: dict, header, snapshot: SlotHeader, keep: set[str], target: str, storage: PosixStorage,
                   before_rename) -> dict:
    """``where``: item -> the mapping of the slot file its bytes are in (all slots share ``header``'s layout)."""
    entries, offset = [], 0
    chosen = [e for e in header.tensors if e.item in keep]
    for e in chosen:
        entries.append(type(e)(e.name, e.dtype, e.numel, offset, offset + (e.end - e.begin)))
        offset = entries[-1].end
    kept = snapshot.with_items({i: v for i, v in snapshot.items.items() if i in keep},
                               {i: v for i, v in snapshot.sums.items() if i in keep})
    head = encode_header(entries, kept.to_metadata())

    def chunks():
        yield head
        views = {id(m): memoryview(m) for m in where.values()}  # zero-copy; dropped before the mappings close
        for e in chosen:
            yield views[id(where[e.item])][header.data_start + e.begin: header.data_start + e.end]

    size, crc = storage.write_atomic(target, chunks(), before_rename)
    return {"size": size, "crc32": crc, "items": sorted(keep), "header_crc32": crc32(head)}


__all__ = ["check_and_persist", "SnapshotMismatch"]
