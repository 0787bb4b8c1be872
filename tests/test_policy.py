"""Unit tests for megatron_pec.pec.policy (pure; no torch)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron_pec.format.item_names import ExpertId
from megatron_pec.pec.policy import (
    POLICIES,
    ExpertGrid,
    SelectionInput,
    bytes_per_ep_rank,
    select_experts,
    select_two_level,
)

pytestmark = pytest.mark.megatron_free

EB = 100  # expert_bytes used throughout


def layout(num_layers=4, num_experts=8, ep=4, first_layer=1):
    return ExpertGrid(tuple(range(first_layer, first_layer + num_layers)), num_experts, ep, EB)


def all_saved(lay, iteration=0):
    return {e: iteration for e in lay.all_experts()}


def inp(lay, k, *, tokens=None, last=None, index=0, budget=None, candidates=None):
    return SelectionInput(lay, k, tokens or {}, all_saved(lay) if last is None else last, index, budget, candidates)


def per_layer(selected):
    counts = {}
    for e in selected:
        counts[e.layer] = counts.get(e.layer, 0) + 1
    return counts


# ---------------------------------------------------------------- layout / input validation

def test_layout_ep_rank_and_experts():
    lay = layout(num_layers=2, num_experts=8, ep=4)
    assert [lay.ep_rank_of(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert lay.all_experts()[:3] == (ExpertId(1, 0), ExpertId(1, 1), ExpertId(1, 2))
    assert len(lay.all_experts()) == 16
    with pytest.raises(ValueError, match="out of range"):
        lay.ep_rank_of(8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layers=(), num_experts=8, ep_size=2, expert_bytes=1), "layers"),
    (dict(layers=(2, 1), num_experts=8, ep_size=2, expert_bytes=1), "increasing"),
    (dict(layers=(1,), num_experts=6, ep_size=4, expert_bytes=1), "multiple of ep_size"),
    (dict(layers=(1,), num_experts=8, ep_size=2, expert_bytes=0), "expert_bytes"),
])
def test_layout_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertGrid(**kwargs)


@pytest.mark.parametrize("k", [0, 9, -1])
def test_k_out_of_range(k):
    with pytest.raises(ValueError, match=r"k must be in 1\.\.num_experts \(8\), got"):
        inp(layout(), k)


def test_bad_policy_name_lists_allowed_values():
    with pytest.raises(ValueError, match="unknown selection policy 'random'.*sequential, load-aware, popularity"):
        select_experts("random", inp(layout(), 2))


@pytest.mark.parametrize("field, value, match", [
    ("tokens", {ExpertId(9, 0): 1}, "unsaved_tokens names experts outside"),
    ("tokens", {ExpertId(1, 0): -1}, "must be >= 0"),
    ("last", {ExpertId(1, 8): 0}, "last_saved names experts outside"),
    ("candidates", frozenset({ExpertId(0, 0)}), "candidates names experts outside"),
    ("budget", -1, "budget_bytes"),
    ("index", -1, "checkpoint_index"),
])
def test_input_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        inp(layout(), 2, **{field: value})


# ---------------------------------------------------------------- sequential

COMBOS = [  # (L, E, EP, K)
    (1, 8, 1, 1), (4, 8, 4, 1), (4, 8, 4, 2), (4, 8, 4, 3), (3, 8, 2, 3), (5, 16, 8, 3),
    (6, 64, 8, 1), (6, 64, 8, 5), (7, 32, 4, 7), (2, 8, 8, 8), (12, 128, 16, 13), (3, 6, 3, 4),
]


@pytest.mark.parametrize("L, E, EP, K", COMBOS)
def test_sequential_k_per_layer_and_balanced(L, E, EP, K):
    lay = layout(L, E, EP)
    for c in range(2 * E):
        sel = select_experts("sequential", inp(lay, K, index=c))
        assert per_layer(sel) == {layer: K for layer in lay.layers}
        per_rank = bytes_per_ep_rank(lay, sel)
        assert max(per_rank) - min(per_rank) <= EB, (c, per_rank)


@pytest.mark.parametrize("L, E, EP, K", COMBOS)
def test_sequential_coverage(L, E, EP, K):
    lay = layout(L, E, EP)
    window = math.ceil(E / K)
    for start in sorted({0, 1, window - 1, E - 1, E + 3}):
        covered = set()
        for c in range(start, start + window):
            covered |= select_experts("sequential", inp(lay, K, index=c))
        assert covered == set(lay.all_experts()), start


def test_sequential_interleaves_ep_ranks_and_shifts_per_layer():
    lay = layout(num_layers=2, num_experts=8, ep=4)
    sel = select_experts("sequential", inp(lay, 2, index=0))
    # Layer 1 takes the first expert of ranks 0 and 1, layer 2 continues with ranks 2 and 3.
    assert sel == {ExpertId(1, 0), ExpertId(1, 2), ExpertId(2, 4), ExpertId(2, 6)}


def test_sequential_is_deterministic_and_ignores_mapping_order():
    lay = layout(5, 16, 4)
    rng = random.Random(1)
    tokens = {e: rng.randrange(100) for e in lay.all_experts()}
    last = all_saved(lay, 10)
    shuffled = list(last.items())
    random.Random(2).shuffle(shuffled)
    for policy in POLICIES:
        a = select_experts(policy, inp(lay, 3, tokens=tokens, last=last, index=7))
        b = select_experts(policy, inp(lay, 3, tokens=dict(reversed(tokens.items())), last=dict(shuffled), index=7))
        assert a == b


# ---------------------------------------------------------------- load-aware

def test_load_aware_picks_most_unsaved_per_layer():
    lay = layout(num_layers=2, num_experts=8, ep=1)
    tokens = {ExpertId(1, e): 10 * e for e in range(8)} | {ExpertId(2, e): 100 - e for e in range(8)}
    sel = select_experts("load-aware", inp(lay, 3, tokens=tokens))
    assert sel == {ExpertId(1, 7), ExpertId(1, 6), ExpertId(1, 5), ExpertId(2, 0), ExpertId(2, 1), ExpertId(2, 2)}


def test_load_aware_ties_follow_sequential_order():
    lay = layout(3, 8, 4)
    for c in range(4):
        assert select_experts("load-aware", inp(lay, 2, index=c)) == select_experts("sequential", inp(lay, 2, index=c))


def test_load_aware_respects_ep_capacity():
    # All load sits on EP rank 0 (experts 0, 1): capacity ceil(2*2/2) = 2 forces spreading.
    lay = layout(num_layers=2, num_experts=4, ep=2)
    tokens = {ExpertId(layer, e): (1000 if e < 2 else 1) for layer in (1, 2) for e in range(4)}
    tokens[ExpertId(1, 0)] = tokens[ExpertId(1, 1)] = 2000
    sel = select_experts("load-aware", inp(lay, 2, tokens=tokens))
    assert per_layer(sel) == {1: 2, 2: 2}
    assert bytes_per_ep_rank(lay, sel) == [2 * EB, 2 * EB]
    # The heaviest experts win the rank-0 capacity.
    assert {ExpertId(1, 0), ExpertId(1, 1)} <= sel


@pytest.mark.parametrize("L, E, EP, K", COMBOS)
def test_load_aware_exact_k_and_capacity_on_random_loads(L, E, EP, K):
    lay = layout(L, E, EP)
    rng = random.Random(L * 1000 + E * 10 + K)
    for _ in range(5):
        tokens = {e: rng.randrange(0, 50) for e in lay.all_experts()}
        sel = select_experts("load-aware", inp(lay, K, tokens=tokens))
        assert per_layer(sel) == {layer: K for layer in lay.layers}
        # Capacity ceil(K*L/EP) per EP rank is always feasible with equal-size blocks.
        assert max(bytes_per_ep_rank(lay, sel)) <= math.ceil(K * L / EP) * EB


def _capacity_feasible(lay, cands, k):
    """Brute force: can every layer get min(k, its candidates) within ceil(total / ep) per EP rank?"""
    per_layer_options = []
    for layer in lay.layers:
        mine = sorted(e for e in cands if e.layer == layer)
        per_layer_options.append(list(itertools.combinations(mine, min(k, len(mine)))))
    total = sum(len(opts[0]) for opts in per_layer_options)
    cap = math.ceil(total / lay.ep_size)
    return any(max(bytes_per_ep_rank(lay, set(itertools.chain(*combo)))) <= cap * EB
               for combo in itertools.product(*per_layer_options)), cap


@pytest.mark.parametrize("seed", range(40))
def test_load_aware_respects_capacity_whenever_feasible(seed):
    # Random candidate sets and loads: greedy order alone can strand a layer on full
    # ranks; the result must still meet the capacity whenever some choice does.
    rng = random.Random(seed)
    lay = layout(num_layers=3, num_experts=4, ep=rng.choice([2, 4]))
    cands = frozenset(e for e in lay.all_experts() if rng.random() < 0.7)
    k = rng.randrange(1, 4)
    tokens = {e: rng.randrange(0, 20) for e in lay.all_experts()}
    sel = select_experts("load-aware", inp(lay, k, tokens=tokens, candidates=cands))
    available = {layer: sum(1 for e in cands if e.layer == layer) for layer in lay.layers}
    assert per_layer(sel) == {layer: min(k, n) for layer, n in available.items() if n}
    feasible, cap = _capacity_feasible(lay, cands, k)
    if feasible:
        assert max(bytes_per_ep_rank(lay, sel)) <= cap * EB


def test_load_aware_fills_layer_when_capacity_cannot_be_met():
    # Candidates leave layer 2 only rank-0 experts, while rank 0 is filled by layer 1's load.
    lay = layout(num_layers=2, num_experts=4, ep=2)
    cands = frozenset({ExpertId(1, 0), ExpertId(1, 1), ExpertId(1, 2), ExpertId(2, 0), ExpertId(2, 1)})
    tokens = {ExpertId(1, 0): 9, ExpertId(1, 1): 9, ExpertId(2, 0): 1, ExpertId(2, 1): 1}
    sel = select_experts("load-aware", inp(lay, 2, tokens=tokens, candidates=cands))
    assert per_layer(sel) == {1: 2, 2: 2}


# ---------------------------------------------------------------- popularity

def test_popularity_budget_respected_and_proportional():
    lay = layout(num_layers=3, num_experts=8, ep=2)
    weights = {1: 600, 2: 300, 3: 100}
    tokens = {ExpertId(layer, e): weights[layer] + e for layer in lay.layers for e in range(8)}
    sel = select_experts("popularity", inp(lay, 2, tokens=tokens, budget=10 * EB + 50))
    assert len(sel) * EB <= 10 * EB + 50
    counts = per_layer(sel)
    assert len(sel) == 10 and counts[1] >= counts[2] >= counts[3]
    assert counts == {1: 6, 2: 3, 3: 1}


def test_popularity_default_budget_is_k_per_layer():
    lay = layout(num_layers=4, num_experts=8, ep=4)
    tokens = {e: 1 + e.expert for e in lay.all_experts()}
    assert len(select_experts("popularity", inp(lay, 3, tokens=tokens))) == 3 * 4


def test_popularity_most_unsaved_first_within_layer():
    lay = layout(num_layers=1, num_experts=8, ep=1)
    tokens = {ExpertId(1, e): v for e, v in enumerate([5, 50, 7, 90, 1, 60, 2, 3])}
    sel = select_experts("popularity", inp(lay, 1, tokens=tokens, budget=3 * EB))
    assert sel == {ExpertId(1, 3), ExpertId(1, 5), ExpertId(1, 1)}


def test_popularity_layer_without_tokens_gets_nothing_while_others_need_slots():
    lay = layout(num_layers=2, num_experts=4, ep=1)
    tokens = {ExpertId(1, e): 10 for e in range(4)}
    sel = select_experts("popularity", inp(lay, 1, tokens=tokens, budget=3 * EB))
    assert per_layer(sel) == {1: 3}


def test_popularity_leftover_budget_goes_to_stalest_experts():
    lay = layout(num_layers=2, num_experts=4, ep=1)
    tokens = {ExpertId(1, 0): 10}  # only one expert has work to lose
    last = all_saved(lay, 50) | {ExpertId(2, 3): 10, ExpertId(1, 2): 20}
    sel = select_experts("popularity", inp(lay, 1, tokens=tokens, last=last, budget=3 * EB))
    assert sel == {ExpertId(1, 0), ExpertId(2, 3), ExpertId(1, 2)}


def test_popularity_capped_layer_passes_slots_on():
    # Layer 1 has most tokens but only one busy expert; the rest of its share moves to layer 2.
    lay = layout(num_layers=2, num_experts=4, ep=1)
    tokens = {ExpertId(1, 0): 1000, ExpertId(2, 0): 5, ExpertId(2, 1): 4, ExpertId(2, 2): 3}
    sel = select_experts("popularity", inp(lay, 1, tokens=tokens, budget=4 * EB))
    assert sel == {ExpertId(1, 0), ExpertId(2, 0), ExpertId(2, 1), ExpertId(2, 2)}


def test_popularity_zero_budget_selects_nothing():
    lay = layout()
    assert select_experts("popularity", inp(lay, 1, tokens={e: 1 for e in lay.all_experts()}, budget=0)) == set()


@pytest.mark.parametrize("seed", range(10))
def test_popularity_monotone_in_layer_load(seed):
    rng = random.Random(seed)
    lay = layout(num_layers=5, num_experts=16, ep=4)
    tokens = {e: rng.randrange(1, 100) for e in lay.all_experts()}
    budget = rng.randrange(0, 60) * EB
    sel = select_experts("popularity", inp(lay, 1, tokens=tokens, budget=budget))
    assert len(sel) * EB <= budget
    load = {layer: sum(v for e, v in tokens.items() if e.layer == layer) for layer in lay.layers}
    counts = per_layer(sel)
    for a in lay.layers:
        for b in lay.layers:
            if load[a] > load[b]:
                assert counts.get(a, 0) >= counts.get(b, 0)


# ---------------------------------------------------------------- rules shared by all policies

@pytest.mark.parametrize("policy", POLICIES)
def test_first_checkpoint_saves_every_expert(policy):
    lay = layout()
    assert select_experts(policy, inp(lay, 1, last={}, budget=0)) == set(lay.all_experts())


@pytest.mark.parametrize("policy", POLICIES)
def test_never_saved_experts_come_first(policy):
    lay = layout(num_layers=2, num_experts=8, ep=4)
    never = {ExpertId(1, 5), ExpertId(1, 6), ExpertId(1, 7), ExpertId(2, 3)}
    last = {e: 0 for e in lay.all_experts() if e not in never}
    tokens = {e: 100 for e in lay.all_experts() if e not in never}
    # popularity: the never-saved use 4 of 5 slots; the last goes to layer 2 (more unsaved tokens).
    sel = select_experts(policy, inp(lay, 2, tokens=tokens, last=last, budget=5 * EB))
    assert never <= sel
    # They count against K: layer 1 already has 3 > K, layer 2 gets one more.
    assert per_layer(sel) == {1: 3, 2: 2}


@pytest.mark.parametrize("policy", POLICIES)
def test_candidates_restrict_selection(policy):
    lay = layout(num_layers=2, num_experts=8, ep=4)
    cands = frozenset({ExpertId(1, 1), ExpertId(1, 4), ExpertId(1, 7), ExpertId(2, 2)})
    tokens = {e: 1 + e.expert for e in lay.all_experts()}
    sel = select_experts(policy, inp(lay, 2, tokens=tokens, candidates=cands, index=3))
    assert sel <= cands
    if policy != "popularity":  # K capped at what each layer has
        assert per_layer(sel) == {1: 2, 2: 1}


def test_sequential_candidates_prefer_stalest():
    lay = layout(num_layers=1, num_experts=8, ep=2)
    last = all_saved(lay, 100) | {ExpertId(1, 6): 40, ExpertId(1, 2): 70}
    cands = frozenset(ExpertId(1, e) for e in (1, 2, 3, 6))
    assert select_experts("sequential", inp(lay, 2, last=last, candidates=cands)) == {ExpertId(1, 6), ExpertId(1, 2)}


# ---------------------------------------------------------------- two levels

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_persist_subset_of_snapshot(policy, seed):
    rng = random.Random(seed)
    lay = layout(num_layers=3, num_experts=8, ep=4)
    snap_last, pers_last = all_saved(lay, 10), all_saved(lay, 0)
    snap_tok = {e: rng.randrange(50) for e in lay.all_experts()}
    pers_tok = {e: v + rng.randrange(50) for e, v in snap_tok.items()}
    snap_in = inp(lay, 4, tokens=snap_tok, last=snap_last, index=5)
    snap, pers = select_two_level(policy, snap_in, inp(lay, 2, tokens=pers_tok, last=pers_last, index=2))
    assert pers <= snap
    if policy == "popularity":
        assert len(snap) <= 12 and len(pers) <= 6  # the snapshot budget holds the persisted experts
    else:
        assert per_layer(snap) == {1: 4, 2: 4, 3: 4}  # snapshot K, the persisted ones included
        assert per_layer(pers) == {1: 2, 2: 2, 3: 2}


def test_persist_set_is_chosen_among_all_experts_and_joins_the_snapshot():
    lay = layout(num_layers=1, num_experts=8, ep=1)
    snap_tok = {ExpertId(1, e): 100 - e for e in range(8)}  # snapshot picks 0..3
    pers_tok = {ExpertId(1, e): e for e in range(8)}  # most unpersisted: 7 and 6
    snap, pers = select_two_level("load-aware", inp(lay, 4, tokens=snap_tok), inp(lay, 2, tokens=pers_tok))
    assert pers == {ExpertId(1, 7), ExpertId(1, 6)}
    assert snap == {ExpertId(1, e) for e in (0, 1, 6, 7)}  # topped up to K=4 with the snapshot level's top


@pytest.mark.parametrize("policy", POLICIES)
def test_equal_k_at_both_levels_copies_only_the_persisted_experts(policy):
    # Every save persisted with the same K at both levels: the snapshot copies K experts, not 2K.
    lay = layout(num_layers=2, num_experts=8, ep=2)
    snap, pers = select_two_level(policy, inp(lay, 2, last=all_saved(lay, 5), index=3),
                                  inp(lay, 2, last=all_saved(lay, 1), index=1))
    assert snap == pers and len(snap) <= 4


def test_no_expert_starves_when_every_second_snapshot_is_persisted():
    # Sequential snapshot K=4 of 8 alternates between two halves; persisting every second
    # snapshot must still bring every expert to storage (it used to persist only one half).
    lay = layout(num_layers=2, num_experts=8, ep=2)
    snap_last, pers_last, persisted = {}, {}, set()
    for c in range(18):  # persists at 3, 5, ..., 17 after the first (which holds every expert): 8 of them
        snap_in = inp(lay, 4, last=dict(snap_last), index=c)
        if c % 2:
            snap, pers = select_two_level("sequential", snap_in, inp(lay, 1, last=dict(pers_last), index=c // 2))
            pers_last |= {e: c for e in pers}
            if c > 1:
                persisted |= pers
        else:
            snap = select_experts("sequential", snap_in)
        snap_last |= {e: c for e in snap}
    assert persisted == set(lay.all_experts())


@pytest.mark.parametrize("policy", POLICIES)
def test_never_persisted_experts_join_snapshot(policy):
    # Snapshots ran before without persisting: the first persist must still hold every expert.
    lay = layout(num_layers=2, num_experts=4, ep=2)
    snap, pers = select_two_level(policy, inp(lay, 1, index=3), inp(lay, 1, last={}, budget=0))
    assert snap == pers == set(lay.all_experts())


def test_sequential_persist_cycles_through_all_experts():
    # Snapshot K=2, persist K=1 every checkpoint: stalest-first keeps every expert reaching storage.
    lay = layout(num_layers=1, num_experts=8, ep=2)
    snap_last, pers_last = {}, {}
    persisted_at = {}
    for c in range(24):
        snap, pers = select_two_level("sequential", inp(lay, 2, last=dict(snap_last), index=c),
                                      inp(lay, 1, last=dict(pers_last), index=c))
        snap_last |= {e: c for e in snap}
        pers_last |= {e: c for e in pers}
        for e in pers:
            persisted_at.setdefault(e, []).append(c)
    assert set(persisted_at) == set(lay.all_experts())
    assert all(max(cs) >= 12 for cs in persisted_at.values())


def test_two_level_rejects_different_layouts():
    with pytest.raises(ValueError, match="same ExpertGrid"):
        select_two_level("sequential", inp(layout(), 2), inp(layout(num_layers=3), 1))


def test_vectorised_selection_is_the_reference_selection(monkeypatch):
    """Sequential and load-aware run vectorised whenever the greedy choice fits every EP rank's
    capacity; on random layouts, K, token counts, never-saved experts and candidate sets they
    choose exactly what the per-expert reference chooses (which decides whenever they decline)."""
    from megatron_pec.pec import policy

    rng = random.Random(5)
    decided = 0
    for _ in range(400):
        ep = rng.choice([1, 2, 4])
        lay = layout(num_layers=rng.randint(1, 5), num_experts=ep * rng.randint(1, 6), ep=ep,
                     first_layer=rng.randint(1, 3))
        experts = lay.all_experts()
        last = {e: rng.randrange(4) for e in experts if rng.random() > rng.choice([0.0, 0.1, 0.9])}
        tokens = {e: rng.randrange(3) for e in experts}
        candidates = None if rng.random() < 0.5 else frozenset(e for e in experts if rng.random() < 0.7)
        case = SelectionInput(lay, rng.randint(1, lay.num_experts), tokens, last, rng.randrange(7), None, candidates)
        for name in ("sequential", "load-aware"):
            fast = policy._vectorised(name, case)
            with monkeypatch.context() as m:
                m.setattr(policy, "_vectorised", lambda *_: None)
                reference = select_experts(name, case)
            if fast is not None:
                decided += 1
                assert fast == reference, (name, case)
            assert select_experts(name, case) == reference
    assert decided > 400, f"the vectorised path decided only {decided} of 800 selections"
    # The common save, sequential round-robin over experts that all have a version, never declines.
    for ep, per_rank, k, index in itertools.product([1, 2, 4, 8], [1, 3, 8], range(1, 9), range(5)):
        lay = layout(num_layers=5, num_experts=ep * per_rank, ep=ep)
        if k <= lay.num_experts:
            assert policy._vectorised("sequential", inp(lay, k, index=index)) is not None, (ep, per_rank, k, index)


def test_per_expert_arrays_choose_what_dicts_choose(monkeypatch):
    """A save passes its per-expert state as arrays laid out in the layout's order (``ExpertValues``),
    which ``_vectorised`` and ``select_two_level`` read without a Python call per expert; on random
    states every policy picks, at one and at two levels, exactly what it picks from plain dicts."""
    from megatron_pec.pec import policy
    from megatron_pec.pec.expert_values import ExpertValues

    rng = random.Random(11)
    decided = []
    two_level = policy._two_level_vectorised
    monkeypatch.setattr(policy, "_two_level_vectorised", lambda *a: decided.append(two_level(*a)) or decided[-1])
    for _ in range(300):
        ep = rng.choice([1, 2, 4])
        lay = layout(num_layers=rng.randint(1, 4), num_experts=ep * rng.randint(1, 5), ep=ep)
        experts = lay.all_experts()
        levels = []
        for _level in range(2):
            last = {e: rng.randrange(5) for e in experts if rng.random() > rng.choice([0.0, 0.2, 0.8])}
            tokens = {e: rng.randrange(4) for e in experts}
            levels.append((last, tokens, rng.randrange(6)))
        snap_k = rng.randint(1, lay.num_experts)
        persist_k = rng.randint(1, snap_k)

        def inputs(as_arrays, levels=levels, ks=(snap_k, persist_k), lay=lay):
            made = []
            for (last, tokens, index), k in zip(levels, ks):
                if as_arrays:
                    last, tokens = ExpertValues.of(last, lay.order), ExpertValues.of(tokens, lay.order)
                made.append(SelectionInput(lay, k, tokens, last, index, 3 * EB * k))
            return made

        (snap_d, persist_d), (snap_a, persist_a) = inputs(False), inputs(True)
        for name in POLICIES:
            assert select_experts(name, snap_a) == select_experts(name, snap_d), name
            assert select_two_level(name, snap_a, persist_a) == select_two_level(name, snap_d, persist_d), name
    # (dicts never take the arrays' two-level path; arrays do, and decide most of the time)
    assert len(decided) == 2 * 300 and sum(x is not None for x in decided) > 450, len(decided)
