"""Saves on one data-parallel layout or restores onto another, and writes this rank's optimizer shards
in global coordinates (parameter name, kind, element range) for the resharding test.

argv: SAVE_DIR SHM_DIR JOB_ID save|restore [extra example flags...]. ``save`` trains N iterations
(persistent saves at 2 and N), dumps its shards, then trains MORE iterations (the uninterrupted losses);
``restore`` loads, dumps its shards, saves the restored iteration again on the new layout (the same
state: nothing may be written over the committed files), then trains MORE iterations.
"""

import os
import sys

import torch
from common import report, setup, train, write_safetensors

import megatron_pec
from megatron_pec import api
from megatron_pec.megatron import collect

N, MORE = 4, 2


def dump(path: str) -> None:
    """This rank's live slices, named ``<global param>#<kind>#<first element>``."""
    engine = api.current_engine()
    live = collect.live_views(engine.adapter.slices, engine.optimizer)
    layout = engine.job.layout
    write_safetensors(path, {f"{layout.params[p].name}#{name.rsplit('.', 1)[1]}#{lo}": live[name]
                             for name, (p, lo, hi) in layout.slices.items()})


def main():
    save, shm, job, mode = sys.argv[1:5]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "20", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", job]
        + sys.argv[5:])
    loaded = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    rank, out = torch.distributed.get_rank(), os.environ["PEC_TEST_OUT"]
    if mode == "save":
        data = data_from(0)
        for i in range(1, N + 1):
            train(args, model, optimizer, scheduler, data, 1)
            megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0.0, non_persistent_ckpt=i % 2 == 1)
        api.current_engine().flush()
        dump(os.path.join(out, f"{job}.rank{rank}.safetensors"))
        losses = train(args, model, optimizer, scheduler, data, MORE)
    else:
        dump(os.path.join(out, f"{job}.rank{rank}.safetensors"))
        megatron_pec.save_checkpoint(N, model, optimizer, scheduler, 0.0)
        losses = train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), MORE)
        torch.distributed.barrier()
        megatron_pec.save_checkpoint(N + MORE, model, optimizer, scheduler, 0.0)  # the new layout saves on
        api.current_engine().flush()
    report(job, {"loaded": list(loaded), "losses": losses, "consumed": args.consumed_train_samples})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
