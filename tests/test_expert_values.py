"""Unit tests for megatron_pec.pec.expert_values and megatron_pec.format.packed_column: per-expert counters as arrays
that read and write like dicts (pure; numpy only)."""

from __future__ import annotations

import numpy
import pytest

from megatron_pec.format.item_names import ExpertId, ExpertOrder
from megatron_pec.format.packed_column import ABSENT, PackedColumn
from megatron_pec.pec.expert_values import ExpertValues, HeldExperts, values_in

pytestmark = pytest.mark.megatron_free

EXPERTS = [ExpertId(layer, e) for layer in (1, 3) for e in range(4)]


def test_expert_values_behave_like_a_dict():
    order = ExpertOrder(EXPERTS)
    values = ExpertValues(order)
    plain = {}
    for x, v in ((EXPERTS[2], 5), (EXPERTS[7], 0), (EXPERTS[2], 9), (EXPERTS[0], 2**50)):
        values[x], plain[x] = v, v
    assert values == plain and len(values) == 3 and list(values) == sorted(plain)
    assert EXPERTS[7] in values and EXPERTS[1] not in values and values.get(EXPERTS[1], -5) == -5
    del values[EXPERTS[7]], plain[EXPERTS[7]]
    assert values == plain and EXPERTS[7] not in values
    with pytest.raises(KeyError):
        values[EXPERTS[7]]
    with pytest.raises(KeyError):
        del values[EXPERTS[7]]
    with pytest.raises(ValueError, match="non-negative"):
        values[EXPERTS[1]] = -1  # (the array's "none")
    assert values.aligned(order) is values.array and values.aligned(ExpertOrder(EXPERTS)) is None


def test_an_expert_outside_the_order_extends_it():
    """A restore merges the parts of several ranks into one state: their experts join the order."""
    order = ExpertOrder(EXPERTS[:4])
    values = ExpertValues.of({EXPERTS[1]: 3}, order)
    values.update({EXPERTS[6]: 4, EXPERTS[1]: 7, EXPERTS[5]: 1})
    assert values == {EXPERTS[1]: 7, EXPERTS[6]: 4, EXPERTS[5]: 1}
    assert values.aligned(order) is None and len(order) == 4  # (the shared order is not changed)
    laid_out = ExpertValues.of(values, ExpertOrder(EXPERTS))
    assert laid_out == values and len(laid_out.order) == len(EXPERTS)


def test_values_in_and_held_columns_from_arrays_and_from_dicts():
    order = ExpertOrder(EXPERTS)
    plain = {EXPERTS[1]: 4, EXPERTS[6]: 8}
    arrays = ExpertValues.of(plain, order)
    for values in (plain, arrays):
        assert values_in(values, order, 0).tolist() == [0, 4, 0, 0, 0, 0, 8, 0]
        assert values_in(values, order, ABSENT).tolist() == [-1, 4, -1, -1, -1, -1, 8, -1]
    held = HeldExperts(EXPERTS[4:], order)
    assert held.names_text == "L3.E0,L3.E1,L3.E2,L3.E3"
    for values in (plain, arrays):
        column = held.column(values)
        assert dict(column) == {"L3.E2": 8} and column.raw == held.column(arrays).raw


def test_packed_column_round_trips_and_rejects_what_is_malformed():
    raw = numpy.array([3, ABSENT, 2**62], dtype="<i8").tobytes()
    column = PackedColumn("L1.E0,L1.E1,L2.E5", raw)
    assert dict(column) == {"L1.E0": 3, "L2.E5": 2**62} and len(column) == 2 and "L1.E1" not in column
    back = PackedColumn.decoded(column.encoded())
    assert back == column and back.raw == raw and PackedColumn.is_packed(column.encoded())
    assert dict(PackedColumn("", b"")) == {} and dict(PackedColumn.decoded({"experts": "", "values": ""})) == {}
    with pytest.raises(ValueError, match="2 experts but 3 values"):
        PackedColumn.decoded({"experts": "L1.E0,L1.E1", "values": column.encoded()["values"]})
    with pytest.raises(ValueError, match="must be strings"):
        PackedColumn.decoded({"experts": ["L1.E0"], "values": ""})


def test_adding_counts_to_every_expert():
    order = ExpertOrder(EXPERTS[:3])
    values = ExpertValues.of({EXPERTS[0]: 5, EXPERTS[2]: 1}, order)
    values.add(numpy.array([1, 2, 0]))
    assert values == {EXPERTS[0]: 6, EXPERTS[1]: 2, EXPERTS[2]: 1}
