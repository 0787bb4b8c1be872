"""The checksum of every checkpoint item, computable where its bytes are: two sums of its 64-bit words.

Definition. An item's bytes (its tensors in header order, one after the other) are read as
little-endian 64-bit words x_0 .. x_{n-1}, the last one padded with zero bytes. Then

    A = sum(x_k)            mod 2**64
    B = sum((k + 1) * x_k)  mod 2**64

and the checksum is ``"s64:"`` followed by A and B as 16 hex digits each. Any single changed word
changes A; changes that cancel in A (+d at word i, -d at word j) change B by d * (i - j), which is
zero mod 2**64 only when both differences hold 64 factors of two between them; moved or swapped
words change B.

Why not CRC-32: a CRC is a chain of dependent steps, which a GPU runs only with a kernel of its own.
Sums of integers are two memory-bound reductions with stock torch operations, on the GPU where the
state lives and on the CPU alike, and they split exactly: the sums of a byte range are the sums of its
pieces, whatever their order and alignment (``Sum64.update`` takes pieces of any size). Signed or
unsigned words give the same sums mod 2**64.

Implementations that agree bit for bit (``tests/test_sum64.py``):

* ``item_sums`` / ``Sum64`` on the CPU: over a slot or a rank file (CPU-only ranks, the agent when it
  persists, restores from node memory on the CPU, ``verify``, ``export``). The whole words go through a C
  kernel (``_fused_sum64.c``, built at install where a C compiler is) in one pass, copying them on the way
  where asked (``Sum64.copy``: a restore's copy checked at the cost of a plain copy); without it, through
  numpy's two reductions (``_weighted``), after the copy;
* ``DeviceSums`` with torch, on the tensors where a snapshot's bytes come from (the GPU, on the copy
  stream; on CPU tensors in the tests).
"""

from __future__ import annotations

import numpy

from megatron_pec.integrity.byteruns import runs
from megatron_pec.integrity.kinds import SUM64_PREFIX as PREFIX
from megatron_pec.integrity.kinds import is_sum64

try:
    from megatron_pec.integrity import _fused_sum64 as _kernel  # (the GIL released while it runs)
except ImportError:  # (no C compiler at install: numpy's reductions)
    _kernel = None

MASK = (1 << 64) - 1
COLUMNS = 4096  # words per row of the two reductions that weight each word by its index


def digest(a: int, b: int) -> str:
    return f"{PREFIX}{a & MASK:016x}{b & MASK:016x}"


class Sum64:
    """The sums of a byte stream fed in pieces of any size and alignment (the kernel or numpy: each releases
    the GIL on large pieces)."""

    def __init__(self, start: int = 0, row_sums=None):
        """``start``: the item byte the first piece begins at (the sums of a run that is a part of an
        item; the sums of an item's runs add up to the item's, mod 2**64). ``row_sums``: what sums each
        row of an int64 grid (``_weighted``, without the kernel; default numpy's)."""
        self.a = self.b = 0
        self.length = start  # stream bytes before the next piece
        self.row_sums = row_sums or _numpy_row_sums

    def update(self, data) -> "Sum64":
        view = numpy.frombuffer(data, dtype=numpy.uint8)
        return self._feed(view, lambda start, stop: _word_sums(view[start:stop], self.row_sums))

    def copy(self, target: numpy.ndarray, source: numpy.ndarray) -> "Sum64":
        """Copy ``source`` into ``target`` (uint8 arrays of one length, ``target`` writable) and take the
        sums of the bytes copied: with the kernel one pass over them, else a copy and numpy's sums after."""
        if _kernel is None:
            numpy.copyto(target, source)
            return self.update(target)
        head = min((-self.length) % 8, len(target))
        tail = head + (len(target) - head) // 8 * 8
        numpy.copyto(target[:head], source[:head])  # (the partial words, summed byte by byte from ``target``)
        numpy.copyto(target[tail:], source[tail:])
        return self._feed(target, lambda start, stop: _kernel.copy_words(target[start:stop], source[start:stop]))

    def _feed(self, view: numpy.ndarray, word_sums) -> "Sum64":
        """The bytes of ``view`` next in the stream: a partial word at either end byte by byte, the whole words
        between by ``word_sums(start, stop)`` (their (A, B) as if the first were word 0)."""
        head = min((-self.length) % 8, len(view))
        tail = head + (len(view) - head) // 8 * 8
        if head:
            self._bytes(view[:head], self.length)
        if tail > head:
            a, b = word_sums(head, tail)
            first = (self.length + head) // 8
            self.a += a
            self.b += b + first * a
        if tail < len(view):
            self._bytes(view[tail:], self.length + tail)
        self.length += len(view)
        return self

    def _bytes(self, piece: numpy.ndarray, offset: int) -> None:
        """A few bytes at stream ``offset``: each one contributes its place value in its word."""
        for i, byte in enumerate(piece.tolist()):
            word, place = divmod(offset + i, 8)
            value = byte << (8 * place)
            self.a += value
            self.b += (word + 1) * value

    def result(self) -> str:  # (an ``accumulator``, as a CRC-32's)
        return self.hexdigest()

    def hexdigest(self) -> str:
        return digest(self.a, self.b)


def in_one_pass() -> bool:
    """Whether ``Sum64.copy`` copies and sums in one pass (the kernel), not a copy and then numpy's sums."""
    return _kernel is not None


def _numpy_row_sums(grid: numpy.ndarray) -> numpy.ndarray:
    return grid.sum(axis=1, dtype=numpy.int64)


def _word_sums(data: numpy.ndarray, row_sums=_numpy_row_sums) -> tuple[int, int]:
    """(A, B) of the whole 64-bit words in uint8 ``data``, mod 2**64: the kernel's one pass, or numpy's two."""
    if _kernel is not None:
        return _kernel.sum_words(data)
    return _weighted(numpy.frombuffer(data, dtype="<i8"), row_sums)


def _weighted(words: numpy.ndarray, row_sums=_numpy_row_sums) -> tuple[int, int]:
    """(sum of words, sum of (index + 1) * word) of int64 ``words``, as Python ints mod 2**64.

    Rows of COLUMNS words: the column sums weight each word by its place in its row, the row sums by
    its row; two passes, each a plain int64 reduction (numpy's array reductions and dot products wrap on
    overflow without a warning, as we want; no scalar arithmetic is done in numpy). Called per MiB piece
    by a restore's summed copy: the row indices are kept, not made again."""
    global _ROW_INDEX
    n = len(words)
    rows = n // COLUMNS
    a = b = 0
    if rows:
        grid = words[:rows * COLUMNS].reshape(rows, COLUMNS)
        columns = grid.sum(axis=0, dtype=numpy.int64)
        rows_summed = row_sums(grid)
        index = _ROW_INDEX  # (read once: another thread may replace it meanwhile, even by a shorter one)
        if rows > len(index):
            index = _ROW_INDEX = numpy.arange(2 * rows, dtype=numpy.int64)
        a += int(columns.sum(dtype=numpy.int64))
        b += int(numpy.dot(_ARANGE1, columns))
        b += COLUMNS * int(numpy.dot(index[:rows], rows_summed))
    tail = words[rows * COLUMNS:]
    if len(tail):
        a_tail = int(tail.sum(dtype=numpy.int64))
        a += a_tail
        b += int(numpy.dot(_ARANGE1[:len(tail)], tail)) + rows * COLUMNS * a_tail
    return a & MASK, b & MASK


_ARANGE1 = numpy.arange(1, COLUMNS + 1, dtype=numpy.int64)
_ROW_INDEX = numpy.arange(64, dtype=numpy.int64)  # (grown to the most rows seen)


def item_sums(buffer, header, items, chunk: int = 64 << 20) -> dict[str, str]:
    """The checksum of each of ``items`` in a whole-file ``buffer`` (slot or rank file) laid out by
    ``header``: its tensors in header order. The same bytes in a slot or a compact rank file give the
    same value."""
    view = memoryview(buffer)
    sums = {item: Sum64() for item in items}
    for run in runs([e for e in header.tensors if e.item in sums], lambda p, q: p.item == q.item and p.end == q.begin):
        acc, start, end = sums[run[0].item], header.data_start + run[0].begin, header.data_start + run[-1].end
        for offset in range(start, end, chunk):
            acc.update(view[offset:min(offset + chunk, end)])
    return {item: acc.hexdigest() for item, acc in sums.items()}


class DeviceSums:
    """Item checksums computed with torch where the bytes are (the GPU; any device in the tests).

    ``add(item, tensor, offset)`` takes the bytes of ``tensor`` (1-D, contiguous) as bytes
    ``offset`` onwards of ``item``; nothing leaves the device until ``result`` (the sums of every
    item as one int64 tensor, in the order the items were first added), so a caller can queue it all
    on a stream and copy one small tensor to the host. ``constants``: ``DeviceSums.constants(device)``,
    built once (without, each instance builds its own)."""

    def __init__(self, device, constants=None):
        import torch

        self.torch, self.device = torch, device
        self.items: dict[str, int] = {}
        self._a: list = []
        self._b: list = []
        self._arange, self._places = constants or DeviceSums.constants(device)

    @staticmethod
    def constants(device):
        """What every instance on ``device`` reads: built on the device, or uploaded from page-locked memory
        without waiting (nothing synchronous on a copy stream's path)."""
        import torch

        arange = torch.arange(COLUMNS, dtype=torch.int64, device=device)
        places = _place_values(torch, "cpu")
        if torch.device(device).type == "cuda":
            places = places.pin_memory().to(device, non_blocking=True)
        return arange, places

    def add(self, item: str, tensor, offset: int) -> None:
        slot = self.items.setdefault(item, len(self.items))
        if slot == len(self._a):
            zero = self.torch.zeros((), dtype=self.torch.int64, device=self.device)
            self._a.append(zero)
            self._b.append(zero.clone())
        raw = tensor.reshape(-1).view(self.torch.uint8)
        length = raw.numel()
        head = min((-offset) % 8, length)
        if head:
            self._bytes(slot, raw[:head], offset)
        whole = (length - head) // 8
        if whole:
            body = raw[head:head + 8 * whole]
            first = (offset + head) // 8
            if body.data_ptr() % 8 == 0:
                a, b = self._words(body.view(self.torch.int64))
            else:  # (a run whose bytes are not 8-aligned in memory: by byte place, same sums)
                a, b = self._by_place(body.view(-1, 8))
            self._a[slot] += a
            self._b[slot] += b + first * a
        if head + 8 * whole < length:
            self._bytes(slot, raw[head + 8 * whole:], offset + head + 8 * whole)

    def _words(self, words):
        """(sum, sum of (index + 1) * word) of int64 ``words`` on the device, wrapping."""
        torch, n = self.torch, words.numel()
        rows = n // COLUMNS
        a = torch.zeros((), dtype=torch.int64, device=self.device)
        b = a.clone()
        if rows:
            grid = words[:rows * COLUMNS].view(rows, COLUMNS)
            columns = grid.sum(dim=0)
            row_sums = grid.sum(dim=1)
            a = a + columns.sum()
            b = b + ((self._arange + 1) * columns).sum()
            b = b + COLUMNS * (torch.arange(rows, dtype=torch.int64, device=self.device) * row_sums).sum()
        tail = words[rows * COLUMNS:]
        if tail.numel():
            a_tail = tail.sum()
            a = a + a_tail
            b = b + ((self._arange[:tail.numel()] + 1) * tail).sum() + rows * COLUMNS * a_tail
        return a, b

    def _by_place(self, grid):
        """The same sums of words given as rows of 8 bytes at any memory alignment: each byte place's
        sums (uint8 reductions into int64), shifted into place."""
        torch, n, places = self.torch, grid.shape[0], self._places
        rows = n // COLUMNS
        a = torch.zeros((), dtype=torch.int64, device=self.device)
        b = a.clone()
        if rows:
            cube = grid[:rows * COLUMNS].view(rows, COLUMNS, 8)
            columns = cube.sum(dim=0, dtype=torch.int64)          # [COLUMNS, 8]
            row_sums = cube.sum(dim=1, dtype=torch.int64)         # [rows, 8]
            a = a + (columns.sum(dim=0) * places).sum()
            b = b + (((self._arange + 1)[:, None] * columns).sum(dim=0) * places).sum()
            weighted_rows = (torch.arange(rows, dtype=torch.int64, device=self.device)[:, None] * row_sums).sum(dim=0)
            b = b + COLUMNS * (weighted_rows * places).sum()
        tail = grid[rows * COLUMNS:]
        if tail.shape[0]:
            per_place = tail.sum(dim=0, dtype=torch.int64)
            a_tail = (per_place * places).sum()
            a = a + a_tail
            b = b + (((self._arange[:tail.shape[0]] + 1)[:, None] * tail.to(torch.int64)).sum(dim=0) * places).sum()
            b = b + rows * COLUMNS * a_tail
        return a, b

    def _bytes(self, slot: int, piece, offset: int) -> None:
        """A few bytes at item ``offset`` (a word cut by a run's ends), each at its place value."""
        torch = self.torch
        values = piece.to(torch.int64)
        index = torch.arange(offset, offset + piece.numel(), device=self.device)
        place_values = self._places[index % 8]
        contribution = values * place_values
        self._a[slot] += contribution.sum()
        self._b[slot] += ((index // 8 + 1) * contribution).sum()

    def result(self):
        """[items, 2] int64: (A, B) of every item added, in the order of ``items``."""
        torch = self.torch
        if not self._a:
            return torch.zeros((0, 2), dtype=torch.int64, device=self.device)
        return torch.stack([torch.stack(self._a), torch.stack(self._b)], dim=1)

    def digests(self, result) -> dict[str, str]:
        """The checksums from ``result`` once it is on the host."""
        values = result.tolist()
        return {item: digest(*values[i]) for item, i in self.items.items()}


def _place_values(torch, device):
    """2**(8p) for the byte places p = 0..7 as int64 (the top one wraps to negative: equal mod 2**64)."""
    return torch.tensor([((1 << (8 * p)) + (1 << 63)) % (1 << 64) - (1 << 63) for p in range(8)],
                        dtype=torch.int64, device=device)


__all__ = ["Sum64", "DeviceSums", "item_sums", "digest", "is_sum64", "PREFIX", "MASK"]
