"""Megatron-LM's checkpoint entry points, backed by the megatron-pec engine.

Same signatures, return values and ``args`` side effects as
``megatron.training.checkpointing`` at tag core_v0.16.1. Every rank calls them.
"""

from __future__ import annotations

import atexit
import functools
import sys

from megatron_pec.errors import CheckpointError

_fallback_args = None
_engine = None
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
        raise CheckpointError("megatron-pec: no training arguments: run under Megatron-LM's pretrain() or call "
                              "megatron_pec.use_args(args) before the first load/save")
    return args


def _chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _get_engine(model, optimizer):
    global _engine
    if optimizer is None:
        raise CheckpointError("megatron-pec: checkpointing needs the optimizer (it stores the distributed "
                              "optimizer's shards); loading without an optimizer is not supported")
    if _engine is None or _engine.optimizer is not optimizer:
        from megatron_pec.engine import Engine

        if _engine is not None:
            _engine.close()
        _engine = Engine(_args(), _chunks(model), optimizer)
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
                    tp_group=None, pp_group=None, dp_cp_group=None):
    """Snapshot this rank's state to node memory; persistent saves are also persisted by the agent.

    Returns once the snapshot is in memory; persisting and committing continue
    in the node agent.
    """
    if release:
        raise CheckpointError("megatron-pec: release checkpoints are not supported; convert a committed "
                              "iteration with Megatron's own tools")
    engine = _get_engine(model, optimizer)
    engine.save(iteration, opt_param_scheduler, num_floating_point_operations_so_far,
                persistent=not non_persistent_ckpt)


@_keeping_memory_on_error
def load_checkpoint(ddp_model=None, optimizer=None, opt_param_scheduler=None, load_arg="load", strict=True,
                    checkpointing_context=None, skip_load_to_model_and_opt=False, tp_group=None, pp_group=None,
                    dp_cp_group=None, model=None):
    """Restore the newest iteration every rank can restore; returns ``(iteration, flops)``, ``(0, 0)`` if none.

    Also starts the node agent and allocates the snapshot slots, so the first
    save costs no more than later ones.
    """
    ddp_model = ddp_model if ddp_model is not None else model
    if skip_load_to_model_and_opt:
        raise CheckpointError("megatron-pec: skip_load_to_model_and_opt (Megatron FSDP) is not supported")
    engine = _get_engine(ddp_model, optimizer)
    root = getattr(_args(), load_arg, None)
    if not root:
        return 0, 0
    return engine.load(root, opt_param_scheduler)


def plt_so_far() -> float:
    """Accumulated portion of lost tokens of this run (0.0 before any recovery)."""
    return _engine.pec.plt if _engine is not None else 0.0
