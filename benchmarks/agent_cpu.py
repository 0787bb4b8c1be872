"""The node agent's CPU per memory-only snapshot against the size of the state: the node tier's cost,
measured without a GPU.

    python -m benchmarks.agent_cpu                      # 8 MB and 512 MB states, about 10 seconds
    python -m benchmarks.agent_cpu --sizes-mb 8,64,512 --snapshots 30 --json out.json

A real node agent and a scripted trainer (``megatron_pec.testing.scripted``: the engine's slot files,
region choice and checksums, no Megatron) on one rank. The state is one dense item (a quarter of it)
and 8 experts. For each size, memory-only snapshots of every item (K = all) and of 2 experts (K = 2);
the agent's CPU time between two flushes (its own ledger, ``agent_cpu.json``) divided by the snapshots,
and its phases. The trainer's time (its copies and checksums) is not the agent's and is not counted.
Writes ``benchmarks/results/agent_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid

import torch

from benchmarks.common import RESULTS, machine
from megatron_pec.format.stformat import layout
from megatron_pec.memory.slots import node_dir
from megatron_pec.testing.full_node import agent_ledger
from megatron_pec.testing.scripted import ScriptedTrainer

EXPERTS = 8


def state(size_mb: int):
    """(entries, items): a quarter of ``size_mb`` dense, the rest in 8 experts (param + 2 moments each)."""
    floats = size_mb * 2**20 // 4
    dense = floats // 4
    per_expert = (floats - dense) // (EXPERTS * 3)
    specs = [("dense/w.param", torch.float32, dense)]
    specs += [(f"L1.E{e}/w.{kind}", torch.float32, per_expert)
              for e in range(EXPERTS) for kind in ("param", "exp_avg", "exp_avg_sq")]
    return layout(specs), ["dense"] + [f"L1.E{e}" for e in range(EXPERTS)]


def measure(size_mb: int, snapshots: int, k: int | None, shm: str, save: str) -> dict:
    entries, items = state(size_mb)
    directory = node_dir(shm, f"bench{size_mb}k{k or 'all'}", 0)
    t = ScriptedTrainer(directory, 0, save, entries, items, nodes=1)
    try:
        experts = items[1:]
        for i in range(1, 4):  # first, each slot once: the agent maps it and parses its table
            t.snapshot(i, persist=False)
        ledger = agent_ledger(t)
        started = time.perf_counter()
        for i in range(4, snapshots + 4):
            written = items if k is None else ["dense"] + [experts[(k * i + j) % EXPERTS] for j in range(k)]
            t.snapshot(i, persist=False, written=written)
        wall = time.perf_counter() - started
        after = agent_ledger(t)
    finally:
        t.close()
        shutil.rmtree(os.path.dirname(directory), ignore_errors=True)
    phases = {p: (after["phases"].get(p, 0.0) - ledger["phases"].get(p, 0.0)) / snapshots
              for p in after["phases"]}
    return {"size_mb": size_mb, "k": k or EXPERTS, "snapshots": snapshots,
            "agent_cpu_s_per_snapshot": (after["process_s"] - ledger["process_s"]) / snapshots,
            "phases_s_per_snapshot": phases, "wall_s_per_snapshot": wall / snapshots}


def report(rows: list[dict]) -> str:
    lines = ["# Agent CPU per memory-only snapshot", "",
             "`python -m benchmarks.agent_cpu`: a real node agent, a scripted trainer, one rank; the agent's "
             "own CPU time between two flushes divided by the snapshots.", "",
             "| state | K | agent CPU per snapshot (ms) | of which: checking the header, node-memory index, "
             "replicating (ms) | wall per snapshot (ms) |", "|---|---|---|---|---|"]
    for r in rows:
        phases = r["phases_s_per_snapshot"]
        parts = ", ".join(f"{phases.get(p, 0.0) * 1e3:.2f}" for p in
                          ("checking", "node-memory index", "replicating"))
        lines.append(f"| {r['size_mb']} MB | {r['k']} of {EXPERTS} | {r['agent_cpu_s_per_snapshot'] * 1e3:.2f} | "
                     f"{parts} | {r['wall_s_per_snapshot'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="8,512", help="state sizes per rank (default %(default)s)")
    parser.add_argument("--snapshots", type=int, default=20, help="measured snapshots per case")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where node memory goes (a tmpfs)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    shm = os.path.join(args.shm_dir, f"pec-bench-{uuid.uuid4().hex[:8]}")
    rows = []
    with tempfile.TemporaryDirectory() as save:
        try:
            for size in (int(s) for s in args.sizes_mb.split(",")):
                for k in (None, 2):
                    rows.append(measure(size, args.snapshots, k, shm, save))
                    r = rows[-1]
                    print(f"[agent_cpu] {size} MB, K={r['k']}: {r['agent_cpu_s_per_snapshot'] * 1e3:.2f} ms of agent "
                          f"CPU per snapshot", flush=True)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    result = {"machine": machine(), "rows": rows}
    text = report(rows)
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    for path in filter(None, (os.path.join(RESULTS, "agent_cpu.json"), args.json)):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(RESULTS, "agent_cpu.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
