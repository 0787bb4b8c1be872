"""A persistent save before the optimizer's first step (fp16 loss scaling skips the first steps,
``--skip-train`` saves at once), restored from memory and from storage; argv: SAVE_DIR SHM_DIR [flags].
Reports per rank whether the weights came back and whether training then repeats the reference."""

import shutil
import sys

import torch
from common import report, setup
from roundtrip import train

import megatron_pec
from megatron_pec import api
from megatron_pec.testing import launch


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "20", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "b1"]
        + sys.argv[3:])
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    megatron_pec.save_checkpoint(1, model, optimizer, scheduler, 0.0)  # no optimizer step yet
    weights = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    reference = train(args, model, optimizer, scheduler, data_from(0), 3)
    result = {"reference": reference}
    for leg in ("memory", "storage"):
        if leg == "storage":
            engine = api.current_engine()
            engine.flush()
            torch.distributed.barrier()
            if engine.job.local_world_size == 1 or torch.distributed.get_rank() == 0:
                launch.stop_agents(engine.job.node_dir)
                shutil.rmtree(engine.job.node_dir)
            torch.distributed.barrier()
        args.consumed_train_samples = 12345  # the restore must set it back
        loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
        same = all(torch.equal(weights[n], p) for n, p in model[0].named_parameters())
        losses = train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), 3)
        result[leg] = {"returned": list(loaded), "weights_equal": same, "losses": losses}
    report("before_first_step", result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
