"""The reduced-record codec (``format/reduced_record.py``): round trip, min fields reduced as minima
by one MAX all-reduce, optional fields present or absent, wrong lengths refused naming the field; and
the restore's ``DecisionVote`` on the same wire as before the codec. Pure unit tests: the all-reduce is an
element-wise max over lists, one per simulated rank."""

from dataclasses import dataclass

import pytest

from megatron_pec.format import reduced_record as rr
from megatron_pec.format.reduced_record import MIN, columns, scalar, vector
from megatron_pec.restore.loader import ACCOUNT_VECTORS, NONE, DecisionVote

pytestmark = pytest.mark.megatron_free


@dataclass
class Vote:
    flag: int = scalar()
    lowest: int = scalar(MIN)
    table: list[list[int]] = columns(2)
    high: list[int] | None = vector(optional=True)
    low: list[int] | None = vector(MIN, optional=True)


def over_ranks(records, n):
    """Every rank's record reduced: the MAX all-reduce simulated as an element-wise max of the lists."""
    sent = [rr.encode(r, n) for r in records]
    assert len({len(s) for s in sent}) == 1, "every rank must send as many ints"
    merged = [max(column) for column in zip(*sent)]
    return [rr.decode(Vote, merged, n, optional=records[0].high is not None) for _ in records]


def test_a_record_survives_its_round_trip_with_and_without_the_optional_fields():
    full = Vote(1, 7, [[1, 2, 3], [4, 5, 6]], [7, 8, 9], [0, -1, 2**62])
    assert rr.decode(Vote, rr.encode(full, 3), 3, optional=True) == full
    bare = Vote(0, -1, [[1, 2, 3], [4, 5, 6]])
    assert rr.encode(bare, 3) == [0, 1, 1, 2, 3, 4, 5, 6]
    assert rr.decode(Vote, rr.encode(bare, 3), 3, optional=False) == bare
    assert rr.size(Vote, 3, optional=True) == 14 and rr.size(Vote, 3, optional=False) == 8


def test_min_fields_reduce_as_minima_and_max_fields_as_maxima_over_the_ranks():
    ranks = [Vote(0, 12, [[1, -1], [5, 0]], [3, -2], [3, NONE]),
             Vote(1, 9, [[-1, 4], [2, 0]], [-2, 6], [NONE, 6]),
             Vote(0, 15, [[0, 0], [7, 1]], [2, 5], [2, 5])]
    every = over_ranks(ranks, 2)
    assert all(e == every[0] for e in every)
    assert every[0] == Vote(flag=1, lowest=9, table=[[1, 4], [7, 1]], high=[3, 6], low=[2, 5])


def test_all_reduce_calls_the_reduction_once_and_keeps_the_optional_fields_absent():
    calls = []

    def reduce_max(values):
        calls.append(list(values))
        return values

    bare = Vote(1, 3, [[1], [2]])
    assert rr.all_reduce(bare, 1, reduce_max) == bare and calls == [[1, -3, 1, 2]]
    with_n0 = Vote(0, 0, [[], []], [], [])  # no experts: the optional fields are empty, yet present
    assert rr.all_reduce(with_n0, 0, lambda v: v) == with_n0


def test_wrong_lengths_and_partial_optional_fields_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"Vote.table\[1\]: 2 ints, expected 3"):
        rr.encode(Vote(0, 0, [[1, 2, 3], [1, 2]]), 3)
    with pytest.raises(ValueError, match=r"Vote.table: 1 columns, declared 2"):
        rr.encode(Vote(0, 0, [[1, 2, 3]]), 3)
    with pytest.raises(ValueError, match=r"Vote.high: 2 ints, expected 3"):
        rr.encode(Vote(0, 0, [[1, 2, 3], [1, 2, 3]], [1, 2], [1, 2, 3]), 3)
    with pytest.raises(ValueError, match=r"all or none.*\['high'\].*\['low'\]"):
        rr.encode(Vote(0, 0, [[1], [2]], [1]), 1)
    with pytest.raises(ValueError, match=r"Vote: 7 ints, expected 8 for n=3 without"):
        rr.decode(Vote, [0] * 7, 3, optional=False)
    with pytest.raises(ValueError, match=r"Vote.flag: an int, got str"):
        rr.encode(Vote("1", 0, [[1], [2]]), 1)


def test_a_field_without_a_declared_reduction_is_refused():
    @dataclass
    class Undeclared:
        flag: int = scalar()
        other: int = 0

    with pytest.raises(TypeError, match=r"Undeclared.other declares no reduction"):
        rr.encode(Undeclared(1, 2), 0)
    with pytest.raises(ValueError, match="reduces by 'max' or 'min'"):
        scalar("sum")


def old_values(v: DecisionVote) -> list[int]:
    """``DecisionVote.values()`` as it was written by hand before the codec: the wire to keep."""
    out = [v.failed, v.cannot, v.iteration, -v.lowest_iteration, v.newest]
    out += [x for column in v.accounting for x in column]
    if v.high is not None:
        out += v.high + [-x for x in v.low] + v.lacking
    return out


def test_the_restore_plan_vote_travels_as_it_did_before_the_codec():
    n = 3
    accounting = [[c * 10 + i for i in range(n)] for c in range(ACCOUNT_VECTORS)]
    first = DecisionVote(0, 1, 12, 12, 14, accounting, [5, -2, 12], [5, NONE, 12], [0, 0, 1])
    again = DecisionVote(1, 0, -1, -1, -1, [[-1] * n] * ACCOUNT_VECTORS)
    for vote in (first, again):
        assert rr.encode(vote, n) == old_values(vote)
        assert rr.decode(DecisionVote, old_values(vote), n, optional=vote.high is not None) == vote
