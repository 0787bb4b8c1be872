"""Replication benchmark: what keeping every snapshot in a peer node's memory costs and buys.

    python -m benchmarks.replication [--iters 40] [--json out.json]    # about 6 minutes on 2 cores

Two simulated nodes on this machine (``megatron_pec.testing.cluster``: one rank per node,
EP=2, DP=2, each node with its own agent and memory), the real megatron-core GPT-MoE of the
quick checkpoint benchmark (hidden 256, 8 experts, ~55 MB of optimizer state per rank), a
memory snapshot every iteration. Measured side by side in one run:

* training throughput (median step time) without checkpoints, and with a snapshot every
  iteration at K = all / 4 / 1, replication off (``--pec-replicas 0``) and on (1 replica);
* bytes on the wire per replicated snapshot at each K (the agents' own count);
* restore after node 1 is lost: from its replica in node 0's memory vs from storage
  (``load_checkpoint`` wall time on rank 0, which waits for every rank).

Prints a table and writes ``benchmarks/results/replication.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import REPO, RESULTS, machine, wait_for_quiet
from megatron_pec.testing.cluster import SMALL_MODEL, Cluster

SCRIPT = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
MODEL = [a if a != "64" else "256" for a in SMALL_MODEL]  # hidden 64 -> 256 (the quick benchmark's model)
SHM = Path("/dev/shm/bench_helper/replication")
_SENT = re.compile(r"replication: sent (\d+) snapshot\(s\) to peers, (\d+) of them whole, (\d+) bytes")


def _median_step(c: Cluster, skip: int = 5) -> float:
    steps = [r["step_s"] for r in c.metrics() if "step_s" in r and r["iteration"] > skip]
    return statistics.median(steps)


def _agent_log(c: Cluster, node: int) -> str:
    path = c.node_dir(node) / "agent.log"
    return path.read_text() if path.exists() else ""


def throughput(work: Path, iters: int, k: str | None, replicas: int | None) -> dict:
    """One uninterrupted run; ``k`` None = no checkpointing at all."""
    tag = "none" if k is None else f"k{k}_r{replicas}"
    c = Cluster(work / tag, SHM, f"brep_{tag}", model_args=MODEL, script=SCRIPT)
    args = ["--train-iters", str(iters)]
    if k is not None:
        args += ["--save-interval", str(10 * iters), "--non-persistent-save-interval", "1",
                 "--pec-replicas", str(replicas)]
        if k != "all":
            args += ["--pec-snapshot-k", k, "--pec-persist-k", k]
    try:
        c.launch(args, checkpoint=k is not None)
        codes = c.wait_exit(600)
        if codes != {0: 0, 1: 0}:
            raise RuntimeError(f"{tag} failed: {codes}\n{c.logs()[-3000:]}")
        c.wait_agents_exited()
        row = {"k": k, "replicas": replicas, "step_s": _median_step(c)}
        sent = _SENT.search(_agent_log(c, 0))
        if sent:
            snapshots, whole, nbytes = map(int, sent.groups())
            row.update(replicated_snapshots=snapshots, whole=whole,
                       wire_bytes_per_snapshot=nbytes // max(1, snapshots))
        return row
    finally:
        c.close()


def restore_after_node_loss(work: Path, replicas: int, iters: int) -> dict:
    tag = f"loss_r{replicas}"
    c = Cluster(work / tag, SHM, f"brep_{tag}", model_args=MODEL, script=SCRIPT)
    args = ["--train-iters", str(iters), "--save-interval", "10", "--non-persistent-save-interval", "1",
            "--pec-replicas", str(replicas)]
    try:
        c.launch(args)
        c.wait_iteration(15, timeout=600)
        c.lose_node(1)
        c.wait_stopped(120)
        c.launch(args)
        c.wait_exit(600)
        restores = c.restores(2)
        load = [r["load_s"] for r in c.metrics(2) if "load_s" in r]
        return {"replicas": replicas, "lost_node_source": restores[1].source, "iteration": restores[1].iteration,
                "load_s": load[0] if load else None}
    finally:
        c.close()


def markdown(result: dict) -> str:
    base = result["baseline_step_s"]
    lines = [f"# Replication benchmark ({time.strftime('%Y-%m-%d', time.localtime(result['started']))})", "",
             f"`{result['command']}`; {result['machine'].get('cpu', '')}, {result['machine'].get('cores', '')} "
             f"cores. Two simulated nodes, one rank each, hidden 256, 8 experts, EP=2, DP=2; a memory snapshot "
             f"every iteration. Throughput = step time without checkpoints ÷ step time.", "",
             "| K | replicas | median step (ms) | throughput | bytes on the wire per snapshot | snapshots sent whole |",
             "|---|---|---|---|---|---|",
             f"| (no checkpoints) | – | {base * 1000:.1f} | 1.00 | – | – |"]
    for r in result["throughput"]:
        wire = f"{r['wire_bytes_per_snapshot'] / 2**20:.2f} MiB" if "wire_bytes_per_snapshot" in r else "–"
        whole = f"{r['whole']} of {r['replicated_snapshots']}" if "whole" in r else "–"
        lines.append(f"| {r['k']} | {r['replicas']} | {r['step_s'] * 1000:.1f} | {base / r['step_s']:.2f} | "
                     f"{wire} | {whole} |")
    lines += ["", "| restore after node 1 is lost | node 1 restored from | iteration | load_checkpoint (s) |",
              "|---|---|---|---|"]
    for r in result["restore"]:
        lines.append(f"| replicas {r['replicas']} | {r['lost_node_source']} | {r['iteration']} | "
                     f"{r['load_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.replication", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", default=None)
    p.add_argument("--workdir", default="/tmp/bench_replication")
    a = p.parse_args(argv)
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result = {"command": " ".join(["python -m benchmarks.replication", *(argv or [])]), "started": time.time(),
              "machine": machine(), "load": wait_for_quiet(max_wait_s=60)}
    print("[bench] baseline without checkpoints", flush=True)
    result["baseline_step_s"] = throughput(work, a.iters, None, None)["step_s"]
    result["throughput"] = []
    for k in ("all", "4", "1"):
        for replicas in (0, 1):
            row = throughput(work, a.iters, k, replicas)
            print(f"[bench] K={k} replicas={replicas}: {json.dumps(row)}", flush=True)
            result["throughput"].append(row)
    result["restore"] = []
    for replicas in (1, 0):
        row = restore_after_node_loss(work, replicas, 30)
        print(f"[bench] node loss, replicas={replicas}: {json.dumps(row)}", flush=True)
        result["restore"].append(row)
    table = markdown(result)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for path in filter(None, (a.json, RESULTS / "replication.json")):
        Path(path).write_text(json.dumps(result, indent=1))
    (RESULTS / "replication.md").write_text(table)
    shutil.rmtree(SHM, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
