"""The modules that ran only end to end, on their own - the job facts a trainer works out
at start-up (``job_facts.py``), its PEC bookkeeping from save to save (``save/pec_book.py``) and the hand-over
thread that completes each snapshot (``save/handover.py``). One rank, stand-ins for Megatron's adapter and
its collectives: no model, no process group, no node agent."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_pec.config import PecConfig
from megatron_pec.format.item_names import ExpertId
from megatron_pec.job_facts import JobFacts
from megatron_pec.save.handover import HandOver
from megatron_pec.save.pec_book import PecBook

pytestmark = pytest.mark.megatron_free

LAYERS, EXPERTS = (2, 4), 4  # two MoE layers (global numbers) of four experts


class OneRank:
    """The collectives of a job of one rank: a gather is this rank's row, a reduction its own values."""

    def gather(self, row, width):
        return [list(row)]

    def reduce(self, values, op):
        return list(values)


def adapter(ep_size=1):
    held = [ExpertId(layer, e) for layer in LAYERS for e in range(EXPERTS // ep_size)]
    return SimpleNamespace(collectives=OneRank(), rank=0, world_size=1, local_fingerprint="0123456789abcdef",
                           moe_layers=list(LAYERS), num_experts=EXPERTS, ep_size=ep_size, ep_rank=0, pp_rank=0,
                           experts_held=held, topology={"dp": 1}, token_replicas=1, expert_bytes=lambda: 1000,
                           layout_record=lambda fingerprint: None)


def config(**flags) -> PecConfig:
    return PecConfig.from_args(SimpleNamespace(save=None, **flags), {})


def test_the_job_facts_lay_out_every_expert_and_where_this_ranks_token_counts_go():
    job = JobFacts.build(config(), adapter())
    assert job.all_experts == tuple(ExpertId(layer, e) for layer in LAYERS for e in range(EXPERTS))
    assert job.token_positions.tolist() == list(range(8)) and job.token_replicas == 1
    assert job.ep_groups == ((0,),) and job.num_nodes == 1 and job.replicas == 0
    assert job.held_items({ExpertId(2, 1), ExpertId(9, 0)}) == {job.held_names[ExpertId(2, 1)]}
    assert len(job.fingerprint) == 16 and job.fingerprint == JobFacts.build(config(), adapter()).fingerprint
    assert job.session != JobFacts.build(config(), adapter()).session  # (each launch its own)


def test_the_book_plans_every_expert_first_then_k_per_layer_in_turn_and_records_what_a_save_wrote():
    book = PecBook(config(pec_snapshot_k=1, pec_persist_k=1), JobFacts.build(config(), adapter()))
    assert book.plans_without_counts  # (sequential: the plan may go before the agreement)
    first, persist = book.plan(persistent=False)
    assert first == frozenset(book.job.all_experts) and persist == frozenset()  # (a restore needs every expert)
    book.record(first, persist, 1, persistent=False)
    later = []
    for iteration in range(2, 6):
        snapshot, persist = book.plan(persistent=False)
        assert sorted(x.layer for x in snapshot) == list(LAYERS)  # K = 1 per layer
        book.record(snapshot, persist, iteration, persistent=False)
        later.append(snapshot)
    # round robin: four saves of one expert per layer wrote every expert once more
    assert sorted(x for s in later for x in s) == sorted(book.job.all_experts)
    assert set(book.state.snapshot.saved_at.values()) == {2, 3, 4, 5}
    snapshot, persist = book.plan(persistent=True)
    assert persist <= snapshot and len(persist) == 8  # (the persisted level has no expert yet: every one)


def test_the_agreement_sums_token_counts_flags_and_capacities_into_the_books_counts():
    job = JobFacts.build(config(), adapter())
    book = PecBook(config(), job)
    tokens = torch.arange(8, dtype=torch.int64).reshape(2, 4)  # (a TokenCounter's rows: one per layer)
    values = book.agreement_values(tokens, can_snapshot=True, capacity=5)
    assert values.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 5]  # counts, "cannot" flag, this rank's capacity
    everyone_can, caps = book.agreed(values)  # (one rank: the all-reduce's sum is its own values)
    assert everyone_can and caps == [5]
    assert book.cumulative[ExpertId(4, 3)] == 7
    assert book.agreed(book.agreement_values(tokens, can_snapshot=False, capacity=0)) == (False, [0])
    assert book.cumulative[ExpertId(4, 3)] == 14  # (cumulative)


def test_caps_drop_experts_not_persisted_first_then_the_most_recently_saved():
    book = PecBook(config(), JobFacts.build(config(), adapter(ep_size=2)))
    everything = frozenset(book.job.all_experts)
    persisted = frozenset({ExpertId(2, 0), ExpertId(4, 0)})
    book.state.snapshot.saved_at.update({ExpertId(2, 1): 9, ExpertId(4, 1): 3})
    snapshot, persist = book.within((everything, persisted), {0: 2, 1: 4})
    # EP rank 0 holds experts 0-1 of each layer (4 of them): it keeps 2, the persisted ones
    assert {x for x in snapshot if x.expert < 2} == persisted and persist == persisted
    assert {x for x in snapshot if x.expert >= 2} == {x for x in everything if x.expert >= 2}  # rank 1 within its cap
    assert book.within((everything, persisted), {0: 4, 1: 4}) == (everything, persisted)


def test_a_node_memory_limit_caps_the_snapshot_k_and_a_restored_state_keeps_it():
    book = PecBook(config(), JobFacts.build(config(), adapter()))
    assert book.state.snapshot.k == EXPERTS
    book.limit_k(2)
    assert (book.state.snapshot.k, book.state.persist.k) == (2, EXPERTS)  # (persists go in rounds instead)
    restored = PecBook(config(), book.job).state
    book.adopt(restored, {ExpertId(2, 0): 11}, resharded=True)
    assert book.state.snapshot.k == 2 and book.rewrite_all and book.cumulative[ExpertId(2, 0)] == 11
    every, _ = book.plan(persistent=False)
    assert every == frozenset(book.job.all_experts)  # (after a reshard: every expert until a persist wrote them)


def test_the_hand_over_completes_snapshots_in_order_and_one_failure_loses_only_that_one():
    done, release = [], threading.Event()

    def complete(pending):
        release.wait(5)
        if pending.iteration == 2:
            raise OSError("node memory full")
        done.append(pending.iteration)

    handover = HandOver(complete)
    waited = []
    for iteration in (1, 2, 3):
        handover.submit(SimpleNamespace(iteration=iteration, staged=SimpleNamespace(wait=lambda: waited.append(1))))
    assert done == []  # (completed off the caller's thread, not before the copies allow)
    release.set()
    handover.before_step(None)  # (CPU ranks: the next optimizer step waits for the hand-over itself)
    assert done == [1, 3] and len(waited) == 3


def test_a_plan_made_ahead_is_taken_for_the_state_it_was_made_for_and_no_other():
    """The hand-over thread plans the next save once a save is recorded, of the kind the last one was
    (sequential: no token counts read), so the training thread's next save does not: it takes that plan,
    unless the state changed since (another save recorded, a restore) or the save is of the other kind."""
    book = PecBook(config(pec_snapshot_k=1, pec_persist_k=1), JobFacts.build(config(), adapter()))
    first, persist = book.plan(persistent=False)
    book.record(first, persist, 1, persistent=False)
    expected = book._plan(False)
    planned, plan = [], book._plan
    book._plan = lambda persistent: (planned.append(persistent), plan(persistent))[1]
    book.plan_ahead(persistent=False)
    assert planned == [False]  # (here, on the hand-over thread)
    assert book.plan(persistent=False) == expected and planned == [False]  # taken, not planned again
    book.plan_ahead(persistent=False)
    book.record(*expected, 2, persistent=False)  # the state moved on: the plan made ahead is stale
    fresh = book.plan(persistent=False)
    assert planned == [False] * 3 and fresh != expected and sorted(x.layer for x in fresh[0]) == list(LAYERS)
    book.plan_ahead(persistent=False)
    assert book.plan(persistent=True) == plan(True) and planned == [False] * 4 + [True]  # the other kind
    book.plan_ahead(persistent=True)
    assert book.plan(persistent=True) == plan(True) and planned == [False] * 4 + [True] * 2  # taken
    book.plan_ahead(persistent=False)
    book.adopt(book.state, {}, resharded=False)  # a restore: nothing made before it is taken
    book.plan(persistent=False)
    assert planned[-2:] == [False, False]
