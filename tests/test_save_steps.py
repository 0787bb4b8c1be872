"""A save's steps (``save.Save``) and a trainer's saves (``saver.Saver``) built from their parts alone, with
stand-ins for the node agent's session, the stager, the PEC bookkeeping and Megatron: no ``Engine``, no
agent process, no model. The order of the steps, a skipped save, the agreed caps dropping what was copied
for nothing, the agreement's result read by the hand-over thread, and a planned exit's save of every
expert in rounds."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron_pec.common.collectives import Collectives
from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
from megatron_pec.format.small_state_record import Captured, SmallState
from megatron_pec.save.handover import HandOver
from megatron_pec.save.save import Save, SaveParts
from megatron_pec.save.save_history import SaveHistory
from megatron_pec.save.saver import Saver
from megatron_pec.testing import launch

pytestmark = pytest.mark.megatron_free

EXPERTS = [ExpertId(1, e) for e in range(5)]
ITEMS = [item_name(e) for e in EXPERTS]


def small_state_at(iteration: int) -> SmallState:
    return SmallState(iteration=iteration, optimizer=None, scheduler=None, rng={},
                      num_floating_point_operations_so_far=0.0, consumed_train_samples=0,
                      skipped_train_samples=0, consumed_valid_samples=0)


class Session:
    """The trainer's side of the node agent: a home slot, ``free`` pool regions per round."""

    def __init__(self, log, free=(8,), slot=1, why_not=None):
        self.log, self.free, self.slot, self.why_not = log, list(free), slot, why_not
        self.round, self.next_region, self.run = 0, 100, "timeline"

    def lease(self, persistent):
        self.log.append("lease")
        return (self.slot, None) if self.why_not is None else (None, self.why_not)

    def capacity(self):
        return self.free[min(self.round, len(self.free) - 1)]

    def await_capacity(self, least, timeout):
        return self.capacity()

    def place(self, home, items):
        placement = {}
        for item in sorted(items):
            placement[item] = home if item == NON_EXPERT else self.next_region
            self.next_region += item != NON_EXPERT
        return placement

    def writing(self, iteration, placement):
        pass

    def skipped(self, placement):
        self.log.append(("skipped", sorted(placement)))

    def announce(self, home, iteration, persistent, persist_items, placement, generation=""):
        self.log.append(("announced", iteration, sorted(placement)))
        return True

    def settle(self):
        self.round += 1  # (the agent recorded the round: its regions for the next)


class Staging:
    def __init__(self, log):
        self.log, self.placed = log, {}

    def copy(self, placement):
        self.log.append(("copy", sorted(placement)))
        self.placed.update(placement)

    def drop(self, placement):
        for item in placement:
            self.placed.pop(item, None)

    def finish(self):
        placed = dict(self.placed)
        return SimpleNamespace(sums=lambda: {item: f"s64:{item}" for item in placed}, wait=lambda: None)


class Book:
    """The PEC bookkeeping: plans every expert; ``caps`` what the agreement says each EP rank can take."""

    def __init__(self, log, plans_without_counts=True, everyone_can=True, caps=(8,)):
        self.log, self.plans_without_counts = log, plans_without_counts
        self.everyone_can, self.caps, self.recorded = everyone_can, list(caps), []

    def agreement_values(self, tokens, can, capacity):
        self.log.append("agreement started")
        return [can, capacity]

    def agreed(self, values):
        self.log.append("agreed")
        return self.everyone_can, self.caps

    def plan(self, persistent):
        self.log.append("plan")
        every = frozenset(EXPERTS)
        return every, every

    def within(self, experts, caps):
        keep = frozenset(sorted(experts[0])[:caps[0]])
        return keep, experts[1] & keep

    def record(self, snapshot, persist, iteration, persistent):
        self.recorded.append((iteration, len(snapshot), persistent))

    def header_columns(self):
        return {}, ""


def parts(log, session=None, book=None, reduced=None) -> SaveParts:
    """``reduced``: what waiting for the agreement's all-reduce does (default: it has the result)."""
    layout = SimpleNamespace(all_experts=lambda: EXPERTS)
    job = SimpleNamespace(held_items=lambda experts: {item_name(e) for e in experts}, expert_layout=layout,
                          fingerprint="f", save_root="/ck", rank=0, world_size=1)
    def result(values):
        if reduced is not None:
            reduced()
        return values

    collectives = SimpleNamespace(start_reduce=lambda values, op: SimpleNamespace(reduced=lambda: result(values)))
    def counts():  # (the thread that waits for the token counts to reach the host)
        log.append(("counts awaited", threading.current_thread() is threading.main_thread()))

    adapter = SimpleNamespace(tokens=SimpleNamespace(take=lambda: SimpleNamespace(wait=counts)),
                              collectives=collectives,
                              live_views=lambda: {}, ep_rank=0, slot_slices=[],
                              small_state=lambda *args: small_state_at(args[1]),
                              save_dataloader_state=lambda iterator, iteration: None)
    stager = SimpleNamespace(begin=lambda live: Staging(log), asynchronous=False)
    files = SimpleNamespace(invalidate=lambda slot: None,
                            write_header=lambda slot, metadata: log.append(("header", slot)))
    return SaveParts(job, "job", adapter, book or Book(log), SaveHistory("launch"), session or Session(log), files,
                     stager)


def test_an_ordinary_save_runs_its_steps_in_the_one_order():
    """Lease, start the agreement, copy the dense state while it runs, then plan (and copy the experts)
    before the agreement's result where the plan needs no token counts, after it otherwise."""
    for without_counts, tail in ((True, ["plan", ("copy", ITEMS), "agreed"]),
                                 (False, ["agreed", "plan", ("copy", ITEMS)])):
        log = []
        save = Save(parts(log, book=Book(log, plans_without_counts=without_counts)), 7, persistent=False)
        save.take(every_expert=False)
        assert log == ["lease", ("counts awaited", True), "agreement started", ("copy", [NON_EXPERT]), *tail]
        assert save.why_not is None and sorted(save.placement) == sorted([NON_EXPERT, *ITEMS])
        pending = save.describe(small=None, generation="")
        assert pending.slot == 1 and pending.iteration == 7 and sorted(pending.header.items) == sorted(save.placement)


def test_a_save_another_rank_cannot_take_is_marked_skipped():
    log = []
    save = Save(parts(log, book=Book(log, everyone_can=False)), 7, persistent=False)
    save.take(every_expert=False)
    assert save.why_not == "another rank cannot snapshot (see its warning)"


def test_the_agreed_caps_drop_what_was_copied_for_nothing():
    """Planned before the agreement (no token counts), the experts another rank's memory cannot take are
    dropped after it: handed back to the agent, out of the snapshot."""
    log = []
    save = Save(parts(log, book=Book(log, caps=(2,))), 7, persistent=False)
    save.take(every_expert=False)
    assert ("skipped", ITEMS[2:]) in log
    assert sorted(save.placement) == sorted([NON_EXPERT, *ITEMS[:2]])
    assert save.staging.placed == save.placement


def test_a_planned_exits_save_goes_through_node_memory_in_rounds():
    """Every expert, no collective; node memory takes 2 experts a round: 3 rounds, the first two memory-only
    snapshots, the last persisted and naming every item where it was written, with the earlier rounds'
    checksums."""
    log = []
    session = Session(log, free=(2, 2, 2))
    save = Save(parts(log, session=session), 9, persistent=True)
    save.take(every_expert=True)
    assert "agreement started" not in log and save.in_rounds
    submitted = []
    handover = SimpleNamespace(submit=submitted.append, wait=lambda: None)
    assert save.write_in_rounds(handover, small=None, generation="g", items=[NON_EXPERT, *ITEMS])
    assert [p.persistent for p in submitted] == [False, False, True]
    last = submitted[-1]
    assert sorted(last.placement) == sorted([NON_EXPERT, *ITEMS]) and last.persist_items == sorted(ITEMS)
    assert set(last.known_sums) == set(ITEMS[:4])  # (the earlier rounds' experts, summed where they landed)
    assert save.parts.book.recorded == [(9, len(EXPERTS), True)]  # (the whole save, recorded once)


def test_a_round_without_a_free_region_is_given_up_with_a_warning():
    log = []
    save = Save(parts(log, session=Session(log, free=(2, 0))), 9, persistent=True)
    save.take(every_expert=True)
    handover = SimpleNamespace(submit=lambda pending: None, wait=lambda: None)
    assert not save.write_in_rounds(handover, small=None, generation="g", items=[NON_EXPERT, *ITEMS])


def test_the_agreements_result_is_read_by_the_hand_over_thread_not_the_training_thread():
    """A plan made before the agreement: ``Saver.save`` returns with the all-reduce still running (here it
    waits for a gate only the test opens); the hand-over thread then reads it, describes the save,
    records it in the PEC bookkeeping and the save history, writes the header and announces it."""
    log, gate = [], threading.Event()
    saver = Saver(parts(log, reduced=lambda: gate.wait(10)))
    saver.save(7, scheduler=None, flops=0.0, persistent=False)
    assert "agreed" not in log and saver.parts.book.recorded == []  # (the training thread went on)
    gate.set()
    saver.handover.wait()
    # (the token counts, on a GPU copied to the host behind the step, are awaited by the hand-over thread)
    assert ("counts awaited", True) not in log and ("counts awaited", False) in log
    assert log[-3:] == ["agreed", ("header", 1), ("announced", 7, sorted([NON_EXPERT, *ITEMS]))]
    assert saver.parts.book.recorded == [(7, len(EXPERTS), False)] and saver.stats == {"saves": 1, "skipped": 0}
    assert saver.parts.history.owed_at_exit() is None  # (it wrote every expert)


def test_a_save_the_agreement_rules_out_is_skipped_by_the_hand_over_thread():
    """Another rank could not snapshot: the copies made meanwhile were for nothing; their regions go back
    to the agent, nothing is recorded, and a clean exit still owes the iteration."""
    log = []
    saver = Saver(parts(log, book=Book(log, everyone_can=False)))
    saver.save(7, scheduler=None, flops=0.0, persistent=False)
    saver.handover.wait()
    assert ("skipped", sorted([NON_EXPERT, *ITEMS])) in log and not any(e[0] == "announced" for e in log
                                                                         if isinstance(e, tuple))
    assert saver.parts.book.recorded == [] and saver.stats == {"saves": 0, "skipped": 1}
    assert saver.parts.history.owed_at_exit() == 7
    assert isinstance(saver.parts.history.small, Captured)


@pytest.fixture
def one_rank():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{launch.free_port()}", rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_a_collective_of_the_training_thread_comes_after_the_hand_overs_agreement(one_rank):
    """Every rank must make its collectives in the same order: one the training thread makes (a load's,
    Megatron's own format check) waits for the agreement the hand-over thread still has to make; the
    hand-over's own collectives do not wait for themselves."""
    order = []
    collectives = Collectives(None)

    def complete(pending):
        time.sleep(0.2)
        collectives.reduce([1], "sum")  # (the save's agreement, on the hand-over thread: no deadlock)
        order.append("the hand-over's agreement")

    handover = HandOver(complete)
    collectives.first_wait_for(handover.wait)
    handover.submit(SimpleNamespace(iteration=1, staged=None))
    collectives.all_ok(True)
    order.append("the training thread's collective")
    assert order == ["the hand-over's agreement", "the training thread's collective"]
