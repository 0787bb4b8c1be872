"""megatron-pec, partial-experts flash checkpoints for Megatron MoE training.

Public surface: ``save_checkpoint`` and ``load_checkpoint`` (drop-in for
``megatron.training.checkpointing``, tag core_v0.16.1 signatures), ``add_pec_args``
(the ``--pec-*`` flags; usable as Megatron's ``extra_args_provider``), and
``use_args`` for training loops that do not use Megatron-LM's global args.

Heavy modules are imported on first use, so ``python -m megatron_pec agent``
starts without torch or Megatron.
"""

from megatron_pec.config import add_pec_args

__all__ = ["save_checkpoint", "load_checkpoint", "prepare", "add_pec_args", "use_args", "plt_so_far",
           "last_save_phases", "node_memory", "saved_state_kinds"]


def __getattr__(name):
    if name in ("save_checkpoint", "load_checkpoint", "prepare", "use_args", "plt_so_far", "last_save_phases",
                "node_memory", "saved_state_kinds"):
        from megatron_pec import api

        return getattr(api, name)
    raise AttributeError(f"module 'megatron_pec' has no attribute {name!r}")
