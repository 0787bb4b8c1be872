"""Checksums of checkpoint bytes.

* Items (a rank's dense state, one expert): ``sum64`` (two 64-bit sums of the item's words, computed
  where the bytes are: on the GPU by the trainer, see ``integrity/sum64.py``). Files and records written before
  it hold CRC-32 integers; they are checked the same way they were written (``item_checks``).
* Whole persisted files: CRC-32 (zlib's polynomial), computed by the agent while it writes.
  zlib-ng's implementation when the ``zlib-ng`` package is installed, else Python's zlib; both
  compute the same CRC-32, only the speed differs, and both release the GIL on large buffers.
"""

from __future__ import annotations

from megatron_pec.integrity.byteruns import runs
from megatron_pec.integrity.kinds import is_sum64

try:
    from zlib_ng.zlib_ng import crc32
    IMPLEMENTATION = "zlib-ng"
except ImportError:  # a source build without it: correct, only slower
    from zlib import crc32
    IMPLEMENTATION = "zlib"

CHUNK = 8 << 20  # bytes summed (and read or written) per call: bounded calls, steady progress


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> "_Crc32":
        self.value = crc32(data, self.value)
        return self

    def result(self) -> int:
        return self.value


def accumulator(like):
    """An accumulator of the kind of the recorded checksum ``like`` (``update(bytes)``, ``result()``)."""
    if is_sum64(like):
        from megatron_pec.integrity.sum64 import Sum64  # (numpy: imported when an item is checked)

        return Sum64()
    return _Crc32()


def item_checks(buffer, header, expected: dict) -> dict:
    """Each item of ``expected`` (item -> recorded checksum) computed over a whole-file ``buffer`` laid
    out by ``header`` (a ``stformat.Header``: its tensors in header order), the way its recorded
    checksum was."""
    sums = [i for i, v in expected.items() if is_sum64(v)]
    crcs = [i for i in expected if i not in set(sums)]
    out = {}
    if sums:
        from megatron_pec.integrity.sum64 import item_sums

        out.update(item_sums(buffer, header, set(sums)))
    if crcs:
        out.update(item_crc32(buffer, header, set(crcs)))
    return out


def item_crc32(buffer, header, items: set[str], chunk: int = CHUNK) -> dict[str, int]:
    """crc32 of each item's data (its tensors in header order) in a whole-file ``buffer`` laid out by
    ``header`` (a ``stformat.Header``): what a trainer of an older release recorded. The same bytes in
    a slot or a compact rank file give the same value."""
    # an item's adjacent tensors joined: one crc call per run
    picked = runs([e for e in header.tensors if e.item in items], lambda a, b: a.item == b.item and a.end == b.begin)
    crcs, view = {}, memoryview(buffer)
    for run in picked:
        item, begin, end = run[0].item, header.data_start + run[0].begin, header.data_start + run[-1].end
        crc = crcs.get(item, 0)
        for offset in range(begin, end, chunk):
            crc = crc32(view[offset:min(offset + chunk, end)], crc)
        crcs[item] = crc
    return {i: crcs.get(i, 0) for i in items}


def shown(value) -> str:
    """A checksum as a message shows it."""
    return value if isinstance(value, str) else f"crc32 {value:08x}"


def mismatch(where: str, item: str, actual, expected) -> str:
    return (f"{where} fails its checksum for {item} ({shown(actual)}, recorded "
            f"{shown(expected) if expected is not None else 'none'}): the file is corrupt")


def first_mismatch(expected: dict[str, tuple], actual: dict, how: str) -> str | None:
    """The first item of ``expected`` (item -> (its recorded checksum, where it was read)) whose checksum in
    ``actual`` differs, as ``mismatch`` says it (``how``: how it was checked); None when all match."""
    for item, (want, where) in sorted(expected.items()):
        if actual.get(item) != want:
            return mismatch(f"{where} ({how})", item, actual.get(item, "none"), want)
    return None


__all__ = ["CHUNK", "crc32", "IMPLEMENTATION", "accumulator", "item_checks", "item_crc32", "is_sum64", "mismatch",
           "first_mismatch", "shown"]
