"""The per-process checkpoint engine: the composition. It builds every part once and hands saves to the
``Saver`` (save steps 1-4 and the planned exit's save, step 8: ``save/saver.py``) and restores to a
``Restore`` (load steps 6-7: ``restore/restore.py``) after load step 2 (settle); the steps are numbered as
in docs/design.md.

One ``Engine`` per trainer process, built on the first ``load_checkpoint`` or ``save_checkpoint``
(collective: every rank builds it). Building it does all expensive set-up - the Megatron
adapter's slice table, the job's facts, slot files with the tmpfs preflight (pinned on a GPU),
the node agent - so that every save, including the first, only plans and copies.

Who owns what: Megatron is reached only through ``adapter``; the job's constants are ``job``;
the PEC bookkeeping is ``book``; copies are ``stager``'s; the node agent and the slot lease are
``session``'s; saves and completing a snapshot once its copies landed are ``saver``'s.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_pec.agent.client import AgentUnavailable, check_socket_path
from megatron_pec.agent.link import AgentLink
from megatron_pec.common import log
from megatron_pec.common.errors import CheckpointError, StorageUnreachable
from megatron_pec.common.gcpause import without_gc
from megatron_pec.common.phases import Phases, traced
from megatron_pec.config import PecConfig, PecConfigError, megatron_flag_notes
from megatron_pec.format.stformat import layout as tensor_layout
from megatron_pec.integrity.run_sums import kernel_load
from megatron_pec.job_facts import JobFacts
from megatron_pec.memory import budget
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import SlotFiles, SlotSpaceError
from megatron_pec.restore.restore import Restore, RestoreParts
from megatron_pec.save import memory_sizing, rank_layout
from megatron_pec.save.pec_book import PecBook
from megatron_pec.save.save import SaveParts
from megatron_pec.save.save_history import SaveHistory
from megatron_pec.save.saver import Saver
from megatron_pec.save.stager import Stager
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import Storage


class Engine:
    @without_gc  # (set-up allocates per slice and per expert: the collector's passes cost a third of it at scale)
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
        self.session = AgentLink(self.job.node_dir, self.rank, self.job.node_rank, hello,
                                 items, idle_timeout=self.config.agent_idle_timeout,
                                    keep_shm=self.config.keep_shm, wait_for_slot=self.config.wait_for_slot)
        self.files: SlotFiles | None = None
        self.memory_sizing: budget.MemorySizing | None = None
        self.snapshot_need = 0  # under a budget: the experts one snapshot at its implied K writes
        self.stager: Stager | None = None
        self.saver: Saver | None = None  # (with --save: built once node memory is set up)
        self.restore_phases = Phases()  # where the latest restore's time went (benchmarks read them)
        self.history = SaveHistory(self.job.session)
        # A restore from node memory checks its bytes where they land: on the GPU (a test hook runs the same
        # path on CPU ranks; else they are checked in node memory, before the copy).
        self.check_on_device = torch.cuda.is_available() or self.config.check_on_device
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
        layout = SlotMap.of(entries, 0, homes=3 if self.job.num_nodes > 1 and not self.job.replicas else 2)
        reserve = memory_sizing.header_reserve(self.job, self.adapter.small_state_bound())
        asked = self.book.state.snapshot.k if self.job.expert_layout else 1
        plan, error = memory_sizing.plan(self.job, self.config, self.adapter.collectives, layout, asked,
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
            self.memory_sizing = replace(plan, regions=self.files.layout.regions)
            memory_sizing.report(self.memory_sizing, self.job, torch.cuda.is_available())
            self.session.use_pool(self.files.layout.regions, self.files.layout.homes)
            self.stager = Stager(self.files, self.adapter.slot_slices, self.rank, kernel=kernel,
                                 kernel_copies=False if self.config.copy_engine else None,
                                 copy_programs=self.config.copy_programs)
            self.stager.pin()
            self.session.start()
        except (SlotSpaceError, AgentUnavailable) as exc:
            error = str(exc)
        self.adapter.collectives.raise_if_any(error)
        self.saver = Saver(SaveParts(self.job, self.config.job_id, self.adapter, self.book, self.history,
                                     self.session, self.files, self.stager), self.snapshot_need)
        # (a save's agreement may be made on the hand-over thread: the training thread's collectives come after)
        self.adapter.collectives.first_wait_for(self.saver.handover.wait)

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
        """Save steps 1-4 (``Saver.save``)."""
        if self.saver is None:
            raise CheckpointError("save_checkpoint was called but --save is not set")
        self.saver.save(iteration, scheduler, flops, persistent, rng_key_prefix, data_iterator)

    @property
    def save_phases(self) -> Phases:
        """Where the latest save's time went on the training thread (benchmarks read them)."""
        return self.saver.phases if self.saver is not None else Phases()

    @property
    def stats(self) -> dict[str, int]:
        return self.saver.stats if self.saver is not None else {"saves": 0, "skipped": 0}

    def wait_for_saves(self) -> None:
        """Until every save called so far is complete on this side: agreed, described and handed to the node
        agent, or skipped (the PEC bookkeeping, the save history and ``stats`` are then up to date)."""
        if self.saver is not None:
            self.saver.handover.wait()

    def _before_step(self) -> None:
        self.history.step()
        if self.saver is None:
            return
        with traced("before the optimizer step"):  # (where a step waits for the last snapshot's copy enqueue)
            self.saver.handover.before_step(torch.cuda.current_stream() if torch.cuda.is_available() else None)

    def flush(self, timeout: float = 300.0) -> None:
        """Wait for the agent to finish everything announced so far (by earlier trainers too):
        persisted, committed and recorded."""
        self.wait_for_saves()
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
            self.wait_for_saves()
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
        if detach and self.saver is not None:
            self.saver.final_snapshot()
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
