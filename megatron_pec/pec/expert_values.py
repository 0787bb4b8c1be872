"""Per-expert counters as arrays: what keeps a save's cost independent of the number of experts.

A large MoE model has tens of thousands of experts (58 layers x 256), and every save updates and
writes the PEC state of each one a rank holds. ``ExpertValues`` is a dict of ExpertId -> int for
whoever reads or sets a few experts (the loader, the policies' reference path, the tests), kept
as one int64 array over a fixed expert order, so that a save records, plans and encodes whole
arrays with numpy instead of one Python call per expert (``packed_column.PackedColumn`` is their stored form).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import numpy

from megatron_pec.format.item_names import ExpertId, ExpertOrder, item_name
from megatron_pec.format.packed_column import ABSENT, PackedColumn


class ExpertValues(MutableMapping):
    """ExpertId -> non-negative int, as an int64 array over ``order`` (``ABSENT``: no value).

    Setting an expert outside the order extends it (a restore merges the parts of several ranks)."""

    def __init__(self, order: ExpertOrder | None = None, array: numpy.ndarray | None = None):
        self.order = order if order is not None else ExpertOrder(())
        self.array = array if array is not None else numpy.full(len(self.order), ABSENT, dtype=numpy.int64)

    @classmethod
    def of(cls, values: Mapping, order: ExpertOrder | None = None) -> "ExpertValues":
        """A copy of ``values`` laid out in ``order`` (extended by any expert it lacks)."""
        out = cls(order)
        out.update(values)
        return out

    def aligned(self, order: ExpertOrder) -> numpy.ndarray | None:
        """The array when it is laid out in ``order``, else None (the caller then goes expert by expert)."""
        return self.array if self.order is order else None

    def __getitem__(self, expert: ExpertId) -> int:
        value = int(self.array[self.order.index[expert]])
        if value == ABSENT:
            raise KeyError(expert)
        return value

    def __contains__(self, expert) -> bool:
        i = self.order.index.get(expert)
        return i is not None and self.array[i] != ABSENT

    def __setitem__(self, expert: ExpertId, value: int) -> None:
        self.update({expert: value})

    def __delitem__(self, expert: ExpertId) -> None:
        if expert not in self:
            raise KeyError(expert)
        self.array[self.order.index[expert]] = ABSENT

    def __iter__(self):
        experts = self.order.experts
        return iter([experts[i] for i in numpy.flatnonzero(self.array != ABSENT).tolist()])

    def __len__(self) -> int:
        return int(numpy.count_nonzero(self.array != ABSENT))

    def update(self, other=(), **kwargs) -> None:
        pairs = list(other.items() if isinstance(other, Mapping) else other)
        if kwargs:
            raise TypeError("ExpertValues keys are ExpertIds, not keywords")
        if not pairs:
            return
        values = [int(v) for _, v in pairs]
        if min(values) < 0:
            raise ValueError(f"per-expert counters are non-negative, got {min(values)}")
        unknown = [x for x, _ in pairs if x not in self.order.index]
        if unknown:
            self._extend(unknown)
        self.array[self.order.positions([x for x, _ in pairs])] = values

    def _extend(self, experts: list[ExpertId]) -> None:
        if not all(isinstance(x, tuple) for x in experts):
            raise TypeError(f"ExpertValues keys are ExpertIds, got {experts[0]!r}")
        self.order = self.order.extended(experts)
        grown = numpy.full(len(self.order), ABSENT, dtype=numpy.int64)
        grown[:len(self.array)] = self.array
        self.array = grown

    def add(self, amounts: numpy.ndarray) -> None:
        """Add ``amounts``, laid out in this order, to every expert's value (none counts as 0)."""
        self.array[:] = numpy.maximum(self.array, 0) + amounts

    def __repr__(self) -> str:
        return f"ExpertValues({dict(self.items())})"


def values_in(values: Mapping, order: ExpertOrder, default: int) -> numpy.ndarray:
    """``values`` as an array over ``order``, ``default`` where it has none (with ``default=ABSENT``,
    an aligned ``ExpertValues``' own array, not a copy)."""
    array = values.aligned(order) if isinstance(values, ExpertValues) else None
    if array is None:
        array = numpy.fromiter(map(values.get, order.experts, [ABSENT] * len(order)), dtype=numpy.int64,
                               count=len(order))
    return array if default == ABSENT else numpy.where(array == ABSENT, default, array)


class HeldExperts:
    """The experts a rank's files describe: their names (spelled once, for every save's header) and
    their positions in the rank's expert order."""

    def __init__(self, experts: Sequence[ExpertId], order: ExpertOrder):
        self.experts = tuple(experts)
        self.order = order
        self.names_text = ",".join(map(item_name, self.experts))
        self.positions = order.positions(self.experts)

    def column(self, values: Mapping) -> "PackedColumn":
        """The held experts' values of ``values`` (``ABSENT`` where it has none)."""
        picked = values_in(values, self.order, ABSENT)[self.positions]
        return PackedColumn(self.names_text, picked.astype("<i8", copy=False).tobytes())


