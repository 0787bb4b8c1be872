"""One save on one rank (``Save``): save steps 1-3 as named steps over its own state, and its description
for step 4; built from its parts alone (``SaveParts``), so the tests run it with stand-ins
(tests/test_save_steps.py). The steps are numbered as in docs/design.md."""

from __future__ import annotations

import dataclasses
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_pec.agent.link import ROUND_WAIT_S, SNAPSHOT_ROOM_WAIT_S, AgentLink
from megatron_pec.common import faults, log
from megatron_pec.common.collectives import Collectives
from megatron_pec.common.phases import Phases
from megatron_pec.format.item_names import NON_EXPERT, item_name
from megatron_pec.format.protocol import SlotHeader
from megatron_pec.format.small_state_record import Captured, SmallState
from megatron_pec.job_facts import JobFacts
from megatron_pec.memory.slots import SlotFiles
from megatron_pec.save.handover import PendingSnapshot
from megatron_pec.save.pec_book import PecBook
from megatron_pec.save.save_history import SaveHistory
from megatron_pec.save.stager import Stager


class SaveAdapter(Protocol):
    """What a save needs of the trainer (``megatron.adapter.MegatronAdapter``; the tests' stand-ins)."""

    ep_rank: int
    collectives: Collectives   # the save's one all-reduce
    slot_slices: list          # (``megatron.collect.Slice``) in slot order
    tokens: object             # ``take()``: this rank's token counts since the last save

    def live_views(self) -> dict[str, torch.Tensor]: ...

    def small_state(self, scheduler, iteration: int, flops: float, rng_key_prefix: str = "",
                    data_iterator=None) -> SmallState: ...

    def save_dataloader_state(self, data_iterator, iteration: int) -> None: ...


@dataclass(frozen=True)
class SaveParts:
    """What a save works with: the engine's collaborators, not the engine."""

    job: JobFacts
    job_id: str
    adapter: SaveAdapter
    book: PecBook
    history: SaveHistory
    session: AgentLink
    files: SlotFiles
    stager: Stager


class Save:
    """One save on one rank as named steps over its own state; ``take`` runs them in the one order of every
    save (lease a home slot, start the agreement, copy the dense state, plan and copy the experts / finish
    the agreement, in the order the policy allows) and ``Saver`` describes and hands over the snapshot. Changes
    only node memory (copies) and, once agreed, the PEC bookkeeping. Built from its parts alone: the tests
    run it with stand-ins (tests/test_save_steps.py)."""

    def __init__(self, parts: SaveParts, iteration: int, persistent: bool,
                 experts: tuple[frozenset, frozenset] | None = None):
        """``experts``: (snapshot, persist) experts planned already (a later round of a save in rounds)."""
        self.parts, self.iteration, self.persistent = parts, iteration, persistent
        self.phases = Phases()
        self.slot: int | None = None      # the home slot: header and dense state
        self.capacity = 0                 # experts node memory can take now (pool regions free)
        self.why_not: str | None = None   # why no snapshot is taken (None: it is)
        self.counts = None                # this rank's token counts since the last save (``TakenCounts``)
        self.vote = None                  # the agreement's all-reduce, started
        self.caps: dict[int, int] | None = None  # EP rank -> experts it can take now, once agreed
        self.staging = None               # the copies, once started (``stager.Staging``)
        self.staged = None                # ... once all enqueued (``stager.StagedCopy``)
        self.agreement_pending = False    # the agreement's result is read later, by the hand-over (``take``)
        self.experts: tuple[frozenset, frozenset] | None = experts  # (snapshot, persist) experts, once planned
        self.placement: dict[str, int] = {}  # item -> the slot it was copied into
        self.in_rounds = False            # persisted, more experts than node memory takes at once (``Saver``)

    def lease(self) -> None:
        with self.phases("slot"):
            self.slot, self.why_not = self.parts.session.lease(self.persistent)
            self.capacity = self.parts.session.capacity() if self.slot is not None else 0

    def await_capacity(self, least: int = 1, timeout: float = ROUND_WAIT_S) -> None:
        """A later round of a save in rounds, or a snapshot under a budget: the regions it needs may still
        be read by the agent (a replica push or a persist); wait for ``least`` to be handed back."""
        if self.slot is not None and self.capacity < least:
            self.capacity = self.parts.session.await_capacity(least, timeout)

    def start_agreement(self, later: bool = False) -> None:
        """The save's one collective: a SUM all-reduce of token counts, "cannot snapshot" flags and what
        each rank's node memory can take. ``later``: the counts are taken now (on a GPU they travel to the
        host meanwhile) and the all-reduce starts where its result is awaited (``agree``: on the hand-over
        thread, where the plan needs no counts)."""
        with self.phases("agreement"):
            self.counts = self.parts.adapter.tokens.take()
            if not later:
                self._start_reduce()

    def _start_reduce(self) -> None:
        parts = self.parts
        values = parts.book.agreement_values(self.counts.wait(), self.slot is not None, self.capacity)
        self.vote = parts.adapter.collectives.start_reduce(values, "sum")

    def agree(self) -> None:
        # (on the hand-over thread untimed: ``phases`` are the training thread's, read once a save returns)
        with nullcontext() if self.agreement_pending else self.phases("agreement"):
            if self.vote is None:  # (every rank makes the same one all-reduce per save, here or on its thread)
                self._start_reduce()
            everyone_can, caps = self.parts.book.agreed(self.vote.reduced())
            self.caps = dict(enumerate(caps))
        if not everyone_can and self.why_not is None:
            self.why_not = "another rank cannot snapshot (see its warning)"
        if self.experts is not None and self.why_not is None and not self.persistent:
            self._keep_within(self.caps)

    @property
    def writes_every_expert(self) -> bool:
        """The agreed plan writes every expert of the model (the same on every rank)."""
        layout = self.parts.job.expert_layout
        return layout is None or len(self.experts[0]) == len(layout.all_experts())

    def plan_all(self) -> None:
        """Every expert, snapshot and persisted (a planned exit), and its copy - or, when node memory
        cannot take this rank's experts at once, none yet: the engine writes them in rounds."""
        layout = self.parts.job.expert_layout
        every = frozenset(layout.all_experts()) if layout is not None else frozenset()
        self.experts = (every, every)
        held = self.parts.job.held_items(every)
        if len(held) > self.capacity:
            self.in_rounds = True
            return
        self.copy(held)

    def plan(self) -> None:
        """Which experts this save writes (nothing changes yet: it may still be skipped), and their copy. A
        persistent save of an iteration this process restored or persisted writes every expert: its commit
        replaces the earlier one's, whose experts at that iteration it would otherwise drop. Before the
        agreement (a plan without token counts) it keeps within what this rank's memory can take; the
        agreement then drops what another rank's cannot (the same experts on every rank)."""
        if self.slot is None or self.why_not is not None:
            return
        parts = self.parts
        if self.persistent and parts.history.writes_every_expert(self.iteration):
            self.plan_all()
            return
        with self.phases("plan"):
            experts = parts.book.plan(self.persistent)
            if self.persistent:  # (what it persists is what it planned: in rounds where memory is short)
                self.experts = experts
            else:  # a memory snapshot takes what memory holds now (lost work on a crash: its PLT)
                mine = {self.parts.adapter.ep_rank: self.capacity}
                self.experts = parts.book.within(experts, self.caps if self.caps is not None else mine)
            items = parts.job.held_items(self.experts[0])
        if self.persistent and len(items) > self.capacity:
            self.in_rounds = True
            return
        self.copy(items)

    def _keep_within(self, caps: dict[int, int]) -> None:
        """The agreed caps, after a plan made before them: what they drop was copied for nothing, and
        its regions hold nothing."""
        kept = self.parts.book.within(self.experts, caps)
        if kept == self.experts:
            return
        # (it may happen at every save while a persist reads the regions: said once, not per iteration)
        log.info("a save took fewer experts than planned: node memory had no free region for the rest (being "
                 "persisted or sent to a peer); they keep their older versions until a later save takes them",
                 once=True, rank0=True)
        dropped = self.parts.job.held_items(self.experts[0] - kept[0])
        wasted = {item: slot for item, slot in self.placement.items() if item in dropped}
        self.parts.session.skipped(wasted)
        self.placement = {item: slot for item, slot in self.placement.items() if item not in dropped}
        self.staging.drop(wasted)
        self.experts = kept

    def take(self, every_expert: bool, room: int = 0, agree_later: bool = False) -> None:
        """Save steps 1-3, the one order of every save: lease a home slot; start the agreement (an ordinary
        save: its one collective); copy the dense state, which every plan writes, while the all-reduce runs;
        plan the experts and copy them, before the agreement's result where the plan reads no token counts
        (the all-reduce brings them), after it otherwise. ``every_expert``: a planned exit's save, every
        expert and no collective (every rank does the same, so the PEC bookkeeping stays identical);
        ``room``: the experts a snapshot's implied K writes under a budget (``await_snapshot_room``);
        ``agree_later``: where the plan came first and is written whole, leave the agreement's result to the
        hand-over thread (``agreement_pending``): the training thread never waits for the slowest rank."""
        agree_later = agree_later and self.parts.book.plans_without_counts
        self.lease()
        if not every_expert:
            self.await_snapshot_room(room)
            self.start_agreement(later=agree_later)
        self.copy({NON_EXPERT})
        if every_expert:
            self.plan_all()
        elif self.parts.book.plans_without_counts:
            self.plan()
            self.agreement_pending = agree_later and not self.in_rounds
            if not self.agreement_pending:
                self.agree()
        else:
            self.agree()
            self.plan()

    def finish(self):
        """Every copy enqueued: the ``StagedCopy`` (None: nothing was copied)."""
        if self.staged is None and self.staging is not None:
            self.staged = self.staging.finish()
        return self.staged

    def await_snapshot_room(self, need: int) -> None:
        """Under a budget a snapshot takes the experts its implied K promises: where a persist or a push
        still reads the regions it needs (the spares are exactly what one snapshot writes), it waits for
        them to be handed back - one persist at most - rather than keep experts at older versions (the
        PLT of a crash would be a smaller K's)."""
        if self.slot is None or self.capacity >= need:
            return
        started = time.monotonic()
        with self.phases("slot"):
            self.await_capacity(need, SNAPSHOT_ROOM_WAIT_S)
        log.info(f"the snapshot of iteration {self.iteration} waited {time.monotonic() - started:.3f} s for the node "
                 "agent to hand back regions a persist or push was reading (--pec-node-memory leaves spares for one "
                 "snapshot's experts)", rank=self.parts.job.rank)

    def write_in_rounds(self, handover, small: Captured, generation: str, items: list[str]) -> bool:
        """A persistent save whose experts node memory cannot take at once (every expert at a planned
        exit, or a first persist of every expert, into a pool with spares for a partial snapshot): rounds
        of memory-only snapshots of its iteration, each of as many of its experts as the pool has regions
        free and recorded before the next (their older versions are then free, once the agent's pushes
        and persists of the last round hand them back: one persist at most, ``AgentLink.await_capacity``),
        and a last one, persisted, whose header names every item it wrote and where. No collective: the PEC
        bookkeeping records the save's plan once, as on every rank. False (warned) when node memory frees no
        region (a budget admits none where that can happen: ``budget.least_spares``)."""
        planned = self.parts.job.held_items(self.experts[0])
        remaining = [item for item in items if item in planned]
        known: dict[str, str] = {}     # item -> checksum, of the experts earlier rounds wrote
        elsewhere: dict[str, int] = {}  # item -> the region they wrote it to
        current, rounds, waited = self, 1, 0.0  # (waited: for the agent to record a round and free regions)
        while True:
            take = remaining[:current.capacity]
            current.copy(set(take))
            remaining = remaining[len(take):]
            if not remaining:
                handover.submit(current.describe_whole(small, generation, self.persistent, known, elsewhere))
                log.info(f"persistent save of iteration {self.iteration}: {len(planned)} experts through node memory "
                         f"in {rounds} rounds; training waited {waited:.3f} s in all for the node agent to record "
                         "each round and hand its regions back (at most one persist per round)", rank0=True)
                return True
            part = current.describe_part(small)
            handover.submit(part)
            handover.wait()
            started = time.monotonic()
            self.parts.session.settle()
            known.update({item: value for item, value in part.staged.sums().items() if item != NON_EXPERT})
            elsewhere.update({item: slot for item, slot in part.placement.items() if item != NON_EXPERT})
            current = Save(self.parts, self.iteration, persistent=True, experts=self.experts)
            current.lease()
            if current.slot is not None:
                waited += time.monotonic() - started
                current.copy({NON_EXPERT})
                started = time.monotonic()
                current.await_capacity()
            waited += time.monotonic() - started
            rounds += 1
            if current.slot is None or not current.capacity:
                log.warning(f"cannot save every planned expert of iteration {self.iteration}: node memory frees no "
                            f"region for the {len(remaining)} left ({current.why_not or 'every region held'}); the "
                            "restart restores them from their newest saved versions", rank=self.parts.job.rank)
                if current.slot is not None:
                    self.parts.session.skipped(current.placement)
                return False

    def copy(self, items: set[str]) -> None:
        if self.slot is None or not items:
            return
        parts = self.parts
        with self.phases("copy"):
            first = self.staging is None
            if first:
                self.staging = parts.stager.begin(parts.adapter.live_views())
                faults.point("snapshot_begin", iteration=self.iteration)
                parts.files.invalidate(self.slot)
            placement = parts.session.place(self.slot, items)
            parts.session.writing(self.iteration, placement)
            self.staging.copy(placement)
            self.placement.update(placement)
            if first:
                faults.point("snapshot_mid", iteration=self.iteration)

    def describe(self, small: Captured, generation: str) -> PendingSnapshot:
        """Record the save in the PEC bookkeeping and describe the snapshot (its slot header, whose small
        state the hand-over encodes; ``generation``: a persistent save's, ``manifest``)."""
        parts, job = self.parts, self.parts.job
        snapshot, persist = self.experts
        parts.book.record(snapshot, persist, self.iteration, self.persistent)
        tokens, pec = parts.book.header_columns()
        header = SlotHeader(
            job_id=parts.job_id, fingerprint=job.fingerprint, save=job.save_root, rank=job.rank,
            world_size=job.world_size, iteration=self.iteration,
            items=dict.fromkeys(sorted(self.placement), self.iteration), tokens=tokens, small="",
            pec=pec, run=parts.session.run)
        persist_items = sorted(item_name(e) for e in persist) if self.persistent and job.expert_layout else None
        return PendingSnapshot(self.slot, self.iteration, self.persistent, persist_items, dict(self.placement),
                               header, small, self.finish(), generation)

    def describe_part(self, small: Captured) -> PendingSnapshot:
        """A round of a save of every expert in rounds: a memory-only snapshot of what it wrote (the PEC
        bookkeeping records the whole save, once, with the last round)."""
        parts, job = self.parts, self.parts.job
        tokens, pec = parts.book.header_columns()
        header = SlotHeader(
            job_id=parts.job_id, fingerprint=job.fingerprint, save=job.save_root, rank=job.rank,
            world_size=job.world_size, iteration=self.iteration,
            items=dict.fromkeys(sorted(self.placement), self.iteration), tokens=tokens, small="", pec=pec,
            run=parts.session.run)
        return PendingSnapshot(self.slot, self.iteration, False, None, dict(self.placement), header, small,
                               self.finish())

    def describe_whole(self, small: Captured, generation: str, persistent: bool, known: dict[str, str],
                       elsewhere: dict[str, int]) -> PendingSnapshot:
        """The last round: the snapshot of every item, those of earlier rounds where they wrote them (``known``:
        their checksums), persisted if the save is."""
        self.persistent = persistent
        self.placement = {**elsewhere, **self.placement}
        pending = self.describe(small, generation)
        return dataclasses.replace(pending, known_sums=dict(known))
