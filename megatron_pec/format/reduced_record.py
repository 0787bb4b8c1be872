"""Records that every rank contributes to one element-wise MAX all-reduce of ints, and gets back reduced.

Each field of such a record (a dataclass) declares once how it reduces over the ranks - ``max`` or
``min`` - and its shape: a scalar (``scalar``), a vector of ``n`` ints, one per item of an index space
every rank shares, such as every expert of the model (``vector``), or ``k`` such vectors (``columns``).
One encoder (``encode``) flattens a record into the list the all-reduce takes, one decoder
(``decode``) rebuilds the record from the reduced list; ``all_reduce`` does both around the caller's
reduction. Offsets follow from the declaration, in field order.

A single MAX all-reduce carries both reductions: a ``min`` field travels negated (the MAX of -x is
-MIN x). Optional fields (``optional=True``, default None) travel together, all or none: every rank
must send as many ints, or the all-reduce fails (gloo: "Received data size doesn't match expected
size"), so the caller decides for every rank alike whether they are sent. The flat list carries no
type or version: the ranks of one job run the same code. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, TypeVar

__all__ = ["MAX", "MIN", "scalar", "vector", "columns", "encode", "decode", "size", "all_reduce", "start_all_reduce",
           "Reducing"]

MAX, MIN = "max", "min"
_KEY = "megatron_pec.reduced"  # the field metadata key holding its ``_Spec``

R = TypeVar("R")


@dataclass(frozen=True)
class _Spec:
    op: str              # MAX or MIN
    vectors: int | None  # None: a scalar; 1 with ``flat``: one vector; k: a list of k vectors
    flat: bool = False   # one vector (list[int]), not a list of vectors
    optional: bool = False

    def width(self, n: int) -> int:
        return 1 if self.vectors is None else self.vectors * n


def _field(spec: _Spec):
    if spec.op not in (MAX, MIN):
        raise ValueError(f"a reduced field reduces by {MAX!r} or {MIN!r}, not {spec.op!r}")
    extra = {"default": None} if spec.optional else {}
    return dataclasses.field(metadata={_KEY: spec}, **extra)


def scalar(op: str = MAX):
    """A field holding one int, reduced by ``op`` over the ranks."""
    return _field(_Spec(op, None))


def vector(op: str = MAX, optional: bool = False):
    """A field holding ``n`` ints (list[int]), each reduced by ``op`` over the ranks."""
    return _field(_Spec(op, 1, flat=True, optional=optional))


def columns(k: int, op: str = MAX, optional: bool = False):
    """A field holding ``k`` vectors of ``n`` ints (list[list[int]]), each int reduced by ``op``."""
    if k < 1:
        raise ValueError(f"columns(k={k}): at least one column")
    return _field(_Spec(op, k, optional=optional))


@functools.cache
def _specs(cls: type) -> tuple[tuple[str, _Spec], ...]:
    """``cls``'s fields in order with their declarations; TypeError naming a field that declares none."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} is not a dataclass: no reduced record")
    specs = []
    for f in dataclasses.fields(cls):
        if _KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} declares no reduction (use scalar, vector or columns)")
        specs.append((f.name, f.metadata[_KEY]))
    return tuple(specs)


def size(cls: type, n: int, optional: bool) -> int:
    """How many ints a ``cls`` record travels as, for an index space of ``n`` items, with or without its
    optional fields."""
    return sum(spec.width(n) for _, spec in _specs(cls) if optional or not spec.optional)


def _present(record) -> bool:
    """Whether ``record``'s optional fields are set: all or none, else ValueError naming them."""
    optional = {name: getattr(record, name) is not None for name, spec in _specs(type(record)) if spec.optional}
    if len(set(optional.values())) > 1:
        raise ValueError(f"{type(record).__name__}: optional fields travel together, all or none; set: "
                         f"{sorted(k for k, v in optional.items() if v)}, None: "
                         f"{sorted(k for k, v in optional.items() if not v)}")
    return any(optional.values())


def _ints(value, name: str, spec: _Spec, n: int) -> list[int]:
    """A field's value as the ints it travels as (not yet negated); ValueError naming a wrong length."""
    if spec.vectors is None:
        if not isinstance(value, int):
            raise ValueError(f"{name}: an int, got {type(value).__name__}")
        return [value]
    vectors = [value] if spec.flat else list(value)
    if len(vectors) != spec.vectors:
        raise ValueError(f"{name}: {len(vectors)} columns, declared {spec.vectors}")
    for i, v in enumerate(vectors):
        if len(v) != n:
            where = name if spec.flat else f"{name}[{i}]"
            raise ValueError(f"{where}: {len(v)} ints, expected {n} (one per item of the index space)")
    return [x for v in vectors for x in v]


def encode(record, n: int) -> list[int]:
    """``record`` as the flat list of ints its all-reduce (a MAX) takes: fields in order, min fields
    negated, optional fields only if set. ``n``: the size of the vectors' index space. Raises ValueError
    naming the field whose length is not declared, or optional fields set only in part."""
    cls, present, out = type(record), _present(record), []
    for name, spec in _specs(cls):
        if spec.optional and not present:
            continue
        ints = _ints(getattr(record, name), f"{cls.__name__}.{name}", spec, n)
        out += [-x for x in ints] if spec.op == MIN else ints
    return out


def decode(cls: type[R], values: list[int], n: int, optional: bool) -> R:
    """The ``cls`` record ``values`` (a reduced ``encode``) hold, min fields negated back. ``optional``:
    whether the optional fields were sent. Raises ValueError when the length does not match."""
    expected = size(cls, n, optional)
    if len(values) != expected:
        raise ValueError(f"{cls.__name__}: {len(values)} ints, expected {expected} for n={n} "
                         f"{'with' if optional else 'without'} its optional fields")
    fields, at = {}, 0
    for name, spec in _specs(cls):
        if spec.optional and not optional:
            continue
        width = spec.width(n)
        ints = [-x for x in values[at:at + width]] if spec.op == MIN else list(values[at:at + width])
        at += width
        if spec.vectors is None:
            fields[name] = ints[0]
        else:
            vectors = [ints[i * n:(i + 1) * n] for i in range(spec.vectors)]
            fields[name] = vectors[0] if spec.flat else vectors
    return cls(**fields)


def all_reduce(record: R, n: int, reduce_max: Callable[[list[int]], list[int]]) -> R:
    """``record`` reduced over the ranks: each field by its declared reduction. ``reduce_max``: the
    element-wise MAX all-reduce of a list of ints (``Collectives.reduce(values, "max")``), called once."""
    return decode(type(record), reduce_max(encode(record, n)), n, _present(record))


class Reducing:
    """An ``all_reduce`` started, not yet awaited: ``result()`` waits for it and decodes the reduced record."""

    def __init__(self, record, n: int, start_reduce_max):
        self.cls, self.n, self.optional = type(record), n, _present(record)
        self.pending = start_reduce_max(encode(record, n))

    def result(self):
        return decode(self.cls, self.pending.result(), self.n, self.optional)


def start_all_reduce(record: R, n: int, start_reduce_max) -> Reducing:
    """``all_reduce`` in the background: ``start_reduce_max`` starts the MAX all-reduce of a list of ints and
    returns what its ``result()`` waits for (``Collectives.start_reduce(values, "max")``)."""
    return Reducing(record, n, start_reduce_max)
