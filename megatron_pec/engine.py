"""The per-process checkpoint engine: a save's steps 1-4 (lease, agree and plan, snapshot, hand over), the
planned exit's save (save step 8), and a restore's fallback loop (load steps 2, 6, 7: settle, apply the
loader's plan and check it, retire and begin); the steps are numbered as in docs/design.md.

One ``Engine`` per trainer process, built on the first ``load_checkpoint`` or ``save_checkpoint``
(collective: every rank builds it). Building it does all expensive set-up - the Megatron
adapter's slice table, the job's facts, slot files with the tmpfs preflight (pinned on a GPU),
the node agent - so that every save, including the first, only plans and copies.

Who owns what: Megatron is reached only through ``adapter``; the job's constants are ``job``;
the PEC bookkeeping is ``book``; copies are ``stager``'s; the node agent and the slot lease are
``session``'s; completing a snapshot once its copies landed is ``handover``'s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace

import torch

from megatron_pec.memory import budget
from megatron_pec.common import faults, log
from megatron_pec.save import memory_plan, rank_layout
from megatron_pec.format import small_state
from megatron_pec.agent.client import AgentUnavailable, check_socket_path
from megatron_pec.agent.session import ROUND_WAIT_S, SNAPSHOT_ROOM_WAIT_S, AgentSession
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.config import PecConfig, PecConfigError, megatron_flag_notes
from megatron_pec.common.errors import CheckpointError, StorageUnreachable
from megatron_pec.common.gcpause import without_gc
from megatron_pec.save.handover import HandOver, PendingSnapshot
from megatron_pec.format.item_names import NON_EXPERT, item_name
from megatron_pec.job_facts import JobFacts
from megatron_pec.memory.layout import MemoryLayout
from megatron_pec.restore.restore import Restore, RestoreParts
from megatron_pec.save.pec_book import PecBook
from megatron_pec.common.phases import Phases, traced
from megatron_pec.format.protocol import SlotHeader
from megatron_pec.integrity.run_sums import kernel_load
from megatron_pec.save.save_history import SaveHistory
from megatron_pec.memory.slots import SlotFiles, SlotSpaceError
from megatron_pec.save.stager import Stager
from megatron_pec.format.stformat import layout as tensor_layout
from megatron_pec.store.storage import Storage


class Engine:
    def __init__(self, args, model_chunks, optimizer, storage: Storage):
        """``storage``: what every checkpoint directory this engine saves to or loads from is read and
        written through."""
        from megatron_pec.megatron.adapter import MegatronAdapter

        try:
            self.config = PecConfig.from_args(args)
        except PecConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.adapter = MegatronAdapter(args, model_chunks, optimizer)
        self.optimizer = optimizer  # the engine serves this optimizer; api rebuilds it for another
        self.storage = storage
        log.set_rank(self.adapter.rank)
        log.info("keeps " + "; ".join(text for _, text in self.adapter.state_kinds()), rank0=True)
        for note in megatron_flag_notes(args):
            log.warning(note, rank0=True)
        self.job = JobFacts.build(self.config, self.adapter)
        self.rank = self.job.rank
        self.book = PecBook(self.config, self.job)
        items = list(dict.fromkeys(s.item for s in self.adapter.slot_slices))  # (slot order)
        hello = self.job.hello(self.config, storage.spec)  # the agent rebuilds the job's storage from it
        self.session = AgentSession(self.job.node_dir, self.rank, self.job.node_rank, hello,
                                    items, idle_timeout=self.config.agent_idle_timeout,
                                    keep_shm=self.config.keep_shm, wait_for_slot=self.config.wait_for_slot)
        self.files: SlotFiles | None = None
        self.memory_plan: budget.MemoryPlan | None = None
        self.snapshot_need = 0  # under a budget: the experts one snapshot at its implied K writes
        self.stager: Stager | None = None
        self.stats = {"saves": 0, "skipped": 0}
        self.save_phases = Phases()     # where the latest save's time went (benchmarks read them)
        self.restore_phases = Phases()  # ... and the latest restore's
        self.history = SaveHistory(self.job.session)
        # A restore from node memory checks its bytes where they land: on the GPU (a test hook runs the same
        # path on CPU ranks; else they are checked in node memory, before the copy).
        self.check_on_device = torch.cuda.is_available() or self.config.check_on_device
        self.handover = HandOver(self._complete)
        self.adapter.before_each_step(self._before_step)
        if self.config.save:
            self._record_layout()
            self._start_memory_tier()
            self._warm = False
            self.adapter.after_each_step(self._warm_up)

    # ---- set-up --------------------------------------------------------------------------------------
    def _record_layout(self) -> None:
        """Where this rank's stored tensors lie in the global parameters, once per configuration under
        --save (``save/rank_layout.py``): every rank stops where --save cannot be written."""
        error = rank_layout.record(CheckpointDir(self.job.save_root, self.storage), self.job.layout)
        self.adapter.collectives.raise_if_any(error)

    def _start_memory_tier(self) -> None:
        # The checksum kernel compiles and loads in a thread started when the trainer imported megatron-pec
        # (``run_sums.preload``; here where it did not): neither the first save nor a restore compiles; a Triton
        # that cannot compile falls back to stock operations, with one log line, never in a training step.
        kernel = kernel_load(torch.cuda.current_device()) if torch.cuda.is_available() else None
        entries = tensor_layout([(s.name, s.dtype, s.numel) for s in self.adapter.slot_slices])
        # (several nodes, no replicas: the agent keeps the newest committed dense state for survivors)
        layout = MemoryLayout.of(entries, 0, homes=3 if self.job.num_nodes > 1 and not self.job.replicas else 2)
        reserve = memory_plan.header_reserve(self.job, self.adapter.small_state_bound())
        asked = self.book.state.snapshot.k if self.job.expert_layout else 1
        plan, error = memory_plan.plan(self.job, self.config, self.adapter.collectives, layout, asked,
                                     self.adapter.ep_rank, reserve)
        self.adapter.collectives.raise_if_any(error)
        # Every rank takes the same snapshot K (the PEC bookkeeping is identical everywhere): the least any
        # rank's node memory holds.
        (k,) = self.adapter.collectives.reduce([plan.k], "min")
        if k < plan.asked_k:  # (a budget's K is a limit; without one, Dynamic-K may raise K beyond the spares)
            self.book.limit_k(k)
            log.warning(f"the node memory budget holds snapshot-K {k} per layer, not the asked {plan.asked_k}: "
                        f"snapshots save {k} experts per layer, persistent saves still the asked persist-K, "
                        "through node memory in rounds (raise --pec-node-memory to "
                        f"{plan.needed_for_asked * self.job.local_world_size / 2**30:.2f} GiB for K={plan.asked_k})",
                        rank0=True, once=True)
        if self.config.node_memory is not None:
            self.snapshot_need = budget.per_snapshot(self.job.expert_layout, self.config.selection, k,
                                                     self.adapter.ep_rank, len(layout.experts))
        error = None
        try:
            check_socket_path(self.job.node_dir)
            self.files = SlotFiles(self.job.node_dir, self.rank, replace(layout, regions=plan.regions),
                                   self.job.local_world_size, plan.replica_share, reserve=reserve)
            self.memory_plan = replace(plan, regions=self.files.layout.regions)
            memory_plan.report(self.memory_plan, self.job, torch.cuda.is_available())
            self.session.use_pool(self.files.layout.regions, self.files.layout.homes)
            self.stager = Stager(self.files, self.adapter.slot_slices, self.rank, kernel=kernel,
                                 kernel_copies=False if self.config.copy_engine else None,
                                 copy_programs=self.config.copy_programs)
            self.stager.pin()
            self.session.start()
        except (SlotSpaceError, AgentUnavailable) as exc:
            error = str(exc)
        self.adapter.collectives.raise_if_any(error)

    @property
    def parts(self) -> SaveParts:
        return SaveParts(self.job, self.config.job_id, self.adapter, self.book, self.history, self.session,
                         self.files, self.stager)

    def _warm_up(self) -> None:
        """Once the optimizer has state (after its first step): bind the live views (the moments placed
        contiguously) and build every slot's copy plan, so that the first save costs what later ones do."""
        if self._warm or self.stager is None or not self.adapter.has_state:
            return
        self._warm = True
        self.stager.prepare(self.adapter.live_views())  # (the kernel itself was compiled at start-up)

    # ---- save ----------------------------------------------------------------------------------------
    @without_gc
    def save(self, iteration: int, scheduler, flops: float, persistent: bool, rng_key_prefix: str = "",
             data_iterator=None) -> None:
        """Save steps 1-4: every rank snapshots or none does (the PEC bookkeeping must stay identical).
        ``data_iterator``: the trainer's train_data_iterator (the rerun state machine's, and with
        --dataloader-save the dataloader state a persistent save keeps, as Megatron's save does)."""
        if not self.config.save:
            raise CheckpointError("save_checkpoint was called but --save is not set")
        if persistent and self.history.unchanged_since_restore(iteration):
            log.info(f"iteration {iteration} is unchanged since it was restored: nothing to save", rank0=True,
                     once=True)
            return
        if persistent:
            self.adapter.save_dataloader_state(data_iterator, iteration)
        save = Save(self.parts, iteration, persistent)
        self.save_phases = phases = save.phases
        with phases("previous snapshot"):
            self.handover.wait()
        save.take(every_expert=False, room=self.snapshot_need)
        with phases("metadata"):
            # (a skipped save too: a clean exit right after it still saves this state, ``_final_snapshot``)
            self.history.called(iteration, small_state.Captured(
                self.adapter.small_state(scheduler, iteration, flops, rng_key_prefix, data_iterator)))
        if save.why_not is not None:
            self.session.skipped(save.placement)
            self._skip(iteration, save.why_not)
            return
        faults.point("snapshot_end", iteration=iteration)
        self._hand_over(save, self.history.generation(iteration) if persistent else "")

    def _hand_over(self, save: "Save", generation: str) -> bool:
        """Save step 4, describe and hand over: the snapshot to the hand-over thread whole, or in rounds where
        node memory cannot take its experts at once; then the save is written in the save history. False
        when node memory freed no region for a round (warned)."""
        if save.in_rounds:
            if not save.write_in_rounds(self.handover, self.history.small, generation, self.adapter_items):
                return False
        else:
            with save.phases("metadata"):
                pending = save.describe(self.history.small, generation)
            self.handover.submit(pending)
        self.history.wrote(save.iteration, save.writes_every_expert)
        return True

    def _final_snapshot(self) -> None:
        """A clean exit right after a save (nothing trained since) that left experts out, or was skipped:
        save that iteration once more with every expert and persist it (a planned exit loses nothing: the
        restart restores every expert at it). No collective: every rank does the same, so the PEC
        bookkeeping stays identical; the agents commit it as its own save (``<session>.exit``)."""
        if self.stager is None or not self.session.connected:
            return
        iteration = self.history.owed_at_exit()
        if iteration is None:
            return
        save = Save(self.parts, iteration, persistent=True)  # (waits for regions, as a persistent save)
        save.take(every_expert=True)
        if save.slot is None:
            log.warning(f"cannot save every expert of iteration {iteration} at exit: {save.why_not}; the restart "
                        "restores them from their newest saved versions", rank=self.rank)
            return
        if self._hand_over(save, self.history.exit_generation):
            log.info(f"planned exit: iteration {iteration} saved once more with every expert", rank=self.rank)

    @property
    def adapter_items(self) -> list[str]:
        """This rank's items in slot order."""
        return list(dict.fromkeys(s.item for s in self.adapter.slot_slices))

    def _complete(self, pending: PendingSnapshot) -> None:
        """The snapshot's bytes are in the slot: write its header, with the items' checksums, and hand
        the slot to the agent."""
        header = dataclasses.replace(pending.header, sums={**pending.known_sums, **pending.staged.sums()},
                                     small=pending.small.text)
        self.files.write_header(pending.slot, header.to_metadata())
        if not self.session.announce(pending.slot, pending.iteration, pending.persistent, pending.persist_items,
                                     pending.placement, pending.generation):
            self._skip(pending.iteration, "the node agent died")
            return
        self.stats["saves"] += 1

    def _before_step(self) -> None:
        self.history.step()
        with traced("before the optimizer step"):  # (where a step waits for the last snapshot's copy enqueue)
            self.handover.before_step(torch.cuda.current_stream() if torch.cuda.is_available() else None)

    def _skip(self, iteration: int, why: str) -> None:
        self.stats["skipped"] += 1
        log.warning(f"skipped the snapshot of iteration {iteration}: {why}", rank=self.rank)

    def flush(self, timeout: float = 300.0) -> None:
        """Wait for the agent to finish everything announced so far (by earlier trainers too):
        persisted, committed and recorded."""
        self.handover.wait()
        self.session.flush(timeout)

    # ---- load ----------------------------------------------------------------------------------------
    @without_gc
    def load(self, root: str | None, scheduler, rng_key_prefix: str = "",
             pretrained: str | None = None) -> tuple[int, float]:
        """Restore the newest state every rank can restore from ``root`` (collective); returns
        ``(iteration, flops)``, ``(0, 0)`` when there is none. Starts this process's timeline.

        ``pretrained`` (--pretrained-checkpoint): when ``root`` holds nothing, fine-tune from it,
        as Megatron does; it must then hold a megatron-pec checkpoint."""
        phases = self.restore_phases = Phases()
        with phases("waiting for the agent"):  # load step 2
            self.handover.wait()
            self.session.settle()
        restore = Restore(RestoreParts(self.job, self.config, self.adapter, self.book, self.history, self.session,
                                       self.stager, self.files, self.check_on_device))
        restored = None
        if root:
            restored = restore.run(CheckpointDir(root, self.storage), self.config.finetune, scheduler,
                                   rng_key_prefix, phases)
        if restored is None and pretrained:
            log.info(f"no checkpoint under --load {root}; fine-tuning from --pretrained-checkpoint {pretrained} "
                     "(weights only, iteration 0)", rank0=True)
            restored = restore.run(CheckpointDir(pretrained, self.storage), True, scheduler, rng_key_prefix, phases)
            if restored is None:
                raise CheckpointError(
                    f"--pretrained-checkpoint {pretrained} holds no megatron-pec checkpoint; megatron-pec cannot "
                    "read Megatron's own formats yet: load it once with unpatched Megatron-LM and save with "
                    "megatron-pec, or point --pretrained-checkpoint at a megatron-pec --save directory")
        if restored is None:
            self.adapter.exit_if_missing_checkpoint(root or pretrained)
            self.session.begin(None)
            return 0, 0
        return restored

    def megatron_checkpoint(self, root: str) -> str | None:
        """What ``root`` holds when it is Megatron's own checkpoint and no megatron-pec one (collective:
        every rank must see the same)."""
        try:
            found = CheckpointDir(root, self.storage).megatron_format()
        except StorageUnreachable:
            found = None  # (the restore says what an unreachable storage means for it)
        coll = self.adapter.collectives
        if coll.all_ok(found is None):
            return None
        coll.raise_if_any(None if found else f"rank {self.rank} does not see the Megatron checkpoint in {root} "
                                              "that other ranks see: is --load on a shared file system?")
        return found

    def adopt(self, iteration: int) -> None:
        """Megatron's own loader restored ``iteration`` (switching to megatron-pec mid-run): continue
        from it; every later save is megatron-pec's, the first persistent one writes every expert."""
        self.flush()
        self.adapter.state_replaced()
        self.book.adopted_megatron()
        self.session.begin(iteration)

    def close(self, detach: bool = True) -> None:
        """``detach=False`` (the trainer is crashing): leave at once without a clean detach, so the
        agent keeps the node memory for the restart."""
        self.adapter.close()
        if detach:
            self.handover.wait()
            self._final_snapshot()
            self.handover.wait()
        self.session.close(detach)
        self._release_slots()

    def _release_slots(self) -> None:
        """Unpin and unmap the slots (a rebuilt engine maps them anew); the files stay for the agent."""
        if self.files is None:
            return
        self.stager.close()
        try:
            self.files.close()
        except BufferError:
            pass  # a view of a slot is still referenced somewhere: the mapping stays until exit
        self.files = None


@dataclass(frozen=True)
class SaveParts:
    """What a save works with: the engine's collaborators, not the engine."""

    job: JobFacts
    job_id: str
    adapter: object        # ``MegatronAdapter``: token counts, the collective, the live views
    book: PecBook
    history: SaveHistory
    session: AgentSession
    files: SlotFiles
    stager: Stager


class Save:
    """One save on one rank as named steps over its own state; ``take`` runs them in the one order of every
    save (lease a home slot, start the agreement, copy the dense state, plan and copy the experts / finish
    the agreement, in the order the policy allows) and ``Engine._hand_over`` describes the snapshot. Changes
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
        self.vote = None                  # the agreement's all-reduce, started
        self.caps: dict[int, int] | None = None  # EP rank -> experts it can take now, once agreed
        self.staging = None               # the copies, once started (``stager.Staging``)
        self.experts: tuple[frozenset, frozenset] | None = experts  # (snapshot, persist) experts, once planned
        self.placement: dict[str, int] = {}  # item -> the slot it was copied into
        self.in_rounds = False            # persisted, more experts than node memory takes at once (``Engine``)

    def lease(self) -> None:
        with self.phases("slot"):
            self.slot, self.why_not = self.parts.session.lease(self.persistent)
            self.capacity = self.parts.session.capacity() if self.slot is not None else 0

    def await_capacity(self, least: int = 1, timeout: float = ROUND_WAIT_S) -> None:
        """A later round of a save in rounds, or a snapshot under a budget: the regions it needs may still
        be read by the agent (a replica push or a persist); wait for ``least`` to be handed back."""
        if self.slot is not None and self.capacity < least:
            self.capacity = self.parts.session.await_capacity(least, timeout)

    def start_agreement(self) -> None:
        """The save's one collective: a SUM all-reduce of token counts, "cannot snapshot" flags and what
        each rank's node memory can take."""
        parts = self.parts
        with self.phases("agreement"):
            values = parts.book.agreement_values(parts.adapter.tokens.take(), self.slot is not None, self.capacity)
            self.vote = parts.adapter.collectives.start_reduce(values, "sum")

    def agree(self) -> None:
        with self.phases("agreement"):
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

    def take(self, every_expert: bool, room: int = 0) -> None:
        """Save steps 1-3, the one order of every save: lease a home slot; start the agreement (an ordinary
        save: its one collective); copy the dense state, which every plan writes, while the all-reduce runs;
        plan the experts and copy them, before the agreement's result where the plan reads no token counts
        (the all-reduce brings them), after it otherwise. ``every_expert``: a planned exit's save, every
        expert and no collective (every rank does the same, so the PEC bookkeeping stays identical);
        ``room``: the experts a snapshot's implied K writes under a budget (``await_snapshot_room``)."""
        self.lease()
        if not every_expert:
            self.await_snapshot_room(room)
            self.start_agreement()
        self.copy({NON_EXPERT})
        if every_expert:
            self.plan_all()
        elif self.parts.book.plans_without_counts:
            self.plan()
            self.agree()
        else:
            self.agree()
            self.plan()

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

    def write_in_rounds(self, handover, small: small_state.Captured, generation: str, items: list[str]) -> bool:
        """A persistent save whose experts node memory cannot take at once (every expert at a planned
        exit, or a first persist of every expert, into a pool with spares for a partial snapshot): rounds
        of memory-only snapshots of its iteration, each of as many of its experts as the pool has regions
        free and recorded before the next (their older versions are then free, once the agent's pushes
        and persists of the last round hand them back: one persist at most, ``AgentSession.await_capacity``),
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

    def describe(self, small: small_state.Captured, generation: str) -> PendingSnapshot:
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
                               header, small, self.staging.finish(), generation)

    def describe_part(self, small: small_state.Captured) -> PendingSnapshot:
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
                               self.staging.finish())

    def describe_whole(self, small: small_state.Captured, generation: str, persistent: bool, known: dict[str, str],
                       elsewhere: dict[str, int]) -> PendingSnapshot:
        """The last round: the snapshot of every item, those of earlier rounds where they wrote them (``known``:
        their checksums), persisted if the save is."""
        self.persistent = persistent
        self.placement = {**elsewhere, **self.placement}
        pending = self.describe(small, generation)
        return dataclasses.replace(pending, known_sums=dict(known))
