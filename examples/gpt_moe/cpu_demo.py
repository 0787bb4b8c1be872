"""The CPU main job behind ./run_pretrain.sh: a small GPT-MoE with PEC on 2 gloo ranks.

Trains examples/gpt_moe/pretrain_gpt_moe.py under torchrun with a memory
snapshot every iteration and a persisted checkpoint every --save-interval
iterations, keeping snapshot-K of the experts per layer in node memory and
persist-K on storage. Prints Megatron-style iteration lines and, at the end,
what the checkpoint directory holds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--train-iters", type=int, default=120)
    p.add_argument("--save-interval", type=int, default=20)
    p.add_argument("--snapshot-k", type=int, default=4)
    p.add_argument("--persist-k", type=int, default=1)
    p.add_argument("--selection", default="sequential")
    p.add_argument("--workdir", default=str(REPO / "runs" / "cpu_demo"),
                   help="checkpoints, metrics and logs go here (wiped at start)")
    return p.parse_args(argv)


def pretrain_command(a, nproc: int = 2, extra=()) -> list[str]:
    ckpt = os.path.join(a.workdir, "checkpoints")
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(29400 + os.getpid() % 1000),
            str(PRETRAIN), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--train-iters", str(a.train_iters), "--log-interval", "10",
            "--save", ckpt, "--load", ckpt, "--save-interval", str(a.save_interval),
            "--non-persistent-save-interval", "1",
            "--pec-snapshot-k", str(a.snapshot_k), "--pec-persist-k", str(a.persist_k),
            "--pec-selection", a.selection, "--pec-job-id", "cpu_demo",
            "--metrics-file", os.path.join(a.workdir, "metrics.jsonl"), *extra]


def main(argv=None) -> int:
    a = parse_args(argv)
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    print(f"megatron-pec CPU demo: GPT-MoE (2 layers, 8 experts, EP=2, DP=2) for {a.train_iters} iterations, "
          f"snapshot-K {a.snapshot_k} / persist-K {a.persist_k}, working in {a.workdir}", flush=True)
    start = time.time()
    code = subprocess.call(pretrain_command(a), env=dict(os.environ, TORCHELASTIC_RUN_ID="cpu_demo"))
    if code:
        print(f"training failed with exit code {code}", file=sys.stderr)
        return code
    print(f"training finished in {time.time() - start:.0f}s; checkpoint directory:", flush=True)
    return subprocess.call([sys.executable, "-m", "megatron_pec", "inspect", os.path.join(a.workdir, "checkpoints")])


if __name__ == "__main__":
    sys.exit(main())
