"""Megatron-LM's checkpoint entry points, backed by the megatron-pec engine.

Same signatures, return values and ``args`` side effects as
``megatron.training.checkpointing`` of every supported Megatron-LM release (core_v0.16.1 to
core_v0.19.0; the keywords added since 0.16.1 are accepted and honoured). Every rank calls them.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys

from megatron_pec.common import log
from megatron_pec.common.errors import CheckpointError
from megatron_pec.config import this_launch
from megatron_pec.format.checkpoint_paths import absolute
from megatron_pec.integrity import run_sums

_fallback_args = None
_engine = None
run_sums.preload(this_launch().local_rank)  # (imported at the trainer's start: the checksum kernel loads meanwhile)
_crashed = False  # an uncaught exception is ending this process (see _close_at_exit)


def use_args(args) -> None:
    """Give megatron-pec the training arguments when Megatron-LM's ``get_args()`` is not set up."""
    global _fallback_args
    _fallback_args = args


def _args():
    if _fallback_args is not None:
        return _fallback_args
    from megatron_pec.megatron.adapter import training_args

    args = training_args()
    if args is None:
        raise CheckpointError("no training arguments: run under Megatron-LM's pretrain() or call "
                              "megatron_pec.use_args(args) before the first load/save")
    return args


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _megatron_own(name: str, why: str, **kwargs):
    """Megatron-LM's own ``name`` (save_checkpoint / load_checkpoint) for a call megatron-pec does not
    serve (``why``), with the keywords that release accepts."""
    from megatron_pec.megatron.adapter import megatron_checkpoint_function

    own = megatron_checkpoint_function(name)
    if own is None:
        raise CheckpointError(f"{name} {why}, which megatron-pec does not serve, and Megatron-LM's "
                              "own megatron.training.checkpointing is not importable here to serve it")
    accepted = inspect.signature(own).parameters
    dropped = sorted(k for k, v in kwargs.items() if k not in accepted and v not in (None, "", False))
    if dropped:
        raise CheckpointError(f"Megatron-LM's own {name} does not accept {dropped}")
    log.info(f"{name} {why}: using Megatron-LM's own {name}", once=True, rank0=True)
    return own(**{k: v for k, v in kwargs.items() if k in accepted})


def _converting(args) -> str | None:
    """The format of Megatron's ``--ckpt-convert-format`` save in progress: training.py then points
    --save at <--ckpt-convert-save>/<format> and saves once, to be read by Megatron itself."""
    fmt, target = getattr(args, "ckpt_convert_format", None), getattr(args, "ckpt_convert_save", None)
    save = getattr(args, "save", None)
    if fmt and target and save and absolute(save) == absolute(os.path.join(target, fmt)):
        return fmt
    return None


def _get_engine(model, optimizer):
    global _engine
    if _engine is None or _engine.optimizer is not optimizer:
        from megatron_pec.engine import Engine

        if _engine is not None:
            _engine.close()
        from megatron_pec.config import PecConfig
        from megatron_pec.store.storage import open_storage

        args = _args()
        try:  # the job's one storage; its description travels to the node agent in the job description
            storage = open_storage(PecConfig.storage_spec(args))
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        _engine = Engine(args, _chunks(model), optimizer, storage)
        if not getattr(sys.excepthook, "megatron_pec", False):
            sys.excepthook = _recording_crash(sys.excepthook)
        atexit.register(_close_at_exit, _engine)
    return _engine


def _recording_crash(previous):
    def excepthook(*exc_info):
        global _crashed
        _crashed = True
        previous(*exc_info)

    excepthook.megatron_pec = True
    return excepthook


def _keeping_memory_on_error(entry_point):
    """A CheckpointError ends the process through SystemExit, which bypasses sys.excepthook:
    record it as a crash too, so that exit keeps the node memory for the corrected restart."""
    @functools.wraps(entry_point)
    def wrapper(*args, **kwargs):
        global _crashed
        try:
            return entry_point(*args, **kwargs)
        except CheckpointError:
            _crashed = True
            raise
    return wrapper


def _close_at_exit(engine) -> None:
    # A trainer that dies of an exception (e.g. a peer node vanished mid-collective) must not
    # detach "cleanly": the agent would then exit and delete the node memory the restart needs.
    engine.close(detach=not _crashed)


@_keeping_memory_on_error
def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far=0,
                    checkpointing_context=None, pipeline_rank=None, expert_rank=None, tensor_rank=None,
                    pipeline_parallel=None, expert_parallel=None, non_persistent_ckpt=False,
                    train_data_iterator=None, preprocess_common_state_dict_fn=None, release=False,
                    tp_group=None, pp_group=None, dp_cp_group=None, dp_group=None, expt_dp_group=None,
                    rng_state_key_prefix=""):
    """Snapshot this rank's state to node memory; persistent saves are also persisted by the agent.

    Returns once the snapshot is in memory; persisting and committing continue
    in the node agent.
    """
    fmt = _converting(_args()) if optimizer is not None else None
    if optimizer is None or fmt:
        why = f"converts to --ckpt-convert-format {fmt}" if fmt else "was called without an optimizer"
        return _megatron_own(
            "save_checkpoint", why, iteration=iteration, model=model, optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler,
            num_floating_point_operations_so_far=num_floating_point_operations_so_far,
            checkpointing_context=checkpointing_context, pipeline_rank=pipeline_rank, expert_rank=expert_rank,
            tensor_rank=tensor_rank, pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
            non_persistent_ckpt=non_persistent_ckpt, train_data_iterator=train_data_iterator,
            preprocess_common_state_dict_fn=preprocess_common_state_dict_fn, release=release, tp_group=tp_group,
            pp_group=pp_group, dp_cp_group=dp_cp_group, dp_group=dp_group, expt_dp_group=expt_dp_group,
            rng_state_key_prefix=rng_state_key_prefix)
    if release:
        raise CheckpointError("release checkpoints are not supported; convert a committed "
                              "iteration with Megatron's own tools")
    engine = _get_engine(model, optimizer)
    engine.adapter.check_groups(tp=tp_group, pp=pp_group, dp_cp=dp_cp_group, dp=dp_group, expt_dp=expt_dp_group)
    engine.save(iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                persistent=not non_persistent_ckpt, rng_key_prefix=rng_state_key_prefix,
                data_iterator=train_data_iterator)


@_keeping_memory_on_error
def load_checkpoint(ddp_model=None, optimizer=None, opt_param_scheduler=None, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None, pp_group=None,
                    dp_cp_group=None, dp_group=None, expt_dp_group=None, rng_state_key_prefix="", model=None):
    """Restore the newest iteration every rank can restore; returns ``(iteration, flops)``, ``(0, 0)`` if none.

    Also starts the node agent and allocates the snapshot slots, so the first
    save costs no more than later ones.
    """
    ddp_model = ddp_model if ddp_model is not None else model
    if optimizer is None:
        return _megatron_own(
            "load_checkpoint", "was called without an optimizer", ddp_model=ddp_model, optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler, load_arg=load_arg, strict=strict,
            checkpointing_context=checkpointing_context,
            skip_load_to_model_and_opt=skip_load_to_model_and_opt, tp_group=tp_group, pp_group=pp_group,
            dp_cp_group=dp_cp_group, dp_group=dp_group, expt_dp_group=expt_dp_group,
            rng_state_key_prefix=rng_state_key_prefix)
    if skip_load_to_model_and_opt:
        raise CheckpointError("skip_load_to_model_and_opt (Megatron FSDP) is not supported")
    engine = _get_engine(ddp_model, optimizer)
    engine.adapter.check_groups(tp=tp_group, pp=pp_group, dp_cp=dp_cp_group, dp=dp_group, expt_dp=expt_dp_group)
    root = getattr(_args(), load_arg, None)
    pretrained = getattr(_args(), "pretrained_checkpoint", None) if load_arg == "load" else None
    if not root and not pretrained:
        return 0, 0
    found = engine.megatron_checkpoint(root) if root else None
    if found:
        from megatron_pec.megatron.adapter import megatron_checkpoint_function

        if megatron_checkpoint_function("load_checkpoint") is None:
            raise CheckpointError(
                f"--{load_arg} {root} holds {found}: it is not a megatron-pec checkpoint. megatron-pec "
                "switches a job to its format only inside Megatron-LM, whose own loader reads Megatron's formats; "
                "here, point --load at a megatron-pec checkpoint or at an empty directory")
        # Switching a job to megatron-pec: Megatron's own loader reads its format, megatron-pec saves on.
        iteration, flops = _megatron_own(
            "load_checkpoint", f"found {found} under --{load_arg} {root} and no megatron-pec checkpoint (switching "
            "to megatron-pec: every later save is megatron-pec's)", ddp_model=ddp_model, optimizer=optimizer,
            opt_param_scheduler=opt_param_scheduler, load_arg=load_arg, strict=strict,
            checkpointing_context=checkpointing_context, tp_group=tp_group, pp_group=pp_group,
            dp_cp_group=dp_cp_group, dp_group=dp_group, expt_dp_group=expt_dp_group,
            rng_state_key_prefix=rng_state_key_prefix)
        engine.adopt(iteration)
        return iteration, flops
    return engine.load(root, opt_param_scheduler, rng_key_prefix=rng_state_key_prefix, pretrained=pretrained)


@_keeping_memory_on_error
def prepare(model, optimizer) -> None:
    """Set everything up now (collective): slot files, their page-locking on a GPU, the node agent.
    ``load_checkpoint`` does it too; a job that starts without ``--load`` calls this before training
    so that its first save costs no more than later ones."""
    _get_engine(model, optimizer)


def current_engine():
    """This process's engine (built by the first save, load or ``prepare``), None before: for tests and
    tools that look inside a running trainer."""
    return _engine


def reset() -> None:
    """Close this process's engine (what the end of training does) and forget it: the next save, load or
    ``prepare`` builds a new one."""
    global _engine
    if _engine is not None:
        _engine.close()
    _engine = None


def plt_so_far() -> float:
    """Accumulated portion of lost tokens of this run (0.0 before any recovery)."""
    return _engine.book.state.plt if _engine is not None else 0.0


def node_memory() -> dict | None:
    """This rank's node memory as planned at start-up (``budget.MemorySizing``): bytes of its own files and of
    its share of the node's replicas, its state, and the snapshot K they hold; None before the engine."""
    plan = _engine.memory_sizing if _engine is not None else None
    if plan is None:
        return None
    return {"own_bytes": plan.own, "replica_bytes": plan.replica_share, "state_bytes": plan.state,
            "ratio": round(plan.total / plan.state, 4), "snapshot_k": plan.k, "asked_k": plan.asked_k}


def saved_state_kinds() -> list[str]:
    """The kinds of state every save of this process keeps (``model_params``, ``optimizer``, ``scheduler``,
    ``rng``, ``counters``, ``checkpoint_args``, ``buffers``, ``frozen_params``, ``extra_state``,
    ``grad_scaler``, ``rerun_state_machine``, ``dataloader``: those this model and these flags have), as
    the start-up line lists them; empty before the engine."""
    return [kind for kind, _ in _engine.adapter.state_kinds()] if _engine is not None else []


def last_save_phases() -> dict[str, float]:
    """Where this rank's latest save spent its blocking time: seconds by phase (``common/phases.py``;
    empty before the first save)."""
    return dict(_engine.save_phases.seconds) if _engine is not None else {}
