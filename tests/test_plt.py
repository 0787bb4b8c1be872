"""Unit tests for megatron_pec.pec.lost_tokens (pure)."""

from __future__ import annotations

import pytest

from megatron_pec.format.item_names import ExpertId
from megatron_pec.pec.lost_tokens import PltReport, accumulate, lost_tokens, next_k

pytestmark = pytest.mark.megatron_free

A, B, C, D = ExpertId(1, 0), ExpertId(1, 1), ExpertId(3, 0), ExpertId(3, 1)


def example() -> PltReport:
    # Target iteration 100. A and D are fresh; B was restored from iteration 90,
    # C from iteration 80.
    at_target = {A: 1000, B: 600, C: 300, D: 100}
    at_version = {A: 1000, B: 540, C: 240, D: 100}
    version = {A: 100, B: 90, C: 80, D: 100}
    return lost_tokens(at_target, at_version, version, target_iteration=100)


def test_hand_computed_example():
    r = example()
    assert r.lost_tokens == 60 + 60
    assert r.total_tokens == 2000
    assert r.fraction == pytest.approx(120 / 2000)
    assert r.stale_experts == {B: (90, 60), C: (80, 60)}


def test_per_layer_numbers():
    r = example()
    assert r.per_layer == {1: (60, 1600), 3: (60, 400)}
    assert r.per_layer_fraction(1) == pytest.approx(60 / 1600)
    assert r.per_layer_fraction(3) == pytest.approx(0.15)
    with pytest.raises(KeyError, match="no MoE layer 2"):
        r.per_layer_fraction(2)


def test_format_lines():
    lines = example().format_lines()
    assert lines[0] == ("PLT 6.0000% (120 of 2000 expert-tokens lost; 2 stale experts in 2 of 2 MoE layers)")
    assert lines[1] == "  layer 1: PLT 3.7500% (60/1600); stale expert@version (-lost tokens): E1@90 (-60)"
    assert lines[2] == "  layer 3: PLT 15.0000% (60/400); stale expert@version (-lost tokens): E0@80 (-60)"
    assert len(lines) == 3


def test_format_lines_name_the_costliest_experts_of_a_crowded_layer():
    """A layer of 256 experts restored stale would log all of them: past LISTED_PER_LAYER, the line
    gives their count and names the ones that lost most."""
    from megatron_pec.pec.lost_tokens import LISTED_PER_LAYER

    experts = [ExpertId(2, e) for e in range(40)]
    at_version = {x: 100 for x in experts}
    at_target = {x: 100 + x.expert for x in experts}  # E39 lost most, E0 nothing
    lines = lost_tokens(at_target, at_version, {x: 5 for x in experts}, 9).format_lines()
    named = [f"E{e}@5 (-{e})" for e in range(39, 39 - LISTED_PER_LAYER, -1)]
    assert lines[1].endswith(f"stale expert@version (-lost tokens): 40, the {LISTED_PER_LAYER} that lost most: "
                             + ", ".join(named)), lines[1]


def test_zero_loss_when_everything_is_fresh():
    counts = {A: 10, B: 0, C: 7}
    r = lost_tokens(counts, counts, {e: 50 for e in counts}, 50)
    assert (r.lost_tokens, r.total_tokens, r.fraction) == (0, 17, 0.0)
    assert r.stale_experts == {}
    assert r.format_lines() == ["PLT 0.0000% (0 of 17 expert-tokens lost; 0 stale experts in 0 of 2 MoE layers)"]


def test_stale_expert_without_tokens_is_listed_with_zero_loss():
    r = lost_tokens({A: 5}, {A: 5}, {A: 10}, 20)
    assert r.stale_experts == {A: (10, 0)} and r.lost_tokens == 0


def test_empty_and_zero_total():
    r = lost_tokens({}, {}, {}, 10)
    assert (r.lost_tokens, r.total_tokens, r.fraction) == (0, 0, 0.0)
    z = lost_tokens({A: 0}, {A: 0}, {A: 5}, 10)
    assert z.fraction == 0.0 and z.per_layer_fraction(1) == 0.0


@pytest.mark.parametrize("at_target, at_version, version, target, match", [
    ({A: 5, B: 1}, {A: 5}, {A: 1, B: 1}, 10, r"cumulative_at_version lacks \[L1\.E1\]"),
    ({A: 5}, {A: 5}, {A: 1, C: 1}, 10, r"version_of lacks nothing and has extra \[L3\.E0\]"),
    ({A: 5}, {A: 6}, {A: 1}, 10, "counts cannot go down"),
    ({A: 5}, {A: 5}, {A: 11}, 10, "after the target 10"),
    ({A: -1}, {A: -2}, {A: 1}, 10, "negative cumulative token count"),
    ({A: 9}, {A: 5}, {A: 10}, 10, "restored at the target 10 yet its counts differ"),
])
def test_inconsistent_bookkeeping_is_rejected(at_target, at_version, version, target, match):
    with pytest.raises(ValueError, match=match):
        lost_tokens(at_target, at_version, version, target)


def test_accumulate_over_faults():
    r = example()
    lost, frac = accumulate(0, r)
    assert (lost, frac) == (120, pytest.approx(0.06))
    lost, frac = accumulate(lost, r)
    assert (lost, frac) == (240, pytest.approx(0.12))
    assert accumulate(7, lost_tokens({}, {}, {}, 1)) == (7, 0.0)
    with pytest.raises(ValueError, match="previous_lost"):
        accumulate(-1, r)


@pytest.mark.parametrize("k, plt, threshold, experts, expected", [
    (1, 0.05, 0.0375, 8, 2),     # over the threshold: double
    (2, 0.01, 0.0375, 8, 2),     # under: unchanged
    (2, 0.0375, 0.0375, 8, 2),   # equal is not "exceeds"
    (4, 0.2, 0.0375, 8, 8),
    (5, 0.2, 0.0375, 8, 8),      # capped at num_experts
    (8, 0.9, 0.0375, 8, 8),
])
def test_next_k(k, plt, threshold, experts, expected):
    assert next_k(k, plt, threshold, experts) == expected


@pytest.mark.parametrize("args, match", [
    ((0, 0.1, 0.05, 8), "k must be in"),
    ((9, 0.1, 0.05, 8), "k must be in"),
    ((1, -0.1, 0.05, 8), "must be >= 0"),
    ((1, 0.1, -0.05, 8), "must be >= 0"),
])
def test_next_k_rejects_bad_values(args, match):
    with pytest.raises(ValueError, match=match):
        next_k(*args)


def test_pec_state_text_packs_the_held_experts_values():
    """A save encodes its rank's expert versions from whole arrays (``HeldExperts``): a state laid out
    in the rank's expert order and one set expert by expert give the same text; ``loads`` gives back
    exactly the held experts' values, also when some have none yet; the JSON-object form of older
    files still loads."""
    import json
    import random

    from megatron_pec.format.item_names import ExpertId, ExpertOrder
    from megatron_pec.pec.expert_values import HeldExperts
    from megatron_pec.pec.state import Level, PecState

    rng = random.Random(3)
    experts = [ExpertId(layer, e) for layer in (2, 5) for e in range(6)]
    order = ExpertOrder(experts)
    for held_everything in (True, False):
        by_expert = PecState(Level(2), Level(1), lost_tokens=17, plt=0.0123456789, recoveries=2)
        laid_out = by_expert.laid_out(order)
        saved = experts if held_everything else experts[::2]
        tokens = [{x: rng.randrange(10**12) for x in experts}, {x: rng.randrange(100) for x in experts}]
        for state in (by_expert, laid_out):
            state.snapshot.record(saved, 7, tokens[0])
            state.persist.record(saved[:3], 4, tokens[1])
        assert laid_out.snapshot.saved_at.aligned(order) is not None  # (the arrays' path was taken)
        held = HeldExperts(experts[1:], order)
        text = laid_out.dumps(held)
        assert text == by_expert.dumps(held)
        back = PecState.loads(text)
        mine = [x for x in saved if x in held.experts]
        assert back.snapshot.saved_at == {x: 7 for x in mine}
        assert back.snapshot.tokens_at == {x: tokens[0][x] for x in mine}
        assert back.persist.saved_at == {x: 4 for x in saved[:3] if x in held.experts}
        assert back.persist.tokens_at == {x: tokens[1][x] for x in saved[:3] if x in held.experts}
        assert (back.snapshot.k, back.snapshot.checkpoints, back.lost_tokens, back.plt, back.recoveries) == \
            (2, 1, 17, 0.0123456789, 2)
    level = {"k": 2, "checkpoints": 1, "saved_at": {"L2.E0": 7}, "tokens_at": {"L2.E0": 9}}
    older = PecState.loads(json.dumps({"snapshot": level, "persist": {**level, "saved_at": {}, "tokens_at": {}},
                                       "lost_tokens": 0, "plt": 0.0, "recoveries": 0}))
    assert older.snapshot.saved_at == {ExpertId(2, 0): 7} and older.snapshot.tokens_at == {ExpertId(2, 0): 9}


def test_planning_every_expert_is_what_each_policy_picks():
    """K = all experts (no byte budget) plans every expert without asking the policy: exactly what each
    policy picks then, at one level and at two."""
    from megatron_pec.format.item_names import ExpertId
    from megatron_pec.pec import policy
    from megatron_pec.pec.state import Level, PecState

    lay = policy.ExpertGrid((1, 3), 4, 2, 100)
    cumulative = {x: 10 * x.expert + x.layer for x in lay.all_experts()}
    for name in policy.POLICIES:
        state = PecState(Level(4), Level(4))
        state.snapshot.record([ExpertId(1, 2)], 5, cumulative)
        for persist in (False, True):
            planned = state.plan(name, lay, cumulative, persist, None)
            assert planned == (frozenset(lay.all_experts()), frozenset(lay.all_experts()) if persist else frozenset())
            snap_in = state.snapshot.input(lay, cumulative, None)
            picked = policy.select_two_level(name, snap_in, state.persist.input(lay, cumulative, None)) if persist \
                else (policy.select_experts(name, snap_in), frozenset())
            assert planned == picked, (name, persist)
