"""PEC restore correctness on real megatron-core: every slice equals its state at its version,
PLT equals the value recomputed from the recorded token counts, Dynamic-K doubles K.

argv: SAVE_DIR SHM_DIR. Snapshot-K 2, persist-K 1 of 8 experts; persist every 4 iterations; the example's
hidden size 64.
"""

import shutil
import sys

import torch
from common import checkpoints, example, report, setup

import megatron_pec
from megatron_pec import api
from megatron_pec.format.item_names import item_name
from megatron_pec.megatron import collect
from megatron_pec.testing import launch

history, tokens, snapshot_versions = {}, {}, {}


def train(args, model, optimizer, scheduler, data, first, last, save=True):
    for i in range(first, last + 1):
        example.train_step(args, model, optimizer, scheduler, data)
        args.consumed_train_samples += args.global_batch_size
        if save:
            megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0, non_persistent_ckpt=i % 4 != 0)
            api.current_engine().wait_for_saves()  # (the hand-over records the save once agreed)
            live = collect.live_views(api.current_engine().adapter.slices, optimizer)
            history[i] = {k: v.clone() for k, v in live.items()}
            tokens[i] = dict(api.current_engine().book.cumulative)
            saved_at = api.current_engine().book.state.snapshot.saved_at
            snapshot_versions[i] = {item_name(e): v for e, v in saved_at.items()}


def check_restore(optimizer, target, previous_lost):
    """Compare the restored slices with the recorded history; recompute PLT independently."""
    engine = api.current_engine()
    live = collect.live_views(engine.adapter.slices, optimizer)
    versions = {item_name(e): v for e, v in engine.book.state.snapshot.saved_at.items()}
    mismatched = []
    for s in engine.adapter.slices:
        version = target if s.item == "dense" else versions[s.item]
        if not torch.equal(live[s.name], history[version][s.name]):
            mismatched.append(f"{s.name}@{version}")
    experts = list(tokens[target])
    lost = sum(tokens[target][e] - tokens[versions[item_name(e)]][e] for e in experts)
    total = sum(tokens[target][e] for e in experts)
    return {"target": target, "mismatched": mismatched, "plt": engine.book.state.plt,
            "expected_plt": (previous_lost + lost) / total, "lost": lost, "k": engine.book.state.snapshot.k,
            "persist_k": engine.book.state.persist.k, "stale": sorted(i for i, v in versions.items() if v < target),
            "latest_versions": versions == snapshot_versions[target]}


def main():
    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--hidden-size", "64", "--train-iters", "40", "--save", save, "--load", save, "--pec-shm-dir", shm,
         "--pec-job-id", "pec",
         "--pec-snapshot-k", "2", "--pec-persist-k", "1", "--pec-dynamic-k", "--pec-plt-threshold", "0.001",
         "--pec-keep", "0",  # every iteration stays committed: the test reads their manifests
         "--pec-wait-for-slot"])  # on a loaded machine no snapshot is skipped: each restore's target exists
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result = {}
    train(args, model, optimizer, scheduler, data_from(0), 1, 10)
    train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), 11, 12, save=False)
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result["memory_1"] = check_restore(optimizer, 10, 0)

    train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), 11, 14)
    train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), 15, 16, save=False)
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    result["memory_2"] = check_restore(optimizer, 14, result["memory_1"]["lost"])

    engine = api.current_engine()
    engine.flush()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # node loss: agent and node memory gone
        launch.stop_agents(engine.job.node_dir)
        shutil.rmtree(engine.job.node_dir)
    torch.distributed.barrier()
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    # 14 was a memory snapshot only; restored from memory, the agent persisted it after the restart.
    result["storage"] = check_restore(optimizer, 14, result["memory_1"]["lost"])
    result["committed"] = sorted(checkpoints(save).committed_iterations())

    rank = str(torch.distributed.get_rank())
    result["persisted_bytes"] = {i: checkpoints(save).read_manifest(i).ranks[rank].size for i in (4, 8, 12)}
    report("pec", result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
