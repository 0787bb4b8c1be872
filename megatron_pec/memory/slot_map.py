"""Where a rank's items lie in node memory: two home slots for the dense state, one pool for the experts.

A rank's node memory is three files (``memory/slots.py`` maps them):

* ``rank{r}.slot0`` and ``rank{r}.slot1``, the home slots: each a safetensors file of the dense
  tensors, whose metadata is the header of the snapshot it is home to (slot ids 0 and 1). A snapshot's
  dense state goes to the home whose dense region may be overwritten: two versions, so one is always
  complete. (A job of several nodes without replicas has a third, ``slot2``: its agent keeps the newest
  committed dense state for the survivors of a node loss.)
* ``rank{r}.pool``: ``regions`` expert regions of ``region_bytes`` each (slot id ``POOL + j`` for region
  j). No expert has a region of its own: a snapshot writes each expert it saves into any free region,
  and the expert's previous region is free once the new version is recorded. The pool holds the newest
  version of every expert plus spares for what one snapshot writes (``memory/budget.py`` sizes it), not a
  second copy of every expert.

An expert's bytes in a region are laid out as in every other file: its tensors one after the other,
at offsets from the item's start (``experts``). The pool file's safetensors table is one tensor (all
regions) and its metadata carries the experts' tensors (each distinct list once), written once;
``item_header`` gives any reader a ``stformat.Header`` that places one item in one slot, so checksums,
persists, replicas and restores read a region as they read a slot. Pure: no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.stformat import ITEMSIZE, FormatError, Header, TensorEntry

HOME_SLOTS = 2  # home slots of a rank (slot ids 0 and 1)
HOMES_MAX = 3   # ... a third one where the newest committed dense state is kept for survivors (``pins.py``)
POOL = HOMES_MAX  # slot id of pool region j: POOL + j
REGION_ALIGN = 64  # region starts are aligned so (bytes for device copies)
POOL_TENSOR = "pool/regions"
KIND = "expert-pool"


def is_pool(slot: int) -> bool:
    return slot >= POOL


@dataclass(frozen=True)
class SlotMap:
    """One rank's node-memory layout: the dense tensors of its home slots, its experts' tensors (offsets
    from each expert's start) and the pool's regions."""

    dense: tuple[TensorEntry, ...]                    # the home slots' tensors (data offsets from 0)
    experts: dict[str, tuple[TensorEntry, ...]]       # expert item -> its tensors, offsets from its start
    regions: int                                      # pool regions
    region_bytes: int = field(default=0)              # 0: the largest expert, aligned
    homes: int = HOME_SLOTS                           # home slots

    def __post_init__(self) -> None:
        if not self.region_bytes:
            largest = max((self.nbytes(item) for item in self.experts), default=0)
            object.__setattr__(self, "region_bytes", -(-largest // REGION_ALIGN) * REGION_ALIGN)

    @classmethod
    def of(cls, entries, regions: int, homes: int = HOME_SLOTS) -> "SlotMap":
        """From a rank's slot layout (``stformat.layout`` of every slice, item by item)."""
        dense, experts, starts = [], {}, {}
        for e in entries:
            if e.item == NON_EXPERT:
                dense.append(e)
                continue
            start = starts.setdefault(e.item, e.begin)
            experts.setdefault(e.item, []).append(TensorEntry(e.name, e.dtype, e.numel, e.begin - start, e.end - start))
        return cls(tuple(dense), {item: tuple(v) for item, v in experts.items()}, regions, homes=homes)

    def nbytes(self, item: str) -> int:
        entries = self.dense if item == NON_EXPERT else self.experts[item]
        return entries[-1].end - entries[0].begin if entries else 0

    @property
    def dense_bytes(self) -> int:
        return self.dense[-1].end if self.dense else 0

    @property
    def state_bytes(self) -> int:
        """The rank's whole state: what one complete snapshot holds."""
        return self.dense_bytes + sum(self.nbytes(item) for item in self.experts)

    # ---- the pool file's header ------------------------------------------------------------------
    def pool_entries(self) -> tuple[TensorEntry, ...]:
        size = self.regions * self.region_bytes
        return (TensorEntry(POOL_TENSOR, "U8", size, 0, size),)

    def pool_metadata(self) -> dict[str, str]:
        """The experts' tensors in kilobytes, not megabytes, for thousands of experts: experts of one model
        differ only in the numbers of their tensor names (``o1.g0.b0.p4...`` against ``...p0...``), so each
        distinct list is kept once with numbers relative to its first name's, and each expert names its
        list and those first numbers. (The last one is kept: start-up asks for the same layout's several
        times - the plan, the pool file's header - and with thousands of experts each takes a second.)"""
        global _last_pool_metadata
        last = _last_pool_metadata
        if last is not None and last[0] is self.experts and last[1:3] == (self.region_bytes, self.homes):
            return dict(last[3])
        metadata = self._pool_metadata()
        _last_pool_metadata = (self.experts, self.region_bytes, self.homes, metadata)
        return dict(metadata)

    def _pool_metadata(self) -> dict[str, str]:
        shapes: dict[str, int] = {}
        items = {}
        for item, entries in self.experts.items():
            shape, base = _shape_of(entries)
            items[item] = [shapes.setdefault(json.dumps(shape, separators=(",", ":")), len(shapes)), *base]
        return {"type": KIND, "v": "1", "region_bytes": str(self.region_bytes), "homes": str(self.homes),
                "shapes": "[" + ",".join(shapes) + "]", "experts": json.dumps(items, separators=(",", ":"))}

    @classmethod
    def from_headers(cls, home: Header | None, pool: Header) -> "SlotMap":
        """The layout the files say (a reader: the agent, a restore; without ``home``, the experts' only);
        raises FormatError."""
        meta = pool.metadata
        if meta.get("type") != KIND or len(pool.tensors) != 1 or pool.tensors[0].name != POOL_TENSOR:
            raise FormatError("not an expert pool file")
        try:
            region_bytes, homes = int(meta["region_bytes"]), int(meta.get("homes", HOME_SLOTS))
            shapes = json.loads(meta["shapes"])
            experts = {item: _entries_of(item, shapes[found[0]], found[1:])
                       for item, found in json.loads(meta["experts"]).items()}
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise FormatError(f"the expert pool's metadata is malformed ({exc})") from None
        regions = pool.tensors[0].numel // region_bytes if region_bytes else 0
        dense = () if home is None else tuple(e for e in home.tensors if e.item == NON_EXPERT)
        return cls(dense, experts, regions, region_bytes, homes)

    def full_entries(self) -> tuple[TensorEntry, ...]:
        """Every item's tensors one after the other, the dense state first: a complete snapshot as one
        safetensors file (a replica on a peer node)."""
        out, at = [], 0
        for entries in (self.dense, *self.experts.values()):
            start = entries[0].begin if entries else 0
            for e in entries:
                out.append(TensorEntry(e.name, e.dtype, e.numel, at + e.begin - start, at + e.end - start))
            at = out[-1].end if out else at
        return tuple(out)

    # ---- where an item lies ----------------------------------------------------------------------
    def region_offset(self, slot: int) -> int:
        """Byte offset of pool region ``slot`` within the pool's data."""
        return (slot - POOL) * self.region_bytes

    def item_header(self, slot: int, item: str, home: Header | None, pool: Header) -> Header:
        """A header that places ``item`` in ``slot`` (a home slot's own header for the dense state; a
        pool region's: the item's tensors at the region's offset in the pool file), for readers of the
        file the slot is in."""
        if not is_pool(slot):
            if item != NON_EXPERT:
                raise FormatError(f"{item} is an expert: its versions lie in the pool, not in home slot {slot}")
            return home
        if item not in self.experts:
            raise FormatError(f"{item} is no expert of this rank's layout")
        if slot - POOL >= self.regions:
            raise FormatError(f"pool region {slot - POOL} is beyond the pool's {self.regions} regions")
        at = self.region_offset(slot)
        entries = tuple(TensorEntry(e.name, e.dtype, e.numel, at + e.begin, at + e.end) for e in self.experts[item])
        return Header(entries, pool.metadata, pool.header_len)


__all__ = ["SlotMap", "HOME_SLOTS", "HOMES_MAX", "POOL", "POOL_TENSOR", "is_pool"]

_last_pool_metadata: tuple | None = None  # (experts, region_bytes, homes, metadata) of the last layout asked


def _shape_of(entries) -> tuple[list, list[int]]:
    """An expert's tensor list with the numbers in its names relative to its first name's, and those
    numbers: ``[[texts, offsets, dtype, numel], ...]`` (a name's numbers are its first name's plus its
    offsets), or absolute numbers where a name has another count of them or a number with a leading zero."""
    split = [_NUMBER.split(e.name.split("/", 1)[1]) for e in entries]
    base = [int(n) for n in split[0][1::2]] if split else []
    if any(len(parts) != len(split[0]) or any(str(int(n)) != n for n in parts[1::2]) for parts in split):
        base = []
    shape = []
    for parts, e in zip(split, entries):
        numbers = [int(n) for n in parts[1::2]] if base else []
        shape.append([parts if not base else parts[0::2], [n - b for n, b in zip(numbers, base)], e.dtype, e.numel])
    return shape, base


def _entries_of(item: str, shape: list, base: list[int]) -> tuple[TensorEntry, ...]:
    at, out = 0, []
    for texts, offsets, dtype, numel in shape:
        if base:
            numbers = [str(b + o) for b, o in zip(base, offsets)]
            key = "".join(t + n for t, n in zip(texts, numbers + [""]))
        else:
            key = "".join(texts)
        size = numel * ITEMSIZE[dtype]
        out.append(TensorEntry(f"{item}/{key}", dtype, numel, at, at + size))
        at += size
    return tuple(out)


_NUMBER = re.compile(r"(\d+)")
