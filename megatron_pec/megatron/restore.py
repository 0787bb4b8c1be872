"""Load step 6, apply: saved slices back into the optimizer shards, then model params, RNG,
scheduler and Megatron's ``args``.

Runs on every rank with its own slices; the only communication is the normal
DDP parameter all-gather that rebuilds full model params from the shards.
"""

from __future__ import annotations

import random
import sys
import weakref

import numpy
import torch

from megatron_pec.common.coalesce import coalesced
from megatron_pec.common.errors import CheckpointError
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.integrity.summed_copy import summed_copy
from megatron_pec.megatron.collect import distributed_optimizers, module_buffers


@torch.no_grad()
def copy_slices(live: list[torch.Tensor], saved: list[torch.Tensor],
                places: list[tuple[str, int] | None] | None = None) -> dict[str, str] | None:
    """Each saved slice into its live view. With ``places`` (per slice: its item and byte offset in the
    item, or None: not summed), the slices placed are copied by host copies that sum what they copy:
    returns item -> sum64 of its bytes copied (None without ``places``). A copy to a device may still run
    when this returns: the caller waits for the device's stream before the sources change (``SliceCopy``)."""
    summed = None
    if places is not None:
        picked = [i for i, place in enumerate(places) if place is not None]
        summed = summed_copy([live[i] for i in picked], [saved[i] for i in picked], [places[i] for i in picked])
        plain = [i for i, place in enumerate(places) if place is None]
        live, saved = [live[i] for i in plain], [saved[i] for i in plain]
    live, saved = coalesced(live, saved)
    if live:  # one call, not one per run: a large MoE rank holds thousands
        torch._foreach_copy_(live, saved, non_blocking=True)
    return summed


@torch.no_grad()
def sync_model_params(model_chunks, optimizer) -> None:
    """Main params -> model params on this rank's shard, then all-gather the rest (DDP param sync).
    A bucket group of one rank is skipped: its shard is the whole bucket, which the all-gather would
    only copy onto itself (all of this rank's experts when the expert data-parallel size is 1)."""
    for opt in distributed_optimizers(optimizer):
        if not _main_params_are_model_params(opt):
            opt._copy_main_params_to_model_params()
    for chunk in model_chunks:
        config = chunk.ddp_config
        if config.overlap_param_gather or getattr(config, "reuse_grad_buf_for_mxfp8_param_ag", False):
            chunk.start_param_sync(force_sync=True)  # Megatron's own bookkeeping of pending gathers
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if group.intra_distributed_optimizer_instance_size > 1:
                group.start_param_sync(force_sync=True)


def main_params_stay(optimizers: list) -> bool:
    """Loading the optimizer's state leaves its main params where they are (a precision-aware optimizer
    keeps them in that state)."""
    return not any(getattr(opt.config, "use_precision_aware_optimizer", False) for opt in optimizers)


_ALIASED: "weakref.WeakKeyDictionary[object, bool]" = weakref.WeakKeyDictionary()


def _main_params_are_model_params(opt) -> bool:
    """Whether every main-param shard of ``opt`` is a view of its model param (fp32 training: Megatron's
    ``shard_fp32_groups``, with no half-precision groups): then its copy of main params into model params
    copies every byte onto itself, and the restore, which wrote the main params, skips it. Found once per
    optimizer; any other setup (half precision, fp8, a Megatron that keeps fp32 copies) gets Megatron's copy."""
    if opt not in _ALIASED:
        halves = getattr(opt, "shard_fp32_from_float16_groups", None)
        mains, models = getattr(opt, "shard_fp32_groups", None), getattr(opt, "model_fp32_groups", None)
        _ALIASED[opt] = halves is not None and not any(halves) and mains is not None and models is not None and \
            len(mains) == len(models) and all(
                len(main_group) == len(model_group) and all(
                    main.untyped_storage().data_ptr() == model.untyped_storage().data_ptr()
                    for main, model in zip(main_group, model_group))
                for main_group, model_group in zip(mains, models))
    return _ALIASED[opt]


@torch.no_grad()
def restore_buffers(refs, saved: dict[str, torch.Tensor] | None) -> None:
    """Persistent module buffers (``collect.buffer_refs``) back into the model (checkpoints written
    before buffers were saved have none: the model keeps its own)."""
    if saved is None:
        return
    live = module_buffers(refs)
    if set(saved) != set(live):
        raise CheckpointError(f"the checkpoint's module buffers {sorted(saved)} differ from the "
                              f"model's {sorted(live)}: was it saved with other model flags (for example "
                              "--moe-router-enable-expert-bias)?")
    for name, tensor in saved.items():
        if tensor.shape != live[name].shape:
            raise CheckpointError(f"buffer {name} has shape {tuple(tensor.shape)} in the checkpoint, "
                                  f"{tuple(live[name].shape)} in the model")
        live[name].copy_(tensor)


def clear_optimizer_state(optimizer) -> None:
    """Back to before the first step: no per-param state (the next step creates it)."""
    for opt in distributed_optimizers(optimizer):
        opt.optimizer.state.clear()


def fit_optimizer_state(saved, optimizers: list):
    """The saved optimizer state_dict (Megatron's: a dict for one inner optimizer, a list for several)
    shaped for ``optimizers`` (``distributed_optimizers``) when another expert-parallel size split the
    parameters differently (EP > 1 keeps experts in an optimizer of their own; EP = 1 does not).
    Each live param group takes the hyperparameters of the saved group with the same identity apart
    from ``is_expert_parallel``; the scheduler's restore then sets lr and weight decay by its step."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    parts = saved if isinstance(saved, list) else [saved]
    if len(parts) == len(optimizers):
        return saved

    def identity(group: dict) -> tuple:
        return tuple(repr(group.get(k)) for k in param_group_identifier_keys if k != "is_expert_parallel")

    saved_groups = {}
    for part in parts:
        for group in part["optimizer"]["param_groups"]:
            saved_groups.setdefault(identity(group), group)
    fitted = []
    for opt in optimizers:
        groups = []
        for live in opt.optimizer.param_groups:
            match = saved_groups.get(identity(live))
            if match is None:
                raise CheckpointError("the checkpoint's optimizer has no param group like "
                                      f"{ {k: live.get(k) for k in param_group_identifier_keys} }: it was saved "
                                      "with other optimizer settings (weight-decay or lr multipliers)")
            groups.append({**{k: v for k, v in match.items() if k != "params"},
                           "is_expert_parallel": live.get("is_expert_parallel")})
        fitted.append({**parts[0], "optimizer": {**parts[0]["optimizer"], "param_groups": groups}})
    return fitted[0] if len(fitted) == 1 else fitted


ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def restore_optimizer(optimizer, state: dict, moments=None) -> bool:
    """The saved optimizer state_dict (hyperparameters, step) into ``optimizer``; the Adam moments
    come next, as slices. Megatron's load_state_dict reallocates and deep-copies every moment; a
    restore into a running job (torch Adam, every param's state present) is done in place instead,
    and so is the allocation of a fresh optimizer's moments: ``moments(kinds)``, where given, allocates
    them (main param -> kind -> tensor, ``contiguous.fresh_moments``; a param it lacks gets its own). Returns
    whether the optimizer's state tensors are the same objects as before."""
    had_state = any(o.optimizer.state for o in distributed_optimizers(optimizer))
    if _load_in_place(optimizer, state, moments):
        return had_state
    optimizer.load_state_dict(state)
    untie_steps(optimizer)
    return False


def _load_in_place(optimizer, state, moments=None) -> bool:
    """What Megatron's DistributedOptimizer.load_state_dict leaves behind without apex/TE (each live
    param group updated from the saved group of the same identity, every param's ``step`` set to the
    saved one, and in a fresh optimizer, a restart, the moments it allocates: the slices overwrite
    them next), when that is all there is to do; False (nothing changed) otherwise.

    A fresh optimizer matters most: Megatron's path ends in torch's ``Optimizer.load_state_dict``,
    which looks each state value's param up in a list of them all: quadratic in the params."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return False  # FusedAdam keeps its step in the groups: Megatron's own path
    optimizers = distributed_optimizers(optimizer)
    parts = state if isinstance(state, list) else [state]
    if len(parts) != len(optimizers):
        return False

    def identity(group: dict) -> tuple:
        return tuple(repr(group.get(k, group.get(f"pre_{k}"))) for k in param_group_identifier_keys)

    plans, steps = [], set()
    for opt, part in zip(optimizers, parts):
        inner = opt.optimizer
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or opt.grad_scaler is not None \
                or set(part) - {"optimizer"}:
            return False
        saved = {identity(g): g for g in part["optimizer"]["param_groups"]}
        matched = [saved.get(identity(g)) for g in inner.param_groups]
        if None in matched or len(saved) != len(inner.param_groups) or any(g.get("amsgrad") for g in matched):
            return False
        params = [p for g in inner.param_groups for p in g["params"]]
        fresh = not any(inner.state.get(p) for p in params)
        if fresh and not _allocates_plain_moments(opt):
            return False
        if not fresh and not all(torch.is_tensor(inner.state.get(p, {}).get("step")) and "exp_avg" in inner.state[p]
                                 and "exp_avg_sq" in inner.state[p] for p in params):
            return False
        if not fresh and len({id(inner.state[p]["step"]) for p in params}) != len(params):
            return False  # steps shared by every param (see untie_steps): Megatron's path unties them
        steps |= {g.get("step") for g in matched}
        plans.append((inner, matched, params, fresh))
    if len(steps) != 1 or None in steps:
        return False
    step = float(steps.pop())
    placed = moments(ADAM_MOMENTS) if moments is not None and any(fresh for *_, fresh in plans) else {}
    with torch.no_grad():
        for inner, matched, params, fresh in plans:
            for live, group in zip(inner.param_groups, matched):
                live.update({k: v for k, v in group.items() if k != "params"})
            for p in params:
                if fresh:  # (Megatron's allocation, cast to the param as torch's load_state_dict casts it)
                    mine = placed.get(p, {})
                    inner.state[p] = {kind: mine[kind] if kind in mine else torch.empty_like(p)
                                      for kind in ADAM_MOMENTS}
                    inner.state[p]["step"] = torch.tensor(step, dtype=torch.float)
                else:
                    inner.state[p]["step"].fill_(step)
    return True


def _allocates_plain_moments(opt) -> bool:
    """Whether Megatron's load_state_dict gives a fresh optimizer nothing but fp32 Adam moments and a
    CPU ``step`` per param (no precision-aware optimizer, no fused or capturable Adam)."""
    config = opt.config
    if getattr(config, "use_precision_aware_optimizer", False) or any(
            getattr(config, name, torch.float32) != torch.float32 for name in ("exp_avg_dtype", "exp_avg_sq_dtype")):
        return False
    return not any(g.get("fused") or g.get("capturable") for g in opt.optimizer.param_groups)


def untie_steps(optimizer) -> None:
    """After Megatron's DistributedOptimizer.load_state_dict (ours, or Megatron's own loader's): without
    apex/TE it gives every param the same ``step`` tensor, which torch's foreach Adam then increments
    once per param per step; each param gets its own again."""
    for opt in distributed_optimizers(optimizer):
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()


def restore_scheduler(scheduler, state: dict) -> None:
    # OptimizerParamScheduler.load_state_dict *adds* the saved step count (it expects a
    # fresh scheduler); start from zero so a restore into a running job is exact too.
    scheduler.num_steps = 0
    scheduler.load_state_dict(state)


def restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    live = tracker.get_states()
    states = {}
    for name, saved in state["tracker"].items():
        if isinstance(live.get(name), torch.Generator):  # a CUDA-graph-safe tracker keeps its generators
            live[name].set_state(saved)
            states[name] = live[name]
        else:
            states[name] = saved
    tracker.set_states(states)


def set_checkpoint_version(version: float) -> None:
    """Megatron-LM's record of the loaded checkpoint's format version (``get_checkpoint_version``), set at
    every load as Megatron's own loader does, where Megatron-LM's loop runs (its training.py has loaded the
    module). Never imported here: a trainer of its own has nothing that reads it, and importing Megatron-LM's
    training package (megatron-core 0.19's wheel ships it) would cost a relaunched restore half a second."""
    checkpointing = sys.modules.get("megatron.training.checkpointing")
    if checkpointing is not None:
        checkpointing.set_checkpoint_version(version)


def restore_args(args, state: SmallState, finetune: bool, override_iteration: int | None = None) -> None:
    """Megatron's load_checkpoint side effects on ``args``; ``override_iteration``
    (--override-ckpt-iteration, core_v0.19): the samples consumed by that iteration instead, as Megatron
    recomputes them, refused when the global batch size changed."""
    if finetune:
        args.finetune = True  # also when --pretrained-checkpoint made it a fine-tune, as Megatron does
        return
    args.consumed_train_samples = state.consumed_train_samples
    args.skipped_train_samples = state.skipped_train_samples
    if override_iteration is not None:
        saved_batch = (state.args or {}).get("global_batch_size")
        if saved_batch is not None and saved_batch != args.global_batch_size:
            raise CheckpointError(
                "--override-ckpt-iteration recomputes consumed_train_samples from the target iteration and current "
                f"global_batch_size, but checkpoint global_batch_size ({saved_batch}) != current global_batch_size "
                f"({args.global_batch_size}). This would replay the data loader from the wrong sample offset.")
        args.consumed_train_samples = override_iteration * args.global_batch_size
        args.skipped_train_samples = 0
    args.consumed_valid_samples = state.consumed_valid_samples
    try:
        from megatron.core.num_microbatches_calculator import update_num_microbatches

        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)
    except (ImportError, AssertionError):
        pass  # no calculator configured (a bare test harness)
