"""The CPU main job behind ./run_pretrain.sh: a small GPT-MoE with PEC, trained as two simulated nodes.

Trains examples/gpt_moe/pretrain_gpt_moe.py as two ``torchrun`` "nodes" on this
machine (one rank each, EP=2, DP=2, gloo; ``megatron_pec.testing.cluster``), each
with its own node agent and node memory. PEC is on: every --snapshot-interval
iterations snapshot-K experts per layer go to node memory, every
--save-interval iterations persist-K of them go to storage.

The story (off with --no-fault-demo): mid-run node 1 is lost - its trainer and
agent are SIGKILLed and its node memory deleted. Node 0 notices and exits, the
job is relaunched, node 0's rank restores from its memory and node 1's from
storage, a recovery report says what it cost, and training finishes. At the
end it prints what the checkpoint directory holds.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError  # noqa: E402 (after the set-up above)
from megatron_pec.store.storage import open_storage  # noqa: E402 (after the set-up above)
from megatron_pec.testing.cluster import Cluster, parse_plt, persist_only_plt  # noqa: E402 (after the set-up above)

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "8",
         "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--log-interval", "10"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-iters", type=int, default=120)
    p.add_argument("--snapshot-interval", type=int, default=5,
                   help="memory snapshot every N iterations (Megatron's --non-persistent-save-interval)")
    p.add_argument("--save-interval", type=int, default=10, help="persisted checkpoint every N iterations")
    p.add_argument("--snapshot-k", type=int, default=4)
    p.add_argument("--persist-k", type=int, default=1)
    p.add_argument("--selection", default="sequential")
    p.add_argument("--kill-at", type=int, default=None,
                   help="iteration after which node 1 is lost (default: just past the middle of training)")
    p.add_argument("--no-fault-demo", action="store_true", help="train without losing a node")
    p.add_argument("--workdir", default=str(REPO / "runs" / "cpu_demo"),
                   help="checkpoints, metrics and logs go here (wiped at start)")
    p.add_argument("--shm-dir", default="/dev/shm/megatron_pec", help="node memory root (--pec-shm-dir)")
    p.add_argument("--job-id", default="cpu_demo")
    a = p.parse_args(argv)
    if a.kill_at is None:
        a.kill_at = a.train_iters // 2 + a.save_interval * 2 // 3
    return a


def train_args(a) -> list[str]:
    return [*MODEL, "--train-iters", str(a.train_iters), "--save-interval", str(a.save_interval),
            "--non-persistent-save-interval", str(a.snapshot_interval),
            "--pec-snapshot-k", str(a.snapshot_k), "--pec-persist-k", str(a.persist_k),
            "--pec-selection", a.selection]


class Echo:
    """Prints the interesting lines of the nodes' logs as they appear (iteration lines from node 0,
    megatron-pec messages from both)."""

    INTERESTING = re.compile(r"^ \[.*\] iteration |^training from|validation loss|megatron-pec")

    def __init__(self, cluster: Cluster):
        self.cluster, self.stop = cluster, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        offsets = {}
        while True:
            stopping = self.stop.is_set()
            for launch, node in [(n, k) for n in range(1, self.cluster.launches + 1)
                                 for k in range(self.cluster.nnodes)]:
                path = self.cluster.log_path(node, launch)
                try:
                    with open(path, errors="replace") as f:
                        f.seek(offsets.get(path, 0))
                        text = f.read()
                except FileNotFoundError:
                    continue
                complete = text[: text.rfind("\n") + 1]
                offsets[path] = offsets.get(path, 0) + len(complete.encode())
                for line in complete.splitlines():
                    if self.INTERESTING.search(line) and (node == 0 or "megatron-pec" in line):
                        print(f"[node{node}] {line.strip()}", flush=True)
            if stopping:
                return
            time.sleep(0.2)


def lose_node_mid_run(c: Cluster, a) -> dict:
    """Wait for --kill-at, then lose node 1 (trainer, agent, node memory); returns what happened."""
    c.wait_iteration(a.kill_at, timeout=1800)
    committed = CheckpointDir(str(c.save), open_storage("posix")).committed_iterations()
    agent = c.agent_pid(1)
    c.lose_node(1)
    reached = c.iteration()
    print(f"\n*** node 1 lost after iteration {reached}: SIGKILLed its trainer and its node agent (pid {agent}), "
          f"deleted its node memory {c.node_dir(1)}. Newest persisted checkpoint: iteration "
          f"{committed[0] if committed else None}.\n", flush=True)
    code = c.wait_exit(300, nodes=[0])[0]
    print(f"*** node 0 noticed the failure and exited (code {code}); relaunching both nodes\n", flush=True)
    return {"reached": reached, "relaunched_at": time.monotonic(), "stored": committed[0] if committed else None}


def recovery_report(c: Cluster, loss: dict) -> list[str]:
    restores = c.restores(2)
    if not restores:
        return ["no restore happened (nothing was persisted before the node was lost): trained from scratch"]
    target = restores[0].iteration
    lines = ["=== recovery report " + "=" * 60]
    for rank, r in sorted(restores.items()):
        role = "survived" if rank == 0 else "lost"
        lines.append(f"rank {rank} (node {rank}, {role}): restored iteration {r.iteration} from {r.source}; "
                     f"{len(r.older)} of its experts from older versions")
    lines.append(f"iterations lost: {loss['reached'] - target} (reached {loss['reached']}, resumed at {target})")
    plt = parse_plt(c.logs(2))
    if plt is not None:
        lines.append(f"PLT of this recovery: {100 * plt:.3f}% of expert-token work")
    lost = restores.get(1)
    if lost is not None and lost.source != "storage" and "storage_only_plt" in loss:
        lines.append(f"a restore from storage alone would have resumed at iteration {loss['stored']} "
                     f"(losing {loss['reached'] - loss['stored']} iterations) with PLT "
                     f"{100 * loss['storage_only_plt']:.3f}%")
    if "training_again" in loss:
        lines.append(f"from the relaunch to training again (start-up and restore): "
                     f"{loss['training_again'] - loss['relaunched_at']:.1f}s")
    lines.append("=" * 80)
    return lines


def main(argv=None) -> int:
    a = parse_args(argv)
    shutil.rmtree(a.workdir, ignore_errors=True)
    c = Cluster(a.workdir, a.shm_dir, a.job_id, model_args=[], script=Path(__file__).with_name("pretrain_gpt_moe.py"))
    print(f"megatron-pec CPU demo: GPT-MoE (2 layers, 8 experts, EP=2, DP=2) on 2 simulated nodes for "
          f"{a.train_iters} iterations; snapshot-K {a.snapshot_k} to node memory every {a.snapshot_interval}, "
          f"persist-K {a.persist_k} to storage every {a.save_interval}; working in {a.workdir}", flush=True)
    start = time.monotonic()
    try:
        with Echo(c):
            c.launch(train_args(a))
            loss = None
            if not a.no_fault_demo and a.kill_at < a.train_iters:
                loss = lose_node_mid_run(c, a)
                c.launch(train_args(a))
                c.wait_log(r"^training from iteration", node=0, timeout=600)
                loss["training_again"] = time.monotonic()
                if loss["stored"] is not None:  # now, before retention deletes that iteration
                    try:
                        loss["storage_only_plt"] = persist_only_plt(c.save, loss["stored"])
                    except ManifestError:
                        pass  # already retired by retention: the comparison is left out
            codes = c.wait_exit(1800)
        if codes != {0: 0, 1: 0}:
            print(f"training failed (exit codes {codes}); logs: {a.workdir}", file=sys.stderr)
            return 1
        if loss is not None:
            print("\n" + "\n".join(recovery_report(c, loss)), flush=True)
    finally:
        c.close()
    print(f"\ntraining finished in {time.monotonic() - start:.0f}s; checkpoint directory:", flush=True)
    return subprocess.call([sys.executable, "-m", "megatron_pec", "inspect", str(c.save)], cwd=str(REPO))


if __name__ == "__main__":
    sys.exit(main())
