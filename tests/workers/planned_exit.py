"""A planned exit right after a skipped snapshot loses nothing: the trainer saves that iteration once more,
whole, before it detaches; the restart restores it with PLT 0 and every slice as it was at exit.

argv: SAVE_DIR SHM_DIR. Snapshot-K 2, persist-K 1 of 8 experts; persisted at 4; the snapshot of 6 is skipped
(this worker takes its home slot away on rank 0).
"""

import os
import sys
import time

import torch
from common import checkpoints, example, report, setup

import megatron_pec
from megatron_pec import api
from megatron_pec.megatron import collect


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "10", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "exit",
         "--pec-snapshot-k", "2", "--pec-persist-k", "1", "--pec-wait-for-slot"])
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    data = data_from(0)
    engine = api.current_engine()
    for i in range(1, 7):
        example.train_step(args, model, optimizer, scheduler, data)
        args.consumed_train_samples += args.global_batch_size
        if i == 6 and torch.distributed.get_rank() == 0:
            engine.session.lease = lambda persistent: (None, "this test holds every region")
        megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0, non_persistent_ckpt=i != 4)
    at_exit = {k: v.clone() for k, v in collect.live_views(engine.adapter.slices, optimizer).items()}
    engine.wait_for_saves()  # (a save is counted skipped once the hand-over has the agreement's result)
    skipped = engine.stats["skipped"]
    vars(engine.session).pop("lease", None)  # the class's own again: the exit's save leases as any save
    pid_file = os.path.join(engine.job.node_dir, "agent.pid")
    api.reset()  # what the end of training does (atexit)
    torch.distributed.barrier()
    deadline = time.monotonic() + 60
    while os.path.exists(pid_file) and time.monotonic() < deadline:  # the agent commits, cleans up, exits
        time.sleep(0.1)
    torch.distributed.barrier()
    iteration, _ = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    live = collect.live_views(api.current_engine().adapter.slices, optimizer)
    m = checkpoints(save).read_manifest(6)
    report("exit", {"skipped": skipped, "committed": checkpoints(save).committed_iterations(),
                    "generation": m.generation, "experts": sorted(set(m.experts.values())),
                    "plt": api.current_engine().book.state.plt, "iteration": iteration,
                    "differences": sorted(k for k, v in at_exit.items() if not torch.equal(live[k], v))})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
