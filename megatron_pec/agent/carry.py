"""Agent phase 7, carry forward: copy into a new slot the experts its snapshot did not write.

A PEC snapshot writes only K experts per layer. Left alone, node memory would
hold just the experts of the last three snapshots, and a restart would read all
the others from older persisted versions (more lost tokens), or from nowhere
before the first commit. So once a snapshot is complete, the agent copies each
item it did not write from the rank's newest restorable slot (its "base", which
the agent chose and keeps from the trainer until this is done), and every complete
slot holds every expert at its latest version on the rank's timeline.
"""

from __future__ import annotations

import dataclasses
import errno
import os

from megatron_pec.byteruns import runs
from megatron_pec.checksum import is_sum64
from megatron_pec.protocol import SlotHeader, SlotRecord
from megatron_pec.slots import SlotCache


def carry_forward(path: str, record: SlotRecord, base_path: str, base_record: SlotRecord,
                  base_header: SlotHeader, slots: SlotCache,
                  in_place: tuple[SlotRecord, frozenset[str]] | None = None) -> SlotRecord:
    """``record`` completed with every item of the base that the new snapshot did not write: their
    bytes copied from ``base_path`` into ``path``, their versions, crcs and cumulative token counts
    at that version (which a restore needs to account the lost tokens).

    ``in_place``: the slot's previous record and the items the trainer wrote since besides
    ``record``'s own; an item the slot still holds at the base's version (same timeline, version
    and crc, not written since) is not copied again. With K of E experts per snapshot most are:
    only those that later snapshots wrote.

    The caller has checked that the base is restorable for the same job (``NodeMemory.is_restorable``).
    Raises OSError, FormatError or ValueError (another tensor layout: bytes of different tensors
    are never mixed).
    """
    base_checks = base_record.checks
    take = {i: v for i, v in base_record.items.items() if i not in record.items and i in base_checks}
    if not take:
        return record
    kept = set()
    if in_place is not None and in_place[0].run == base_record.run:
        previous, written = in_place
        kept = {i for i, v in take.items() if i not in written and previous.items.get(i) == v
                and previous.checks.get(i) == base_checks[i]}
    mapping, header = slots.open(path)
    _, base_tensors = slots.open(base_path)
    same = base_tensors.tensors is header.tensors or base_tensors.tensors == header.tensors
    source = None if same else {e.name: e for e in base_tensors.tensors}
    pieces = []  # (to, from, length) per carried tensor
    for e in header.tensors:
        if e.item in take and e.item not in kept:
            b = e if same else source.get(e.name)
            if b is None or b.end - b.begin != e.end - e.begin:
                raise ValueError(f"{base_path} lays out {e.name} differently")
            pieces.append((header.data_start + e.begin, base_tensors.data_start + b.begin, e.end - e.begin))
    # one read per run of pieces adjacent on both sides
    copies = [(run[0][0], run[0][1], sum(n for _, _, n in run))
              for run in runs(pieces, lambda a, b: a[0] + a[2] == b[0] and a[1] + a[2] == b[1])]
    # Read from the base's file, not copied between the mappings: a memcpy in Python holds the GIL
    # for its whole length, a read lets the agent's other threads answer meanwhile. (Why not a numpy
    # copy: docs/design.md, "Carries".)
    fd = os.open(base_path, os.O_RDONLY)
    try:
        with memoryview(mapping) as dst:
            for to, frm, n in copies:
                _read_into(fd, dst[to:to + n], frm, base_path)
    finally:
        os.close(fd)
    tokens = {i: base_record.tokens.get(i, base_header.tokens.get(i, 0)) for i in take}
    # The base's checksums, not recomputed: a byte the base lost in memory is then caught at restore,
    # never blessed with a fresh checksum (and the carry is one memcpy, no second pass).
    sums = {i: base_checks[i] for i in take if is_sum64(base_checks[i])}
    crcs = {i: base_checks[i] for i in take if i not in sums}
    return dataclasses.replace(record, items={**record.items, **take}, crcs={**record.crcs, **crcs},
                               sums={**record.sums, **sums}, tokens={**record.tokens, **tokens})


def _read_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise OSError(errno.EIO, f"{path} ends before byte {offset + len(view)}")
        done += got
