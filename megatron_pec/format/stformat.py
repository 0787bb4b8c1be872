"""The safetensors byte layout, written and read strictly, without the safetensors package.

A file is: 8-byte little-endian header length N, a JSON header of N bytes
(padded with spaces to a multiple of 8), then the raw tensor bytes with
contiguous ``data_offsets`` starting at 0. Slot files and persisted rank files
both use it, so persisting is a byte copy and loading is a plain read: no
pickle anywhere.

Tensor names are ``<item>/<slice key>``: the item (``dense`` or ``L<l>.E<e>``)
a tensor belongs to is part of its name, so a reader can pick items without
any other index.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Callable

from megatron_pec.format.json_text import dumps_object

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1}


def dtype_code(dtype) -> str:
    """safetensors dtype code of a torch dtype (torch stays unimported: the agent never needs it)."""
    return _CODES[str(dtype)]


_CODES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float64": "F64",
          "torch.int64": "I64", "torch.int32": "I32", "torch.uint8": "U8"}


def torch_dtype(code: str):
    if not _TORCH_DTYPES:  # torch is imported on first use only (the agent never needs it)
        import torch

        _TORCH_DTYPES.update({v: getattr(torch, k.removeprefix("torch.")) for k, v in _CODES.items()})
    return _TORCH_DTYPES[code]


_TORCH_DTYPES: dict = {}


class FormatError(ValueError):
    """The bytes are not a well-formed megatron-pec safetensors file."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    numel: int
    begin: int  # offset in the data section
    end: int

    @property
    def item(self) -> str:
        return self.name.split("/", 1)[0]


@dataclass(frozen=True, slots=True)
class Header:
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    header_len: int  # N, the JSON length including padding

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_len(self) -> int:
        return self.data_start + self.data_len


def layout(specs: list[tuple[str, object, int]]) -> tuple[TensorEntry, ...]:
    """Contiguous entries for ``(name, dtype, numel)`` in the given order."""
    entries, offset = [], 0
    for name, dtype, numel in specs:
        code = dtype_code(dtype)
        size = numel * ITEMSIZE[code]
        entries.append(TensorEntry(name, code, numel, offset, offset + size))
        offset += size
    return tuple(entries)


def tensor_table(tensors) -> bytes:
    """The JSON of the tensor entries, without the closing brace (reusable across saves)."""
    body = {e.name: {"dtype": e.dtype, "shape": [e.numel], "data_offsets": [e.begin, e.end]} for e in tensors}
    return json.dumps(body, separators=(",", ":")).encode()[:-1]


def encode_header(tensors, metadata: dict[str, str], capacity: int | None = None, table: bytes | None = None) -> bytes:
    """8-byte length + JSON header, space-padded to a multiple of 8 (or to exactly ``capacity``).

    Pass ``table`` (from :func:`tensor_table`) to skip re-encoding the tensor entries.
    """
    table = tensor_table(tensors) if table is None else table
    size = capacity
    if size is None:
        size = (len(table) + len(header_tail(metadata, 1 << 62, len(table) > 1)) + 7) // 8 * 8
    tail = header_tail(metadata, size - len(table), len(table) > 1)
    return struct.pack("<Q", size) + table + tail + b" " * (size - len(table) - len(tail))


def header_tail(metadata: dict[str, str], room: int, after_entries: bool) -> bytes:
    """The header bytes that follow the tensor table, unpadded: the metadata and the closing brace.
    A slot rewrites only these at each save (its table never changes). Raises FormatError when they
    exceed ``room``."""
    meta = dumps_object(metadata).encode()
    tail = (b"," if after_entries else b"") + b'"__metadata__":' + meta + b"}"
    if len(tail) > room:
        raise FormatError(f"header needs {len(tail) - room} bytes more than the {room} reserved for its metadata")
    return tail


def _header_json(prefix: bytes | memoryview, check_padding: bool = True) -> tuple[int, bytes]:
    """(N, the header's JSON without its padding) from the first bytes of a file; raises FormatError.
    ``check_padding=False`` leaves unchecked that only spaces follow the JSON."""
    if len(prefix) < 8:
        raise FormatError("file shorter than the 8-byte header length")
    (size,) = struct.unpack("<Q", bytes(prefix[:8]))
    if size > MAX_HEADER or len(prefix) < 8 + size:
        raise FormatError(f"header length {size} is implausible or exceeds the file")
    data = prefix if isinstance(prefix, bytes) else bytes(prefix[:8 + size])
    if data[8:9] != b"{":
        raise FormatError("header does not start with '{'")
    # Slot headers reserve room for metadata growth: mostly padding, which str.rstrip would walk
    # byte by byte (and a copy would copy). The JSON ends at the last brace; only spaces may follow.
    end = data.rfind(b"}", 8, 8 + size) + 1
    if end == 0:
        raise FormatError("header is not valid JSON (it has no closing brace: torn or overwritten)")
    if check_padding and data.count(b" ", end, 8 + size) != 8 + size - end:
        raise FormatError("header has bytes other than space padding after its closing brace")
    return size, data[8:end]


def _json(text: bytes) -> dict:
    try:
        body = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise FormatError("header is not a JSON object")
    return body


def _metadata(body: dict) -> dict[str, str]:
    metadata = body.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("__metadata__ values must be strings")
    return metadata


def decode_header(prefix: bytes | memoryview, file_len: int | None = None,
                  known: tuple[bytes, tuple[TensorEntry, ...]] | None = None) -> Header:
    """Parse and validate a header from the first bytes of a file (strictly, like safetensors).

    ``known``: a tensor table's JSON (``tensor_table``) and its entries, as this process wrote them
    into its own slots; a header that starts with exactly those bytes takes those entries, and only
    its metadata is parsed (a large MoE rank's table is megabytes of JSON)."""
    size, raw = _header_json(prefix)
    rest = raw[len(known[0]):] if known is not None and raw.startswith(known[0]) else None
    if rest is not None and (rest.startswith(b',"__metadata__":') or rest == b"}"):
        body = _json(b"{" + rest.removeprefix(b","))
        metadata = _metadata(body)
        if body:
            raise FormatError(f"header has entries after its metadata: {sorted(body)[:3]}")
        header = Header(known[1], metadata, size)
    else:
        body = _json(raw)
        metadata = _metadata(body)
        header = Header(_entries(body), metadata, size)
    if file_len is not None and header.file_len != file_len:
        raise FormatError(f"file is {file_len} bytes but its header describes {header.file_len}")
    return header


def decode_metadata(prefix: bytes | memoryview) -> dict[str, str]:
    """Only the ``__metadata__`` of a header, its tensor table unparsed and unchecked: enough to
    choose between slots; a slot that is then read is decoded in full (``decode_header``). (Nor
    its padding: a third of the time of choosing among a rank's slots, 300 KB of it each.)"""
    _, raw = _header_json(prefix, check_padding=False)
    # In valid JSON this can only be the metadata's key: inside a string every quote is escaped.
    at = raw.rfind(b'"__metadata__":')  # as encode_header writes it; any JSON spacing below
    if at >= 0:
        at += 15
    else:
        found = max(_METADATA_KEY.finditer(raw), key=lambda match: match.end(), default=None)
        if found is None:
            return {}
        at = found.end()
    try:
        metadata, _ = json.JSONDecoder().raw_decode(raw[at:].decode().lstrip())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"header is not valid JSON ({exc})") from None
    return _metadata({"__metadata__": metadata})


_METADATA_KEY = re.compile(rb'"__metadata__"\s*:')


def _entries(body: dict) -> tuple[TensorEntry, ...]:
    entries = []
    for name, spec in body.items():
        try:
            begin, end = spec["data_offsets"]
            (numel,) = spec["shape"]
            dtype = spec["dtype"]
            if dtype not in ITEMSIZE or end - begin != numel * ITEMSIZE[dtype]:
                raise ValueError
        except (KeyError, ValueError, TypeError):
            raise FormatError(f"bad tensor entry {name!r}") from None
        entries.append(TensorEntry(name, dtype, numel, begin, end))
    entries.sort(key=lambda e: e.begin)
    offset = 0
    for e in entries:
        if e.begin != offset:
            raise FormatError(f"tensor {e.name!r} is not contiguous (starts at {e.begin}, expected {offset})")
        offset = e.end
    return tuple(entries)


MAX_HEADER = 64 << 20  # a longer header is refused as implausible


def read_header(read: Callable[[int, int], bytes], file_len: int,
                known: tuple[bytes, tuple[TensorEntry, ...]] | None = None) -> tuple[bytes, Header]:
    """The header bytes (length prefix included) and the parsed header of a file of ``file_len``
    bytes, given ``read(offset, length)`` (``known``: see ``decode_header``); raises FormatError."""
    head = read_head(read, file_len)
    return head, decode_header(head, file_len=file_len, known=known)


def read_head(read: Callable[[int, int], bytes], file_len: int) -> bytes:
    """The header bytes (length prefix included) of a file of ``file_len`` bytes, unparsed; raises
    FormatError."""
    head = bytes(read(0, min(8, file_len)))
    if len(head) < 8:
        raise FormatError("file shorter than the 8-byte header length")
    size = int.from_bytes(head, "little")
    if size > MAX_HEADER or 8 + size > file_len:
        raise FormatError(f"header length {size} is implausible or exceeds the file")
    return bytes(read(0, 8 + size))  # (one buffer: no copy joining the length and the rest)


def tensor_view(buffer, header: Header, entry: TensorEntry):
    """A 1-D tensor viewing ``entry``'s bytes inside ``buffer`` (no copy)."""
    return tensor_at(buffer, entry, header.data_start + entry.begin)


def tensor_views(buffer, header: Header, entries) -> list:
    """1-D tensors viewing each of ``entries``' bytes in a whole-file ``buffer`` (no copies): slices
    of one view of the buffer per dtype, not a ``frombuffer`` (a buffer export) per entry - a large
    MoE rank has tens of thousands of entries."""
    import torch

    flats, out = {}, []
    for e in entries:
        size, start = ITEMSIZE[e.dtype], header.data_start + e.begin
        if start % size:  # (never in files written here: every offset is aligned)
            out.append(tensor_at(buffer, e, start))
            continue
        flat = flats.get(e.dtype)
        if flat is None:
            flat = flats[e.dtype] = torch.frombuffer(buffer, dtype=torch_dtype(e.dtype), count=len(buffer) // size)
        out.append(flat[start // size:start // size + e.numel])
    return out


def tensor_at(buffer, entry: TensorEntry, offset: int):
    """A 1-D tensor viewing ``entry``'s bytes at ``offset`` in ``buffer`` (no copy)."""
    import torch

    if entry.numel == 0:
        return torch.empty(0, dtype=torch_dtype(entry.dtype))
    return torch.frombuffer(buffer, dtype=torch_dtype(entry.dtype), count=entry.numel, offset=offset)
