"""Load steps 3-7 from one checkpoint directory: the loader plans (``restore/loader.py``: lists, reads,
verifies, agrees, decides; no side effects), ``Restore`` acts - the plan into Megatron through the adapter
and into the PEC bookkeeping (6), checked where it landed, then retire and begin (7) - and falls back to an
older iteration where some rank cannot restore the one planned.

Built from its parts (``RestoreParts``), not from the engine: a restore can run with stand-ins for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_pec.common import log
from megatron_pec.common.collectives import Collectives
from megatron_pec.common.phases import Phases
from megatron_pec.config import PecConfig
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.integrity.checksum import first_mismatch
from megatron_pec.job_facts import JobFacts
from megatron_pec.restore.loader import LoadContext, Loader, Refused, RestoreDecision
from megatron_pec.restore.read_ring import DeviceReadRing
from megatron_pec.restore.sources import SourceError
from megatron_pec.store.checkpoint_dir import CheckpointDir


class RestoreAdapter(Protocol):
    """What a restore needs of the trainer (``megatron.adapter.MegatronAdapter``; the tests' stand-ins)."""

    collectives: Collectives  # the loader's agreements
    slices: list              # (``megatron.collect.Slice``) every slice this rank saves

    def live_views(self) -> dict[str, torch.Tensor]: ...

    def restore(self, small: SmallState, tensors: dict[str, torch.Tensor], scheduler, *, load_optim: bool,
                load_rng: bool, finetune: bool, rng_key_prefix: str = "", phases: Phases | None = None,
                places: dict[str, tuple[str, int]] | None = None, reads=None,
                while_copying=None) -> dict[str, str] | None: ...

    def iteration_after_load(self, iteration: int, finetune: bool) -> int: ...


@dataclass(frozen=True)
class RestoreParts:
    """What a restore works with: the engine's collaborators, not the engine."""

    job: JobFacts
    config: PecConfig
    adapter: RestoreAdapter  # the restore goes into Megatron through it
    book: object             # ``save.pec_book.PecBook``: the PEC bookkeeping adopts the restored state
    history: object          # ``save.save_history.SaveHistory``: what was restored, for the next saves
    session: object          # ``agent.link.AgentLink``: the new timeline, told to the agent
    stager: object | None    # ``save.stager.Stager``: checks items where they landed (None: no --save)
    files: object | None     # ``memory.slots.SlotFiles``: node memory's slots the loader reads
    check_on_device: bool    # items from node memory checked where they land, not before the copy

    @property
    def rank(self) -> int:
        return self.job.rank


class FileReads:
    """Step 6's reads of the plan's rank files (``RestoreDecision.reads``), given the tensors the restore writes:
    each file straight into them (``Source.read_into``; into device tensors through a ring of page-locked
    buffers, ``DeviceReadRing``), for the slices ``names``; called with those tensors, returns the tensors of
    the slices that did not land. A failure is kept in ``problem``, not raised: the restore goes on to its
    collectives, and the check after it excludes the iteration.

    ``staged_on_host``: host tensors go through the staging too, as device tensors would (the GPU path on
    CPU ranks: ``MEGATRON_PEC_CHECK_ON_DEVICE=1``)."""

    def __init__(self, reads: list, storage, staged_on_host: bool = False):
        self.reads, self.storage, self.problem = reads, storage, None
        self.staged_on_host = staged_on_host
        self.names = {name for _, names in reads for name in names}

    def __call__(self, targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        staging = DeviceReadRing.for_targets({n: targets[n] for n in self.names if n in targets},
                                            host_too=self.staged_on_host)
        for source, names in self.reads:
            try:
                out.update(source.read_into(self.storage, targets, names, staging))
            except SourceError as exc:
                self.problem = self.problem or str(exc)
        return out


class LandedCheck:
    """Whether every rank's restore landed as planned (load step 6's check, agreed by one all-reduce). A host copy
    that summed what it copied knows before the param sync, and so does a restore with nothing to check where it
    landed (its rank files checked as they were read): the agreement starts then (``start``), its all-reduce
    running beside the sync, and is awaited once the rest is restored (``agreed``); a check on the device starts
    it once everything landed."""

    def __init__(self, reads: FileReads, collectives: Collectives):
        self.reads, self.collectives = reads, collectives
        self.problem: str | None = None  # this rank's (None: it restored as planned)
        self.agreement = None            # the all-reduce, once started

    def start(self, problem: str | None) -> None:
        """This rank's check came out with ``problem`` (None: all matched); a rank file that failed as it was
        read is a problem too."""
        self.problem = self.reads.problem or problem
        self.agreement = self.collectives.start_reduce([int(self.problem is None)], "min")

    def agreed(self) -> bool:
        """Whether every rank restored as planned (``start`` first)."""
        return bool(self.agreement.result()[0])


class Restore:
    def __init__(self, parts: RestoreParts):
        self.parts = parts
        self.config, self.adapter, self.rank = parts.config, parts.adapter, parts.rank

    def run(self, directory: CheckpointDir, finetune: bool, scheduler, rng_key_prefix: str,
            phases: Phases) -> tuple[int, float] | None:
        """Load steps 3-7 from ``directory``, the one fallback loop: the loader lists what each rank can
        read once and plans (reads, verifies, agrees, decides; no side effects); this applies the plan and
        checks it where it landed; an iteration some rank cannot restore is excluded and the loader plans
        again. Only once a restore succeeded is what an abandoned run left after it retired.

        ``finetune``: weights only, the iteration starts at 0 (--finetune, or --pretrained-checkpoint).
        Returns ``(iteration, flops)``, None when ``directory`` holds nothing to restore."""
        load_optim = not (self.config.no_load_optim or finetune)
        # Node memory's bytes are checked where they land: on the device (the stager's sums), or, on a host
        # without one, by the copy that sums them (one pass over the bytes, not two).
        summed_by_copy = load_optim and not self.parts.check_on_device
        by_device = load_optim and self.parts.check_on_device and self.parts.stager is not None
        # ... and a rank file read whole is read in step 6, straight into the tensors it restores (on a device
        # through page-locked buffers, its items then checked there too).
        loader = Loader(self._load_context(phases), directory, checked_after_copy=by_device or summed_by_copy,
                        summed_by_copy=summed_by_copy, read_later=summed_by_copy or by_device)
        with phases("the rest of the loader"):  # (the loader's own phases inside)
            found = loader.candidates()
        excluded: set[int] = set()
        while True:
            with phases("the rest of the loader"):
                plan = loader.plan(found, excluded)
            if plan is None:
                if not found.manifests:  # node markers of an abandoned run must not join a new commit
                    self._retire_after(directory, 0, finetune, phases)
                return None
            if isinstance(plan, Refused):
                problem = plan.why
            else:
                reads = FileReads(plan.reads, directory.storage,
                                  staged_on_host=by_device and self.config.check_on_device)
                check = LandedCheck(reads, self.adapter.collectives)
                self._apply(plan, finetune, scheduler, rng_key_prefix, phases, reads, check)
                with phases("checking where it landed"):  # (node memory's items; on a device a read file's too)
                    if check.agreement is None:
                        check.start(self._checked_on_device(plan, phases))
                    every_rank_restored = check.agreed()
                problem = check.problem
                if every_rank_restored:
                    return self._restored(directory, plan, finetune, phases)
            log.warning(f"cannot restore iteration {plan.iteration}: {problem or 'another rank cannot'}; "
                        "falling back to an older checkpoint", rank=self.rank)
            excluded.add(plan.iteration)

    def _checked_on_device(self, plan: RestoreDecision, phases: Phases) -> str | None:
        """What of ``plan.check_after_copy`` does not match where it landed, by the device's sums (a host copy
        that summed the items checked them as it copied: ``_apply``)."""
        if not plan.check_after_copy:
            return None
        return self.parts.stager.checked(self.adapter.live_views(), plan.check_after_copy, phases)

    def _load_context(self, phases: Phases) -> LoadContext:
        return LoadContext(job=self.parts.job, config=self.config, collectives=self.adapter.collectives,
                           slice_items={s.name: s.item for s in self.adapter.slices}, slots=self.parts.files,
                           phases=phases)

    def _apply(self, plan: RestoreDecision, finetune: bool, scheduler, rng_key_prefix: str, phases: Phases,
               reads: "FileReads", check: "LandedCheck") -> None:
        """Load step 6: the plan into Megatron (through the adapter; the plan's rank files read into place
        by ``reads``) and into the PEC bookkeeping. A host copy that sums the plan's ``places`` as it copies
        them starts ``check`` then."""
        config, stager = self.config, self.parts.stager

        def while_copying(summed):
            if summed is not None:  # (a host copy that summed what it copied: checked before the param sync)
                check.start(first_mismatch(plan.check_after_copy, summed, "checked while copied"))
            elif not plan.check_after_copy:  # (nothing to check where it landed: the rank files' reads said it)
                check.start(None)
            elif not plan.places:
                # (checked on the device - no host copy sums the items: its sums are bound while the copy to the
                # device runs, and launched once it landed)
                stager.bind_sums(self.adapter.live_views(), phases)

        self.adapter.restore(plan.small, plan.tensors, scheduler,
                             load_optim=not (config.no_load_optim or finetune),
                             load_rng=not (config.no_load_rng or finetune), finetune=finetune,
                             rng_key_prefix=rng_key_prefix, phases=phases, places=plan.places or None,
                             reads=reads if plan.reads else None, while_copying=while_copying)
        with phases("PEC state"):
            self.parts.book.adopt(plan.pec, plan.tokens_at_target, plan.resharded)

    def _restored(self, directory: CheckpointDir, plan: RestoreDecision, finetune: bool,
                  phases: Phases) -> tuple[int, float]:
        """Load step 7, retire and begin: the restore is done. Retire what an abandoned run left after it, say
        so (where the time went included) and start the new timeline."""
        iteration = self.adapter.iteration_after_load(plan.iteration, finetune)
        self.parts.history.restore(iteration, here=directory.root == self.parts.job.save_root)
        self._retire_after(directory, plan.iteration, finetune, phases)
        plan.log(self.rank)
        with phases("telling the agent the new timeline"):
            self.parts.session.begin(iteration)
        log.info(f"restore took {phases.total():.3f} s ({phases.describe()})", rank=self.rank)
        return iteration, plan.small.num_floating_point_operations_so_far

    def _retire_after(self, directory: CheckpointDir, iteration: int, finetune: bool, phases: Phases) -> None:
        """Rank 0 of the job that saves into ``directory`` (it keeps the directory's books; every later save
        needs it, so this precedes them all): de-commit what an abandoned run left there after
        ``iteration``, where training resumes (``CheckpointDir.retire_after``). A fine-tune resumes at 0
        beside the loaded run's commits, which stay."""
        if self.rank != 0 or directory.root != self.parts.job.save_root:
            return
        if finetune:
            if iteration:
                log.warning(f"--finetune saves into {directory.root}, the directory it loaded iteration {iteration} "
                            "from: the loaded run's checkpoints stay committed beside the fine-tune's, and a restart "
                            "resumes from the newest committed iteration whichever run saved it; give the fine-tune "
                            "its own --save")
            return
        with phases("listing sources"):  # (the directory's books, as its listing)
            try:
                retired = directory.retire_after(iteration)
            except OSError as exc:
                log.warning(f"cannot retire the iterations after {iteration} under {directory.root} ({exc}); until "
                            "they are saved again their old manifests or node markers remain")
                return
        if retired:
            log.info(f"iterations {retired} under {directory.root} belong to an abandoned run after the restored "
                     f"iteration {iteration}; removed their manifests and node markers (training saves them again)")


__all__ = ["Restore", "RestoreParts"]
