"""The loader on its own, then the restore built from stand-in parts, without an engine or Megatron
(tests/test_loader.py): one real gloo process, a checkpoint directory made by hand - a run that died at
iteration 2, one node's marker written, the other's never, nothing committed. The loader decides and leaves
the directory as it is; the restore acts. Prints whether the stale marker was retired. argv: ROOT PORT."""

import argparse
import os
import sys
from types import SimpleNamespace

import torch.distributed as dist

from megatron_pec.common.collectives import Collectives
from megatron_pec.common.phases import Phases
from megatron_pec.config import PecConfig
from megatron_pec.format.protocol import NodeMarker
from megatron_pec.restore.loader import LoadContext, Loader
from megatron_pec.restore.restore import Restore, RestoreParts
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import PosixStorage


def main():
    root, port = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    checkpoints = CheckpointDir(root, PosixStorage())
    os.makedirs(checkpoints.pec_dir(2))
    checkpoints.write_node_marker(NodeMarker(iteration=2, node=1, job_id="j", fingerprint="f", topology={},
                                             ranks={}))
    config = PecConfig.from_args(argparse.Namespace(save=root, load=root, pec_job_id="j"))
    job = SimpleNamespace(rank=0, node_dir=os.path.join(root, "no_memory"), fingerprint="f", topology={},
                          held_names={}, all_experts=(), expert_layout=None, layout=None, save_root=checkpoints.root)
    collectives = Collectives.over_all_ranks()
    # the loader decides and leaves the directory as it is ...
    loader = Loader(LoadContext(job=job, config=config, collectives=collectives, slice_items={}), checkpoints)
    assert loader.plan(loader.candidates(), set()) is None
    assert os.path.exists(checkpoints.node_marker(2, 1)), "the loader removed a file"
    # ... the restore acts: built from stand-ins, only what a load that finds nothing touches
    adapter = SimpleNamespace(collectives=collectives, slices=[])
    parts = RestoreParts(job=job, config=config, adapter=adapter, book=None, history=None, session=None,
                         stager=None, files=None, check_on_device=False)
    assert Restore(parts).run(checkpoints, finetune=False, scheduler=None, rng_key_prefix="", phases=Phases()) is None
    print("stale marker left" if os.path.exists(checkpoints.node_marker(2, 1)) else "stale marker retired")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
