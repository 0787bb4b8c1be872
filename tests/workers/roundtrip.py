"""Bit-exact round trip through node memory and through storage on real megatron-core (EP=2, DP=2).

argv: SAVE_DIR SHM_DIR [extra example flags...]. Reports, per rank, what matched.
"""

import random
import shutil
import sys

import numpy
import torch
from common import report, setup, train

import megatron_pec
from megatron_pec import api
from megatron_pec.format import small_state
from megatron_pec.megatron import collect, optstate, restore
from megatron_pec.restore import sources as restore_sources
from megatron_pec.testing import launch

N = 6  # persistent save here; memory snapshots at every iteration before it
MORE = 3


def capture(args, model, optimizer, scheduler):
    from megatron.core import tensor_parallel

    live = collect.live_views(api.current_engine().adapter.slices, optimizer)
    return {
        "slices": {k: v.clone() for k, v in live.items()},
        "params": {n: p.detach().clone() for n, p in model[0].named_parameters()},
        "torch_rng": torch.get_rng_state().clone(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
        "random": random.getstate(),
        "numpy": numpy.random.get_state()[1].copy(),
        "scheduler": scheduler.state_dict(),
        "param_groups": [o.state_dict()["optimizer"]["param_groups"] for o in optimizer.chained_optimizers],
        "consumed": args.consumed_train_samples,
    }


def differences(a, b) -> list[str]:
    bad = [f"slice {k}" for k in a["slices"] if not torch.equal(a["slices"][k], b["slices"][k])]
    bad += [f"param {k}" for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    bad += [k for k in ("torch_rng",) if not torch.equal(a[k], b[k])]
    bad += [f"tracker {k}" for k in a["tracker"] if not torch.equal(a["tracker"][k], b["tracker"][k])]
    bad += ["numpy"] if not numpy.array_equal(a["numpy"], b["numpy"]) else []
    bad += [f"{k}: {a[k]} != {b[k]}" for k in ("random", "scheduler", "param_groups", "consumed") if a[k] != b[k]]
    return bad


def optimizer_structure(optimizer) -> list:
    """Every param's optimizer state (keys; each tensor's dtype, shape, device, and the step's value),
    whether every param has a step tensor of its own, and the param groups' hyperparameters."""
    out = []
    for o in optimizer.chained_optimizers:
        params = [p for g in o.optimizer.param_groups for p in g["params"]]
        states = [[(k, str(v.dtype), list(v.shape), v.device.type, v.item() if k == "step" else None)
                   for k, v in sorted(o.optimizer.state[p].items())] for p in params]
        out.append({"groups": repr([{k: v for k, v in g.items() if k != "params"} for g in o.optimizer.param_groups]),
                    "states": states, "own_steps": len({id(o.optimizer.state[p]["step"]) for p in params})
                    == len(params)})
    return out


def moments(optimizer) -> dict:
    """How many tensors and how many storages hold the moments."""
    tensors = [t for o in optimizer.chained_optimizers for state in o.optimizer.state.values()
               for k, t in state.items() if k.startswith("exp_avg")]
    return {"moment_tensors": len(tensors), "moment_storages": len({t.untyped_storage().data_ptr() for t in tensors})}


def copies(engine, optimizer) -> dict:
    """How a full save copies (slices, coalesced runs) and how many storages hold the moments."""
    items = dict.fromkeys(s.item for s in engine.adapter.slot_slices)
    return {"slices": len(engine.adapter.slot_slices), "runs": sum(len(engine.stager.runs_of(i)) for i in items),
            **moments(optimizer)}


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "20", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "rt"]
        + sys.argv[3:])
    fresh = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    in_place = []  # whether each restore set the optimizer's hyperparameters and step in place
    load_in_place = restore._load_in_place
    restore._load_in_place = lambda *a: in_place.append(load_in_place(*a)) or in_place[-1]
    data = data_from(0)
    for i in range(1, N + 1):
        train(args, model, optimizer, scheduler, data, 1)
        if i == 1:
            live = collect.live_views(api.current_engine().adapter.slices, optimizer)
            before = {k: v.clone() for k, v in live.items()}
        megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 100.0 * i, non_persistent_ckpt=i != N)
        if i == 1:  # the first save placed the moments contiguously: same values, fewer tensors
            placed = collect.live_views(api.current_engine().adapter.slices, optimizer)
            unchanged = all(torch.equal(before[k], placed[k]) for k in before)
    at_n = capture(args, model, optimizer, scheduler)
    save_phases = dict(api.current_engine().save_phases.seconds)  # (the last save's: persistent)
    # Every save asked the optimizer's state_dict with one parameter per group, checked once
    # against the full one: check it again here, after training, on this megatron-core.
    trimmed_state = api.current_engine().adapter.optimizer_state
    with optstate._one_param_per_group(collect.distributed_optimizers(optimizer)):
        trimmed = small_state.dumps(optimizer.state_dict())
    full = small_state.dumps(optimizer.state_dict())
    from_groups = small_state.dumps(optstate._from_groups(optimizer, collect.distributed_optimizers(optimizer)))
    state_dict = {"trimmed_used": trimmed_state.trimmed_ok, "same": trimmed == full,
                  "from_groups_used": trimmed_state.from_groups_ok, "from_groups_same": from_groups == full,
                  "largest_group": max(len(g["params"]) for o in optimizer.chained_optimizers
                                       for g in o.optimizer.param_groups)}
    reference = train(args, model, optimizer, scheduler, data, MORE)
    result = {"fresh": list(fresh), "reference": reference, "state_dict": state_dict,
              "coalesced": {"unchanged": unchanged, **copies(api.current_engine(), optimizer)}}

    landings = []  # (tensors read straight into the live state, tensors kept in a buffer) per rank file read
    land = restore_sources.land_rank_file

    def counted(*args):
        landed, kept = land(*args)
        landings.append((len(landed), len(kept)))
        return landed, kept

    restore_sources.land_rank_file = counted
    for leg in ("memory", "storage"):
        if leg == "storage":
            engine = api.current_engine()
            engine.flush()  # iteration N is committed before its slot is released
            torch.distributed.barrier()
            if engine.job.local_world_size == 1 or torch.distributed.get_rank() == 0:
                launch.stop_agents(engine.job.node_dir)
                shutil.rmtree(engine.job.node_dir)
            torch.distributed.barrier()
        loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
        after = capture(args, model, optimizer, scheduler)
        resumed = train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), MORE)
        result[leg] = {"returned": list(loaded), "differences": differences(at_n, after), "losses": resumed,
                       "phases": list(api.current_engine().restore_phases.seconds)}
    result["save_phases"] = save_phases
    # A restart's optimizer has no state yet: the restore allocates it without Megatron's load_state_dict
    # (torch's is quadratic in the params), leaving exactly what that would have left.
    structures, allocated = {}, {}
    for leg, megatron_path in (("restart", False), ("restart, Megatron's load_state_dict", True)):
        restore.clear_optimizer_state(optimizer)
        api.current_engine().adapter.state_replaced()
        recording = restore._load_in_place
        if megatron_path:
            restore._load_in_place = lambda *a: False
        else:  # (how the fresh moments were allocated: before anything placed them)
            restore._load_in_place = lambda *a, recording=recording: (
                recording(*a), allocated.update(moments(optimizer)))[0]
        loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
        restore._load_in_place = recording
        after = capture(args, model, optimizer, scheduler)
        structures[leg] = optimizer_structure(optimizer)
        resumed = train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), MORE)
        result[leg] = {"returned": list(loaded), "differences": differences(at_n, after), "losses": resumed}
    result["fresh_structure"] = {"same": structures["restart"] == structures["restart, Megatron's load_state_dict"],
                                 "own_steps": all(o["own_steps"] for o in structures["restart"])}
    result["fresh_moments"] = allocated
    result["in_place"] = in_place
    result["landings"] = landings
    # fp32 training: each main-param shard views its model param, so a restore skips Megatron's copy of
    # one onto the other (the losses after every restore above say the model params were right)
    result["main_params_are_model_params"] = [restore._main_params_are_model_params(o)
                                              for o in collect.distributed_optimizers(optimizer)]
    report("roundtrip", result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
