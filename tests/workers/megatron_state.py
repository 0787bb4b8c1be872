"""Megatron's state beyond model and optimizer, through node memory and storage on real megatron-core
(2 ranks, EP=2): the fp16 grad scaler saved before the first optimizer step, the rerun state machine as the
installed release saves it, --override-ckpt-iteration.

argv: SAVE_DIR SHM_DIR. Reports, per rank, what came back.
"""

import shutil
import sys

import torch
from common import report, setup, train

import megatron_pec
from megatron_pec import api
from megatron_pec.format import small_state
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.megatron import collect
from megatron_pec.testing import launch


def scaler_state(optimizer) -> list:
    return [small_state.dumps(o.grad_scaler.state_dict()) for o in collect.distributed_optimizers(optimizer)]


def rerun_view(machine) -> dict:
    return {"mode": str(machine.mode), "state": str(machine.state), "iteration": machine.current_iteration,
            "checkpoint_requested": machine.checkpoint_requested, "call": repr(machine.failed_validation_call),
            "call_type": type(machine.failed_validation_call).__name__,
            "initial_result": repr(machine.initial_result), "max_values": machine.max_values,
            "large_value_counts": machine.large_value_counts,
            "iterators": small_state.dumps(getattr(machine, "data_iterator_checkpoints", None))}


def fresh_machine(rsm, mode) -> None:
    """A new rerun state machine, as a restarted process's (megatron-core creates one implicitly when asked)."""
    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=mode)


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "20", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "mstate"])
    from megatron.core import rerun_state_machine as rsm

    fresh_machine(rsm, rsm.RerunMode.VALIDATE_RESULTS)  # (as Megatron-LM's initialize does, before the model)
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result = {}

    # 1. fp16's grad scaler, before the first optimizer step (Megatron's optimizer state_dict needs a step then).
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    optimizers = collect.distributed_optimizers(optimizer)
    for o in optimizers:
        o.grad_scaler = DynamicGradScaler(initial_scale=2.0**16, min_scale=1.0, growth_factor=2.0,
                                          backoff_factor=0.5, growth_interval=10, hysteresis=2)
        for found_inf in (True, True, True, False):  # (the warm-up: scale and trackers moved)
            o.grad_scaler.update(found_inf)
    saved = scaler_state(optimizer)
    megatron_pec.save_checkpoint(1, model, optimizer, scheduler, 0, non_persistent_ckpt=True)
    result["kinds"] = megatron_pec.saved_state_kinds()
    for o in optimizers:
        o.grad_scaler.update(True)
    changed = scaler_state(optimizer) != saved
    loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result["scaler"] = {"changed": changed, "restored": scaler_state(optimizer) == saved, "loaded": list(loaded)}
    for o in optimizers:
        o.grad_scaler = None

    # 2. the rerun state machine, as this release's save_checkpoint keeps it.
    fresh_machine(rsm, rsm.RerunMode.VALIDATE_RESULTS)
    machine = rsm.get_rerun_state_machine()
    data = data_from(0)
    train(args, model, optimizer, scheduler, data, 2)
    megatron_pec.save_checkpoint(2, model, optimizer, scheduler, 0, non_persistent_ckpt=True)
    idle = SmallState.loads(api.current_engine().history.small.text).rerun_state_machine
    result["saved_while_idle"] = idle is not None
    # a rerun pending (as a checkpoint-and-exit for fault attribution leaves it), its micro-batches saved
    iterator = rsm.RerunDataIterator(iter([]))
    iterator.saved_microbatches = [{"tokens": torch.arange(6).view(2, 3)}, {"tokens": torch.arange(6, 12).view(2, 3)}]
    machine.state = rsm.RerunState.WILL_RERUN_FROM_CHECKPOINT
    machine.current_iteration = 3
    machine.checkpoint_requested = True
    machine.failed_validation_call = rsm.Call(rsm.Caller(message="loss is NaN", rank=0), 4)
    machine.initial_result = torch.tensor(1.25)
    machine.max_values = {"loss": 7.5}
    machine.large_value_counts = {"loss": 2}
    train(args, model, optimizer, scheduler, data, 1)
    megatron_pec.save_checkpoint(3, model, optimizer, scheduler, 0, train_data_iterator=iterator)
    before = rerun_view(machine)
    # (what Megatron's load restores: the saved iterators' checkpoints, kept for the data loader's rebuild)
    before["iterators"] = small_state.dumps([iterator.state_dict()])
    for leg in ("memory", "storage"):
        if leg == "storage":
            engine = api.current_engine()
            engine.flush()
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                launch.stop_agents(engine.job.node_dir)
                shutil.rmtree(engine.job.node_dir)
            torch.distributed.barrier()
        fresh_machine(rsm, rsm.RerunMode.VALIDATE_RESULTS)
        loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
        after = rerun_view(rsm.get_rerun_state_machine())
        result[f"rerun_{leg}"] = {"loaded": list(loaded),
                                  "differences": sorted(k for k in before if before[k] != after[k]),
                                  "after": after}
    result["rerun_before"] = before

    # 3. --override-ckpt-iteration (core_v0.19): iteration and consumed samples as if the checkpoint were there.
    fresh_machine(rsm, rsm.RerunMode.DISABLED)
    args.override_ckpt_iteration = 2
    loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result["override"] = {"loaded": list(loaded), "consumed": args.consumed_train_samples,
                          "skipped": args.skipped_train_samples}
    args.override_ckpt_iteration = None

    # 4. --dataloader-save: each persistent save (not a memory snapshot) hands the train iterator to Megatron-LM's
    # own maybe_save_dataloader_state (here a stand-in module: Megatron-LM's training package is not installed).
    import types

    calls = []
    checkpointing = types.ModuleType("megatron.training.checkpointing")
    checkpointing.maybe_save_dataloader_state = lambda it, iteration, path: calls.append((it is data, iteration, path))
    training = types.ModuleType("megatron.training")
    training.checkpointing = checkpointing
    sys.modules.update({"megatron.training": training, "megatron.training.checkpointing": checkpointing})
    args.dataloader_save = "/dataloader/state"
    train(args, model, optimizer, scheduler, data, 1)
    megatron_pec.save_checkpoint(3, model, optimizer, scheduler, 0, train_data_iterator=data, non_persistent_ckpt=True)
    train(args, model, optimizer, scheduler, data, 1)
    megatron_pec.save_checkpoint(4, model, optimizer, scheduler, 0, train_data_iterator=data)
    result["dataloader"] = calls
    report("mstate", result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
