
"""The loader's agreement: two ranks as threads over in-process collectives.

A restore plans optimistically (each rank its own newest iteration and expert versions) and
agrees in one all-reduce when every rank planned the same; where they differ, every rank must end
with the same iteration and the oldest planned versions, and the ranks must still call the same
collectives. The sources are stand-ins that record what was opened: the files behind them are the
concern of the round-trip and fault tests, which run this same code over gloo.
"""

import argparse
import threading
from types import SimpleNamespace

import pytest
from conftest import checkpoints

from megatron_pec.config import PecConfig
from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
from megatron_pec.pec.state import Level, PecState
from megatron_pec.restore import loader
from megatron_pec.restore.loader import Candidates, LoadContext, Loader, Refused
from megatron_pec.restore.sources import Source, SourceError

pytestmark = pytest.mark.megatron_free

EXPERTS = (ExpertId(1, 0), ExpertId(1, 1))
TARGET = 10


class ThreadCollectives:
    """``reduce`` over ranks that are threads of this process (``start_reduce``: exchanged once its result is
    asked, as a started all-reduce completes); counts the collectives called."""

    def __init__(self, world: int):
        self.rows = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.calls = 0

    def of(self, rank: int):
        return SimpleNamespace(reduce=lambda values, op: self._reduce(rank, values, op),
                               start_reduce=lambda values, op: SimpleNamespace(
                                   result=lambda: self._reduce(rank, values, op)),
                               gather=lambda values, width: self._gather(rank, values, width))

    def _exchange(self, rank: int, values: list[int]) -> list[list[int]]:
        self.rows[rank] = list(values)
        self.barrier.wait()
        every = [list(row) for row in self.rows]
        self.barrier.wait()  # every rank has read the rows before any writes the next ones
        if rank == 0:
            self.calls += 1
        return every

    def _reduce(self, rank: int, values: list[int], op: str) -> list[int]:
        return [max(column) if op == "max" else min(column) for column in zip(*self._exchange(rank, values))]

    def _gather(self, rank: int, values: list[int], width: int) -> list[list[int]]:
        return self._exchange(rank, values + [-1] * (width - len(values)))


class RecordingSource(Source):
    corrupt = False
    fetched = 0  # times the loader asked it to fetch its file ahead

    def open(self, storage, items=None, read_later=False):
        if self.corrupt:
            raise SourceError(f"{self.where} fails its checksum")
        self.opened = getattr(self, "opened", set()) | set(items or self.items)

    def fetch_ahead(self, storage):
        self.fetched += 1


def memory_slot(iteration: int, versions: dict[ExpertId, int]) -> RecordingSource:
    items = {NON_EXPERT: iteration, **{item_name(x): v for x, v in versions.items()}}
    pec = PecState(Level(2), Level(1)).dumps()
    header = SimpleNamespace(pec=pec, tokens={item_name(x): 0 for x in versions})
    return RecordingSource("memory", iteration, items, f"slot@{iteration}", {}, header=header)


def on_two_ranks(tmp_path, work, collectives=None):
    """``work(loader)`` on two ranks (threads), each with its own Loader; (results, collectives called)."""
    collectives = collectives or ThreadCollectives(2)
    config = PecConfig.from_args(argparse.Namespace(save=None, load=str(tmp_path), pec_job_id="j"))
    results, failures = {}, []

    def rank_main(rank):
        job = SimpleNamespace(rank=rank, node_dir=str(tmp_path), fingerprint="f", topology={}, layout=None,
                              held_names={x: item_name(x) for x in EXPERTS}, all_experts=EXPERTS,
                              expert_layout=SimpleNamespace(num_experts=2))
        ctx = LoadContext(job=job, config=config, collectives=collectives.of(rank), slice_items={})
        try:
            results[rank] = work(Loader(ctx, checkpoints(tmp_path)))
        except BaseException as exc:  # reported by the test below
            failures.append(exc)
            collectives.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    return results, collectives.calls


def plan_on_two_ranks(tmp_path, slots_of_rank: dict[int, list[RecordingSource]]):
    """Each rank's (plan, error, agreement) from ``Loader._plan``, and the number of collectives."""
    return on_two_ranks(tmp_path, lambda ld: ld._plan(TARGET, Candidates(slots_of_rank[ld.rank], {}, {})))


def planned_until_one_sticks(ld: Loader):
    """What the engine's fallback loop asks of the loader (``Restore.run``, without applying):
    (the plan that stuck, the refusals before it)."""
    found, excluded, refused = ld.candidates(), set(), []
    while isinstance(plan := ld.plan(found, excluded), Refused):
        refused.append(plan)
        excluded.add(plan.iteration)
    return plan, refused


def load_on_two_ranks(tmp_path, monkeypatch, slots_of_rank: dict[int, list[RecordingSource]]):
    """Each rank's ((iteration, versions) that ``Loader.plan`` decided on, its refusals before), and the
    number of collectives."""
    monkeypatch.setattr(loader, "memory_sources", lambda node_dir, rank, *_: slots_of_rank[rank])
    monkeypatch.setattr(Loader, "_decide", lambda self, target, plan, *_: (target, versions(plan)))
    return on_two_ranks(tmp_path, planned_until_one_sticks)


def versions(plan) -> dict[str, int]:
    return {item: source.items[item] for item, source in plan.items()}


def test_ranks_that_planned_the_same_versions_agree_in_one_collective(tmp_path):
    same = {ExpertId(1, 0): 10, ExpertId(1, 1): 8}
    results, calls = plan_on_two_ranks(tmp_path, {r: [memory_slot(TARGET, same)] for r in (0, 1)})
    assert calls == 1
    for plan, error, agreed in results.values():
        assert error is None and agreed.every_rank_can and agreed.state is not None
        assert versions(plan) == {NON_EXPERT: 10, "L1.E0": 10, "L1.E1": 8}


def test_ranks_that_planned_different_versions_all_take_the_oldest(tmp_path):
    """Rank 1 also holds a newer snapshot of expert L1.E1 (iteration 10 carried it, rank 0's did
    not): both must restore L1.E1 from its version 8, from rank 1's slot that holds it."""
    rank0 = [memory_slot(TARGET, {ExpertId(1, 0): 10, ExpertId(1, 1): 8})]
    rank1_newest = memory_slot(TARGET, {ExpertId(1, 0): 10, ExpertId(1, 1): 10})
    rank1_older = memory_slot(8, {ExpertId(1, 0): 8, ExpertId(1, 1): 8})
    results, calls = plan_on_two_ranks(tmp_path, {0: rank0, 1: [rank1_newest, rank1_older]})
    assert calls == 3  # the optimistic all-reduce, then the fallback flags and the final plan's
    for plan, error, agreed in results.values():
        assert error is None and agreed.every_rank_can
        assert versions(plan) == {NON_EXPERT: 10, "L1.E0": 10, "L1.E1": 8}
    plan1 = results[1][0]
    assert plan1["L1.E1"] is rank1_older and "L1.E1" in rank1_older.opened


def test_an_expert_no_rank_can_restore_fails_the_plan_on_every_rank(tmp_path):
    rank0 = [memory_slot(TARGET, {ExpertId(1, 0): 10})]
    rank1 = [memory_slot(TARGET, {ExpertId(1, 0): 10})]
    results, calls = plan_on_two_ranks(tmp_path, {0: rank0, 1: rank1})
    assert calls == 1
    for _, error, agreed in results.values():
        assert "no saved version of L1.E1" in error and agreed.same_iteration and not agreed.every_rank_can


def test_ranks_with_the_same_newest_iteration_agree_on_it_in_one_collective(tmp_path, monkeypatch):
    experts = {ExpertId(1, 0): 10, ExpertId(1, 1): 10}
    results, calls = load_on_two_ranks(tmp_path, monkeypatch, {r: [memory_slot(10, experts)] for r in (0, 1)})
    assert calls == 1
    assert results[0] == results[1] == ((10, {NON_EXPERT: 10, "L1.E0": 10, "L1.E1": 10}), [])


def test_ranks_with_different_newest_iterations_agree_on_the_newest_common_one(tmp_path, monkeypatch):
    """Rank 0 holds a snapshot of 12 that rank 1 never completed: both restore 10."""
    older = {ExpertId(1, 0): 10, ExpertId(1, 1): 10}
    newer = {ExpertId(1, 0): 12, ExpertId(1, 1): 12}
    slots = {0: [memory_slot(12, newer), memory_slot(10, older)], 1: [memory_slot(10, older)]}
    results, calls = load_on_two_ranks(tmp_path, monkeypatch, slots)
    assert calls == 3  # the optimistic all-reduce, the iterations' all-gather, the plan's all-reduce
    assert results[0] == results[1] == ((10, {NON_EXPERT: 10, "L1.E0": 10, "L1.E1": 10}), [])


def test_a_rank_that_cannot_read_the_agreed_iteration_makes_every_rank_fall_back(tmp_path, monkeypatch):
    """Every rank hears that iteration 10 is refused (rank 1 why), and the plan after excluding it is 8."""
    experts = {ExpertId(1, 0): 8, ExpertId(1, 1): 8}
    corrupt = memory_slot(10, {ExpertId(1, 0): 10, ExpertId(1, 1): 10})
    corrupt.corrupt = True
    slots = {0: [memory_slot(10, {ExpertId(1, 0): 10, ExpertId(1, 1): 10}), memory_slot(8, experts)],
             1: [corrupt, memory_slot(8, experts)]}
    results, _ = load_on_two_ranks(tmp_path, monkeypatch, slots)
    assert results[0][0] == results[1][0] == (8, {NON_EXPERT: 8, "L1.E0": 8, "L1.E1": 8})
    assert results[0][1] == [Refused(10, None)]
    assert results[1][1] == [Refused(10, "slot@10 fails its checksum")]
    # only the plan every rank agreed on is fetched ahead, each source once
    assert [s.fetched for r in (0, 1) for s in slots[r]] == [0, 1, 0, 1]


def test_the_decisions_own_part_is_made_while_the_ranks_vote(tmp_path, monkeypatch):
    """What deciding needs of no other rank (the tensors, versions, small state: ``Loader._prepare``) is made
    once, between starting the plan's all-reduce and awaiting it, and the decision takes it from there."""
    from megatron_pec.restore.loader import Prepared

    events = []
    collectives = ThreadCollectives(2)
    exchange = collectives._exchange
    monkeypatch.setattr(collectives, "_exchange", lambda rank, values: events.append((rank, "vote")) or
                        exchange(rank, values))
    monkeypatch.setattr(Loader, "_prepare", lambda self, plan: events.append((self.rank, "prepare")) or Prepared(
        {}, {}, [], versions(plan), {}, None))
    experts = {ExpertId(1, 0): 10, ExpertId(1, 1): 10}
    slots = {r: [memory_slot(10, experts)] for r in (0, 1)}
    monkeypatch.setattr(loader, "memory_sources", lambda node_dir, rank, *_: slots[rank])
    monkeypatch.setattr(loader, "account", lambda *a: (None, None, {}))
    results, calls = on_two_ranks(tmp_path, planned_until_one_sticks, collectives)
    assert calls == 1
    for rank in (0, 1):
        plan, refused = results[rank]
        assert not refused and plan.iteration == 10 and plan.versions == {NON_EXPERT: 10, "L1.E0": 10, "L1.E1": 10}
        assert [e for r, e in events if r == rank] == ["prepare", "vote"]  # (made once, before the vote's wait)


def test_a_rank_whose_decision_fails_while_the_ranks_vote_still_votes_and_says_why_after(tmp_path, monkeypatch):
    """A decision that fails on one rank (a slot whose tensors this run lacks) must not keep that rank from the
    all-reduce (the others would wait for it): it votes, then raises the error, made anew, after the vote."""
    experts = {ExpertId(1, 0): 10, ExpertId(1, 1): 10}
    slots = {r: [memory_slot(10, experts)] for r in (0, 1)}
    for (slot,) in slots.values():
        slot.header.small = ""  # (decoded by the stand-in below)
    prepare = Loader._prepare

    def failing(self, plan):
        if self.rank == 1:
            raise SourceError("slot@10 lacks 3 tensors this run needs")
        return prepare(self, plan)

    monkeypatch.setattr(Loader, "_prepare", failing)
    monkeypatch.setattr(loader, "memory_sources", lambda node_dir, rank, *_: slots[rank])
    monkeypatch.setattr(loader, "account", lambda *a: (None, None, {}))
    monkeypatch.setattr(loader.SmallState, "loads", staticmethod(lambda text: None))
    collectives = ThreadCollectives(2)
    outcome = {}

    def plan_or_error(ld):
        try:
            return planned_until_one_sticks(ld)
        except SourceError as exc:
            outcome[ld.rank] = str(exc)

    results, calls = on_two_ranks(tmp_path, plan_or_error, collectives)
    assert calls == 1, "a rank left the vote"
    assert outcome == {1: "slot@10 lacks 3 tensors this run needs"} and results[0][0].iteration == 10
