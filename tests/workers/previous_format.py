"""A checkpoint written by an earlier megatron-pec release restores as that release restored it.

argv: MODE LOAD_DIR SHM_DIR [SAVE_DIR], results in $PEC_TEST_OUT. Snapshot-K = persist-K = 1 of 8
experts, a persistent save every 2 iterations: the newest checkpoint's experts come from four iterations.

* ``write``:     train 8 iterations with saves into LOAD_DIR (run once, by the earlier release, to make
  the fixture);
* ``restore``:   a fresh process with empty node memory restores LOAD_DIR from storage and reports what
  it restored: each item's bytes (sha256 of its slices), the PEC state, PLT (the fixture's
  ``expected`` is this report as the earlier release wrote it); then saves the restored state, every
  expert, into SAVE_DIR in this release's format and reports the losses of the next two iterations;
* ``reference``: a fresh process restores SAVE_DIR (this release's own format) and reports its items and
  the losses of the next two iterations: the same machine's reference for the losses, which depend on
  the CPU's vector width and kernels and so are never compared with another machine's.
"""

import hashlib
import sys

import torch
from common import report, setup, train

import megatron_pec
from megatron_pec import api
from megatron_pec.format.item_names import item_name
from megatron_pec.megatron import collect

ARGS = ["--train-iters", "12", "--pec-snapshot-k", "1", "--pec-persist-k", "1", "--pec-keep", "0",
        "--pec-wait-for-slot"]


def restored_state(optimizer) -> dict:
    engine = api.current_engine()
    live = collect.live_views(engine.adapter.slices, optimizer)
    digests = {}
    for s in engine.adapter.slices:  # (slot order: the same on both releases)
        digests.setdefault(s.item, hashlib.sha256()).update(live[s.name].contiguous().view(torch.uint8).numpy())
    return {"items": {item: d.hexdigest() for item, d in sorted(digests.items())},
            "snapshot_versions": {item_name(x): v for x, v in sorted(engine.book.state.snapshot.saved_at.items())},
            "persist_versions": {item_name(x): v for x, v in sorted(engine.book.state.persist.saved_at.items())},
            "tokens": {item_name(x): v for x, v in sorted(engine.book.cumulative.items())},
            "plt": engine.book.state.plt, "k": [engine.book.state.snapshot.k, engine.book.state.persist.k]}


def main():
    mode, load, shm = sys.argv[1:4]
    save = sys.argv[4] if mode == "restore" else load
    args, model, optimizer, scheduler, data_from = setup(
        ARGS + ["--hidden-size", "16", "--save", save, "--load", load, "--pec-shm-dir", shm,
                "--pec-job-id", f"prev-{mode}"])
    iteration, _ = megatron_pec.load_checkpoint(model, optimizer, scheduler)
    if mode == "write":
        data = data_from(0)
        for i in range(1, 9):
            train(args, model, optimizer, scheduler, data, 1)
            megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0, non_persistent_ckpt=i % 2 != 0)
        api.current_engine().flush()  # every save committed before the process ends
        return
    result = {"iteration": iteration, "consumed": args.consumed_train_samples, **restored_state(optimizer)}
    if mode == "restore":  # (the restored iteration was restored from LOAD_DIR: a save of it writes every expert)
        megatron_pec.save_checkpoint(iteration, model, optimizer, scheduler, 0)
        api.current_engine().flush()
    result["losses"] = train(args, model, optimizer, scheduler, data_from(args.consumed_train_samples), 2)
    report(f"previous_format.{mode}", result)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
