"""The Megatron adapter: the one object through which megatron-pec touches Megatron.

One per trainer process, built with the engine (collective: every rank builds it).
It owns what only Megatron knows: topology and process groups, the slice table of
this rank's DistributedOptimizer shards and their live views, the optimizer step
hooks, the router token counters, the small state Megatron's own checkpoint
holds, and the restore into model, optimizer, scheduler, RNG and ``args``.
Engine, loader, sources, manifest, agent and policy never import ``megatron``.
"""

from __future__ import annotations

import functools
import json
import sys

import torch

from megatron_pec.common import log
from megatron_pec.common.collectives import Collectives
from megatron_pec.common.phases import Phases
from megatron_pec.format import small_state
from megatron_pec.format.item_names import ExpertId
from megatron_pec.format.protocol import RankLayout
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.megatron import collect, contiguous, expert_params, global_layout, modelstate, restore
from megatron_pec.megatron.optstate import OptimizerState
from megatron_pec.megatron.slice_copy import SliceCopy
from megatron_pec.megatron.tokens import TokenCounter


def training_args():
    """Megatron-LM's global training arguments, or None outside Megatron-LM's ``pretrain()`` (whose module is
    then loaded: never imported here, it would import Megatron-LM's whole training package)."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    try:
        return global_vars.get_args() if global_vars is not None else None
    except AssertionError:  # (loaded, but its arguments not parsed yet)
        return None


def megatron_checkpoint_function(name: str):
    """Megatron-LM's own ``megatron.training.checkpointing.<name>``, or None outside Megatron-LM."""
    try:
        from megatron.training import checkpointing
    except ImportError:
        return None
    return getattr(checkpointing, name)


def _widest(obj):
    """``obj`` with every number replaced by one of the longest JSON spelling of its type."""
    import numpy

    if isinstance(obj, SmallState):
        return _widest(obj.as_dict())  # (what SmallState.dumps encodes)
    if isinstance(obj, numpy.generic):
        obj = obj.item()
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return -(2**63)
    if isinstance(obj, float):
        return -1.2345678901234567e-308
    if isinstance(obj, (tuple, list)):
        return type(obj)(_widest(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _widest(v) for k, v in obj.items()}
    return obj  # tensors and arrays: their encoded length depends on their shape and dtype only


def _parallel_state_group(name: str):
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
            "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
            "dp": ps.get_data_parallel_group, "expt_dp": ps.get_expert_data_parallel_group}[name]()


class MegatronAdapter:
    def __init__(self, args, model_chunks: list, optimizer):
        from megatron.core import parallel_state

        self.args, self.model, self.optimizer = args, model_chunks, optimizer
        self.optimizers = collect.distributed_optimizers(optimizer)  # refuses setups we cannot checkpoint
        self.rank = torch.distributed.get_rank()
        self.optimizer_state = OptimizerState(optimizer, self.optimizers)
        self.world_size = torch.distributed.get_world_size()
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.topology = collect.topology()
        # Token counts are summed over all ranks. Data-, context- and expert-parallel ranks route
        # different tokens, pipeline stages different layers; tensor-parallel ranks route the same
        # tokens unless sequence parallelism splits the sequence among them: count those once.
        sequence_parallel = getattr(model_chunks[0].config, "sequence_parallel", False)
        self.token_replicas = 1 if sequence_parallel else parallel_state.get_tensor_model_parallel_world_size()
        self.collectives = Collectives.over_all_ranks()
        self.slices = collect.build_slices(model_chunks, optimizer)
        self.local_fingerprint = collect.fingerprint(self.slices, self.topology)
        self.slot_slices = collect.slot_order(self.slices)  # (the fingerprint keeps the build order)
        self.tokens = TokenCounter(model_chunks)
        self.buffers = collect.buffer_refs(model_chunks)
        # every chunk's params and modules by global name: walked once (seconds at 58 x 256 experts)
        self.global_names = [expert_params.global_names(chunk) for chunk in model_chunks]
        # refuses (naming it) any model state Megatron would save and megatron-pec would not keep
        self.model_state = modelstate.ModelState.of(
            model_chunks, self.global_names, {id(getattr(module, attr)) for _, module, attr in self.buffers})
        dataloader_save = getattr(args, "dataloader_save", None)
        if dataloader_save and megatron_checkpoint_function("maybe_save_dataloader_state") is None:
            raise modelstate.UnkeptState(
                f"--dataloader-save {dataloader_save} asks for the dataloader's state, which megatron-pec saves "
                "through Megatron-LM's own maybe_save_dataloader_state: not importable here (megatron.training); "
                "drop the flag or run in Megatron-LM")
        self.saved_args = modelstate.checkpoint_args(args)
        self._grad_scalers = functools.partial(modelstate.grad_scalers, self.optimizers)
        self._rerun_room = modelstate.rerun_margin(args)
        self._frozen = None  # host copies of the frozen parameters (they do not change; taken at the first save)
        self.experts_held: list[ExpertId] = sorted({s.expert for s in self.slices if s.expert is not None})
        self._live: dict[str, torch.Tensor] | None = None
        self._step_hooks = []
        self._groups_checked: set[int] = set()

    # ---- what the engine asks ------------------------------------------------------------------
    @property
    def moe_layers(self) -> list[int]:
        """Global 1-based numbers of this stage's MoE layers."""
        return self.tokens.layers

    @property
    def num_experts(self) -> int:
        return self.tokens.num_experts

    def expert_bytes(self) -> int:
        """The largest checkpoint footprint of one expert on this rank (0 without experts)."""
        per_expert: dict[ExpertId, int] = {}
        for s in self.slices:
            if s.expert is not None:
                per_expert[s.expert] = per_expert.get(s.expert, 0) + s.numel * s.dtype.itemsize
        return max(per_expert.values(), default=0)

    def live_views(self, keep_values: bool = True) -> dict[str, torch.Tensor]:
        """Slice name -> view of the optimizer's current tensor; bound once the optimizer has state,
        again after a restore replaced the optimizer's tensors. Before the first step: the main params
        and zeros for the state (not bound: the first step creates the state tensors).
        ``keep_values=False``: a binding need not keep the state's values (see ``contiguous``)."""
        if self._live is None:
            if self.has_state:
                collect.check_state_keys(self.optimizer)
                contiguous.place_state_contiguously(self.optimizers, self.slot_slices, keep_values)
            self._live = collect.live_views(self.slices, self.optimizer)
            if self._live is None:
                return collect.stateless_views(self.slices, self.optimizer)
        return self._live

    def state_replaced(self) -> None:
        """Someone else (Megatron's own loader) replaced the optimizer's state tensors."""
        restore.untie_steps(self.optimizer)
        self._live = None

    def before_each_step(self, callback) -> None:
        """Call ``callback()`` before every optimizer step (before the step mutates the state)."""
        for opt in self.optimizers:
            self._step_hooks.append(opt.optimizer.register_step_pre_hook(lambda *_: callback()))

    def after_each_step(self, callback) -> None:
        """Call ``callback()`` after every optimizer step (after the last of the chained optimizers)."""
        self._step_hooks.append(self.optimizers[-1].optimizer.register_step_post_hook(lambda *_: callback()))

    @property
    def has_state(self) -> bool:
        """The optimizer holds its state (Adam's moments exist once it has stepped)."""
        return collect.stepped(self.optimizers)

    def small_state(self, scheduler, iteration: int, flops: float, rng_key_prefix: str = "",
                    data_iterator=None) -> SmallState:
        if self._frozen is None:
            self._frozen = self.model_state.frozen_copies()
        rerun = modelstate.rerun_state(data_iterator)
        modelstate.check_rerun_room(rerun, self._rerun_room)
        # (the record built once, every field at once: a save makes it at every iteration)
        return collect.small_state(self.optimizer, scheduler, self.args, iteration, flops, self.buffers,
                                   self.optimizer_state.state_dict, self._grad_scalers, self.optimizers,
                                   rng_key_prefix=rng_key_prefix, frozen=self._frozen, rerun_state_machine=rerun,
                                   extra_state=self.model_state.extra_states(), args=self.saved_args)

    def save_dataloader_state(self, data_iterator, iteration: int) -> None:
        """A persistent save with --dataloader-save: the train iterator's state, through Megatron-LM's own
        maybe_save_dataloader_state (beside the checkpoint, where its dataloader reads it back)."""
        path = getattr(self.args, "dataloader_save", None)
        if path and data_iterator is not None:
            megatron_checkpoint_function("maybe_save_dataloader_state")(data_iterator, iteration, path)

    def state_kinds(self) -> list[tuple[str, str]]:
        """What every save keeps, as (kind, description): the start-up line, and tests comparing with Megatron."""
        kinds = [("model_params", "model parameters (as distributed-optimizer main params)"),
                 ("optimizer", f"distributed-optimizer state ({', '.join(collect.state_kinds(self.optimizers[0]))}), "
                               "param groups and step"),
                 ("scheduler", "scheduler"), ("rng", "RNG (random, numpy, torch, cuda, tracker)"),
                 ("counters", "iteration, consumed/skipped samples, FLOPs"),
                 ("checkpoint_args", "the arguments check_checkpoint_args compares")]
        if self.buffers:
            kinds.append(("buffers", f"persistent buffers ({len(self.buffers)})"))
        if self.model_state.frozen:
            kinds.append(("frozen_params", f"frozen parameters ({len(self.model_state.frozen)})"))
        if self.model_state.extra:
            kinds.append(("extra_state", f"modules' extra state ({len(self.model_state.extra)})"))
        if any(o.grad_scaler is not None for o in self.optimizers):
            kinds.append(("grad_scaler", "grad scaler (before the first step too)"))
        if modelstate.rerun_enabled():
            kinds.append(("rerun_state_machine", "rerun state machine (as this megatron-core release saves it)"))
        if getattr(self.args, "dataloader_save", None):
            kinds.append(("dataloader", f"dataloader state (--dataloader-save {self.args.dataloader_save})"))
        return kinds

    def exit_if_missing_checkpoint(self, where: str) -> None:
        """--exit-on-missing-checkpoint and nothing to load: exit as Megatron-LM's loader does (every rank,
        after a barrier, exit status 0)."""
        if not getattr(self.args, "exit_on_missing_checkpoint", False):
            return
        log.info(f"no checkpoint under {where}", rank0=True)
        if self.rank == 0:
            print(">> '--exit-on-missing-checkpoint' set ... exiting. <<", flush=True)
        torch.distributed.barrier()
        sys.exit()

    def iteration_after_load(self, iteration: int, finetune: bool) -> int:
        """The iteration load_checkpoint returns: 0 when fine-tuning, --override-ckpt-iteration's when given."""
        if finetune:
            return 0
        override = getattr(self.args, "override_ckpt_iteration", None)
        return iteration if override is None else override

    def small_state_bound(self) -> int:
        """Bytes the small state can take in a save's header during training: its JSON now with every
        number at its widest (so every process of this configuration computes the same bound: slot sizes
        must not differ between a trainer and its restart), escaped as the header's metadata string holds
        it; plus room for what appears only later, counted twice (escaping at most doubles a byte)."""
        widest = len(json.dumps(small_state.dumps(_widest(self.small_state(None, 0, 0.0)))))
        return widest + 2 * self._later_bound()

    def _later_bound(self) -> int:
        """What the small state gains after start-up: the optimizer's state_dict once it has stepped (its
        param groups without their params - Megatron strips them - and with a step count, measured now at
        their widest; a wrapper and grad scaler per optimizer), the scheduler's few fields, extra states
        growing a little (base64: 4/3) and a pending rerun's micro-batches."""
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0.0}
                  for opt in self.optimizers for g in opt.optimizer.param_groups]
        stepped = len(small_state.dumps(_widest(groups))) + 1024 * len(self.optimizers)
        return stepped + (2 << 10) + 2 * self.model_state.extra_state_margin() + self._rerun_room

    def layout_record(self, fingerprint: str) -> RankLayout:
        """Where each slice lies in the model's global parameters (``RankLayout``)."""
        return global_layout.rank_layout(fingerprint, self.rank, self.topology, self.slices, self.optimizers,
                                         self.global_names, self.buffers)

    def check_groups(self, **groups) -> None:
        """Refuse process groups that differ from parallel_state's: slices, fingerprint and the
        agreement collectives are all built on parallel_state's topology.

        ``groups``: tp, pp, dp_cp, dp, expt_dp -> a ProcessGroup or None (None: parallel_state's)."""
        for name, group in groups.items():
            if group is None or id(group) in self._groups_checked:
                continue
            given = torch.distributed.get_process_group_ranks(group)
            expected = torch.distributed.get_process_group_ranks(_parallel_state_group(name))
            if sorted(given) != sorted(expected):
                from megatron_pec.common.errors import CheckpointError

                raise CheckpointError(
                    f"the {name}_group passed to save/load_checkpoint holds ranks {sorted(given)}, "
                    f"but megatron-core's parallel_state group of this rank holds {sorted(expected)}; megatron-pec "
                    "shards checkpoints by parallel_state's groups: pass those (or None), or use Megatron's own "
                    "checkpointing for this model")
            self._groups_checked.add(id(group))

    # ---- restore ---------------------------------------------------------------------------------
    def restore(self, small: SmallState, tensors: dict[str, torch.Tensor], scheduler, *, load_optim: bool,
                load_rng: bool, finetune: bool, rng_key_prefix: str = "", phases: Phases | None = None,
                places: dict[str, tuple[str, int]] | None = None, reads=None,
                while_copying=None) -> dict[str, str] | None:
        """Load step 6 on this rank: saved slices into the optimizer shards, then model params (the DDP
        param all-gather), scheduler, RNG and Megatron's ``args`` side effects; each part timed in
        ``phases``.

        Without ``load_optim`` only the main params (the weights) are restored. With ``places`` (slice name ->
        (item, byte offset in the item)), the copy sums those slices' items as it copies them (host tensors):
        returns item -> sum64 of the bytes copied (None without). ``reads`` (``restore.FileReads``): the slices
        of its ``names`` are read straight into the optimizer's tensors (those that do not fit there come
        back as tensors to copy). ``while_copying(summed)``: called once the copies are enqueued, while a device's
        may still run (every copy has landed when this returns), with the sums the host copy took (None: none).
        """
        phases = phases or Phases()
        if not finetune:  # (as Megatron: a fine-tune does not check the arguments)
            modelstate.check_args(self.args, small.args, small.checkpoint_version)
        copy = SliceCopy([s.name for s in self.slot_slices])  # (in slot order, so that runs of slices coalesce)
        try:
            if load_optim and places is None and reads is None and not self.has_state \
                    and restore.main_params_stay(self.optimizers):
                with phases("copy"):  # (a relaunch: the main params' copy runs while the moments are allocated)
                    copy.first(self._param_views(), tensors)
            with phases("optimizer state"):
                targets = self._restore_targets(small, set(tensors) | (reads.names if reads is not None else set()),
                                                load_optim)
            if reads is not None:
                with phases("reading and checking"):
                    tensors = {**tensors, **reads(targets)}
            with phases("copy"):
                summed = copy.rest(targets, tensors, places)
            if while_copying is not None:
                while_copying(summed)
            self._restore_beyond_slices(small, scheduler, load_optim, load_rng, finetune, rng_key_prefix, phases)
        finally:
            with phases("copy"):  # (every copy landed before its sources may change, after an error too)
                copy.wait()
        return summed

    def _restore_beyond_slices(self, small: SmallState, scheduler, load_optim: bool, load_rng: bool, finetune: bool,
                               rng_key_prefix: str, phases: Phases) -> None:
        """Load step 6 after the slices' copy: model params, scheduler, RNG and Megatron's ``args``."""
        with phases("param sync"):
            restore.sync_model_params(self.model, self.optimizer)
            if not load_optim and self._half_precision and not getattr(self.args, "load_main_params_from_ckpt", False):
                # As Megatron's load without the optimizer: fp32 main params rebuilt from the half-precision
                # model params (--load-main-params-from-ckpt keeps the saved ones, as restored above).
                self.optimizer.reload_model_params()
        with phases("other state"):
            restore.set_checkpoint_version(small.checkpoint_version)
            restore.restore_buffers(self.buffers, small.buffers)
            self.model_state.restore(small.frozen, small.extra_state)
            self._frozen = None
            if not finetune:  # (a resharded restore's small state has none: Megatron ignores it then)
                modelstate.restore_rerun_state(small.rerun_state_machine)
        with phases("scheduler"):
            if scheduler is not None and load_optim and small.scheduler is not None:
                restore.restore_scheduler(scheduler, small.scheduler)
        with phases("RNG and arguments"):
            saved_prefix = small.rng_key_prefix
            if load_rng and saved_prefix != rng_key_prefix:
                log.warning(f"the checkpoint's RNG state was saved under rng_state_key_prefix {saved_prefix!r}, "
                            f"this load asks for {rng_key_prefix!r}: RNG state not restored", rank0=True)
            elif load_rng:
                restore.restore_rng(small.rng)
            restore.restore_args(self.args, small, finetune, getattr(self.args, "override_ckpt_iteration", None))

    def _restore_targets(self, small: SmallState, restored: set[str], load_optim: bool) -> dict[str, torch.Tensor]:
        """The optimizer's state from ``small`` (hyperparameters, step; allocated where it has none), and the
        live tensors the restore writes: every slice's, or the main params' without ``load_optim``.
        ``restored``: the slices it writes."""
        if load_optim and small.optimizer is None:
            # saved before the first optimizer step: the optimizer goes back to having no state
            restore.clear_optimizer_state(self.optimizer)
            modelstate.restore_grad_scalers(self.optimizers, small.grad_scaler)
            self._live = None
            return self._param_views()
        if not load_optim:
            return self._param_views()
        moments = functools.partial(contiguous.fresh_moments, self.optimizers, self.slot_slices)
        if not restore.restore_optimizer(self.optimizer, restore.fit_optimizer_state(small.optimizer, self.optimizers),
                                         moments):
            self._live = None  # the optimizer's tensors were replaced (allocated anew)
        # (binding anew places the state contiguously: its values need no copy when every slice of it is
        # overwritten next)
        return self.live_views(keep_values=not all(s.name in restored for s in self.slot_slices))

    @property
    def _half_precision(self) -> bool:
        return bool(getattr(self.args, "fp16", False) or getattr(self.args, "bf16", False))

    def _param_views(self) -> dict[str, torch.Tensor]:
        """The main-param views only (``--no-load-optim``: Adam may have no state yet)."""
        return {s.name: collect.param_view(self.optimizers, s) for s in self.slices if s.kind == "param"}

    def close(self) -> None:
        """Remove the router and step hooks (a new engine installs its own)."""
        self.tokens.remove()
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
