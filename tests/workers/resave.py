"""Saving an iteration that is already committed never changes its files: a second persistent save of it
by the same process writes every expert under new names, the manifest the only switch; the old files go once
nothing references them; a save right after a restore of it saves nothing; a restore reads the last save
exactly.

argv: SAVE_DIR SHM_DIR. Snapshot-K 2, persist-K 1 of 8 experts; 4 committed, saved again, restored from memory
and saved once more.
"""

import hashlib
import os
import shutil
import sys

import torch
from common import checkpoints, example, report, setup

import megatron_pec
from megatron_pec import api
from megatron_pec.megatron import collect
from megatron_pec.testing import launch


def digests(save: str) -> dict[str, str]:
    pec = checkpoints(save).pec_dir(4)
    return {f: hashlib.sha256(open(os.path.join(pec, f), "rb").read()).hexdigest() for f in sorted(os.listdir(pec))}


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "10", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "resave",
         "--pec-snapshot-k", "2", "--pec-persist-k", "1", "--pec-keep", "0", "--pec-wait-for-slot"])
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    data = data_from(0)
    for i in range(1, 5):
        example.train_step(args, model, optimizer, scheduler, data)
        args.consumed_train_samples += args.global_batch_size
        megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0, non_persistent_ckpt=i != 4)
    engine = api.current_engine()
    engine.flush()
    torch.distributed.barrier()
    first = checkpoints(save).read_manifest(4)
    before = digests(save)
    megatron_pec.save_checkpoint(4, model, optimizer, scheduler, 0, non_persistent_ckpt=False)  # (no step since)
    engine.flush()
    torch.distributed.barrier()
    second = checkpoints(save).read_manifest(4)
    after = digests(save)
    iteration, _ = megatron_pec.load_checkpoint(model, optimizer, scheduler)  # from node memory
    megatron_pec.save_checkpoint(iteration, model, optimizer, scheduler, 0, non_persistent_ckpt=False)
    engine.flush()
    torch.distributed.barrier()
    untouched = digests(save) == after and checkpoints(save).read_manifest(4).generation == second.generation
    live = {k: v.clone() for k, v in collect.live_views(engine.adapter.slices, optimizer).items()}
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # node memory gone: the next restore reads storage
        launch.stop_agents(engine.job.node_dir)
        shutil.rmtree(engine.job.node_dir)
    torch.distributed.barrier()
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    restored = collect.live_views(api.current_engine().adapter.slices, optimizer)
    report("resave", {
        "restored_from_memory": iteration, "generations": [first.generation, second.generation],
        "saved_nothing_after_the_restore": untouched,
        "at_4": [sum(v == 4 for v in m.experts.values()) for m in (first, second)],
        # every file of the first save that still exists has its bytes; the new save's files are new names
        "changed": sorted(f for f in before if f in after and after[f] != before[f]),
        "first_files": sorted({os.path.basename(e.file) for e in first.ranks.values()}),
        "second_files": sorted({os.path.basename(e.file) for e in second.ranks.values()}),
        "referenced": sorted({os.path.basename(e.file) for e in second.ranks.values()}
                             | {os.path.basename(e.file) for files in second.sources.values() for e in files.values()
                                if os.path.dirname(e.file) == os.path.relpath(checkpoints(save).pec_dir(4), save)}),
        "left": sorted(after),
        "differences": sorted(k for k, v in live.items() if not torch.equal(restored[k], v))})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
