"""Node memory against the state, side by side: three regions per item (the release before the expert pool), the
new default, partial experts, a tight budget, and DLRover's one buffer - ``benchmarks/results/node_memory.md``.

    python -m benchmarks.node_memory                 # about 12 minutes on 2 CPU cores
    python -m benchmarks.node_memory --baseline REV  # the "three regions" rows from another commit
    python -m benchmarks.node_memory --budget-rows   # only the persistent saves under the tightest budget (~3 min)

Each megatron-pec row runs the example trainer (2 CPU ranks, EP 2, one node, ``MODEL``) with a snapshot
every iteration and a persist every 20, nothing waiting for a slot, and SIGKILLs rank 0 in its 31st
optimizer step; node memory is measured then (its files: the ranks' own and, with replicas, a peer's), and
a relaunch restores: lost work is the iterations since the restored one and the PLT it reports. The
"three regions" rows run the same from a checkout of ``--baseline`` (its own code, its own node memory).
DLRover runs in the benchmark worker on the same model and schedule (``benchmarks.scheduled``): its shared
memory and the checkpoints it skipped. The 58 x 256 expert topology (DeepSeek-V3's, tiny experts) adds
the footprint and skips over a persist (22 iterations). A full node: 8 scripted ranks sharing one real
node agent beside a peer node of 8, each keeping the other's replicas (``megatron_pec.testing.full_node``):
footprint per node, the agent's CPU per snapshot of the whole node, skipped snapshots, and node 1 lost and
pulled back from node 0's memory.

The budget rows run K=all with and without the tightest budget the job admits (the smallest its
refusal of ``1x`` names): the longest a save blocked training (the metrics file), skipped snapshots, whether
each committed persistent save holds every expert at its iteration, and the kill's restore and PLT.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, RESULTS, machine
from megatron_pec.testing import launch
from megatron_pec.testing.full_node import STEP_S, run_full_node

BASELINE = "b4af658"  # the last commit with three regions per item (before the expert pool)
MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-experts", "8",
         "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "10"]
DEEPSEEK = ["--num-layers", "58", "--num-experts", "256", "--moe-router-topk", "8", "--expert-model-parallel-size",
            "2", "--hidden-size", "32", "--num-attention-heads", "4", "--moe-ffn-hidden-size", "16", "--seq-length",
            "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "1",
            "--log-interval", "1"]
SCHEDULE = ["--non-persistent-save-interval", "1", "--save-interval", "20", "--pec-keep", "0"]
ITERS, KILL_AT = 40, 31
ROWS = {  # name -> (tree: "baseline" or "this", extra flags)
    "three regions (before), K=all": ("baseline", []),
    "three regions (before), snapshot-K 2 / persist-K 1": ("baseline",
                                                            ["--pec-snapshot-k", "2", "--pec-persist-k", "1"]),
    "new default, K=all": ("this", []),
    "new default, snapshot-K 2 / persist-K 1": ("this", ["--pec-snapshot-k", "2", "--pec-persist-k", "1"]),
    "tightest budget, K=all asked": ("this", ["--pec-node-memory", "tightest"]),
    "new default, snapshot-K 1 (what that budget implies)": ("this", ["--pec-snapshot-k", "1"]),
}
BUDGET_ROWS = {  # the focused mode's rows, measured with their save blocking and whole persists
    "new default, K=all, persistent saves": [],
    "tightest budget, K=all asked, persistent saves": ["--pec-node-memory", "tightest"],
}
SMALLEST = re.compile(r"The smallest budget that works is ([0-9.]+)x")
RESTORED = re.compile(r"rank 0: restored iteration (\d+) from (\w+(?: memory)?)")
PLT = re.compile(r"PLT[^0-9]*([0-9.]+)%")


def run(tree: Path, workdir: Path, name: str, args: list[str], env: dict, timeout: float = 900) -> str:
    log = workdir / (re.sub(r"[^A-Za-z0-9.]+", "_", name) + ".log")
    job = launch.Launch(tree / "examples" / "gpt_moe" / "pretrain_gpt_moe.py", tuple(args), nproc=2)
    with open(log, "w") as out:
        launch.run(job, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tree, timeout=timeout)
    return log.read_text()


def footprint(node_dir: Path) -> dict:
    """Bytes of node memory per rank and of one complete snapshot of a rank (the state)."""
    files = [p for p in node_dir.iterdir() if p.is_file() and re.fullmatch(r"rank\d+\.(slot\d+|pool)", p.name)]
    ranks = sorted({int(p.name[4:].split(".")[0]) for p in files})
    own = sum(p.stat().st_size for p in files) / max(1, len(ranks))
    plans = [json.loads(p.read_text()) for p in node_dir.glob("rank*.memory.json")]
    if plans:
        state = sum(p["state_bytes"] for p in plans) / len(plans)
    else:  # (three regions: every slot file holds one complete snapshot)
        state = min(p.stat().st_size for p in files if ".slot" in p.name)
    replicas = node_dir / "replicas"
    held = sum(p.stat().st_size for p in replicas.glob("*")) / max(1, len(ranks)) if replicas.is_dir() else 0
    return {"bytes_per_rank": own + held, "state_bytes": state, "ratio": (own + held) / state}


def tightest(tree: Path, workdir: Path, model: list[str], extra: list[str], env: dict) -> list[str]:
    """``extra`` with ``--pec-node-memory tightest`` replaced by the smallest budget the job admits: what its
    refusal of ``1x`` names."""
    if "tightest" not in extra:
        return extra
    save, shm = workdir / f"ck_{len(os.listdir(workdir))}", tempfile.mkdtemp(prefix="pec_nm_", dir="/dev/shm")
    args = [*model, "--train-iters", "1", "--save", str(save), "--pec-shm-dir", shm,
            "--pec-job-id", f"nmt{os.getpid()}", *[("1x" if a == "tightest" else a) for a in extra]]
    try:
        found = SMALLEST.search(run(tree, workdir, "refused", args, env, timeout=300))
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    if found is None:
        raise RuntimeError(f"--pec-node-memory 1x was not refused with the smallest budget; see {workdir}")
    return [f"{found.group(1)}x" if a == "tightest" else a for a in extra]


def pec_row(name: str, tree: Path, extra: list[str], workdir: Path, model: list[str], iters: int, kill: int | None,
            env: dict, saves: bool = False) -> dict:
    """``saves``: also the longest save blocking and whether every committed persistent save is whole."""
    extra = tightest(tree, workdir, model, extra, env)
    save, shm = workdir / f"ck_{len(os.listdir(workdir))}", Path(tempfile.mkdtemp(prefix="pec_nm_", dir="/dev/shm"))
    job = f"nm{os.getpid()}"
    args = [*model, "--train-iters", str(iters), "--save", str(save), "--load", str(save), "--pec-shm-dir", str(shm),
            "--pec-job-id", job, "--pec-keep-shm", *SCHEDULE, *extra]
    metrics = [workdir / f"{save.name}.{n}.metrics" for n in ("first", "second")]
    started = time.monotonic()
    first = run(tree, workdir, name + ".first", args + (["--metrics-file", str(metrics[0])] if saves else []),
                dict(env, MEGATRON_PEC_FAULT=f"optimizer_step=kill@{kill}:0") if kill else env)
    row = {"skipped": len(set(re.findall(r"skipped the snapshot of iteration (\d+)", first))),
           **footprint(shm / job / "node0")}
    files = rank_file_bytes(save)
    if files:  # (against what storage keeps of a rank: its rank file of the newest persist, K=all's every expert)
        row.update(rank_file_bytes=files, ratio_to_rank_file=row["bytes_per_rank"] / files)
    if "--pec-node-memory" in extra:
        row["budget"] = extra[extra.index("--pec-node-memory") + 1]
    whole = whole_persists(save) if saves else {}
    implied = re.search(r"holds snapshot-K (\d+) per layer, not the asked (\d+)", first)
    row["implied_k"] = f"{implied.group(1)} of {implied.group(2)}" if implied else None
    if kill:
        second = run(tree, workdir, name + ".second", args + (["--metrics-file", str(metrics[1])] if saves else []),
                     env)
        found, plt = RESTORED.search(second), PLT.findall(second)
        row.update(restored=f"{found.group(1)} from {found.group(2)}" if found else None,
                   lost_iterations=kill - 1 - int(found.group(1)) if found else None,
                   plt=float(plt[0]) / 100 if plt else 0.0)
    if saves:
        row.update(longest_blocking_s=longest_blocking(metrics), whole_persists={**whole, **whole_persists(save)})
    launch.stop_agents(shm)
    shutil.rmtree(shm, ignore_errors=True)
    print(f"[node memory] {name}: {row} ({time.monotonic() - started:.0f} s)", flush=True)
    return row


def rank_file_bytes(save: Path) -> float | None:
    """The mean size of the ranks' files of the newest committed iteration under ``save`` (None: none)."""
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import PosixStorage

    checkpoints = CheckpointDir(str(save), PosixStorage())
    committed = checkpoints.committed_iterations()
    if not committed:
        return None
    sizes = [f.size for f in checkpoints.read_manifest(max(committed)).ranks.values()]
    return sum(sizes) / len(sizes)


def longest_blocking(paths: list[Path]) -> float:
    """The longest a save blocked training in these metrics files (``save_blocking_s``)."""
    rows = [json.loads(line) for p in paths if p.exists() for line in p.read_text().splitlines()]
    return max((r.get("save_blocking_s", 0.0) for r in rows), default=0.0)


def whole_persists(save: Path) -> dict[int, bool]:
    """Iteration -> whether its committed persistent save (every ``--save-interval``) holds every expert at
    that iteration (``inspect``)."""
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import PosixStorage
    from megatron_pec.tools.inspect_checkpoint import inspect

    interval = int(SCHEDULE[SCHEDULE.index("--save-interval") + 1])
    report = inspect(CheckpointDir(str(save), PosixStorage()))
    return {it["iteration"]: set(it.get("expert_versions", {}).values()) == {it["iteration"]}
            for it in report["iterations"] if it.get("committed") and it["iteration"] % interval == 0}


def full_node_row(ranks: int = 8, iterations: int = 41, persist: int = 20) -> dict:
    """8 ranks on a node beside a peer node of 8: footprints, the agents' CPU per snapshot, the node loss."""
    started = time.monotonic()
    shm, root = tempfile.mkdtemp(prefix="pec_nm8_", dir="/dev/shm"), tempfile.mkdtemp(prefix="pec_nm8_ck_")
    try:
        run = run_full_node(shm, root, ranks, iterations, persist, job=f"nm8{os.getpid()}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    row = {"ranks_per_node": ranks, "snapshots": run.snapshots, "persist_every": persist, "skipped": run.waits,
           "longest_wait_s": run.waited_s, "committed": run.committed,
           "nodes": [{"own_ratio": n.own_bytes / n.state_bytes, "with_replicas_ratio":
                      (n.own_bytes + n.replica_bytes) / n.state_bytes, "state_bytes": n.state_bytes,
                      "agent_cpu_ms_per_snapshot": n.agent_cpu_s / run.snapshots * 1e3,
                      "agent_phases_ms_per_snapshot": {p: v / run.snapshots * 1e3 for p, v in n.agent_phases_s.items()}}
                     for n in run.nodes],
           "pulled": sorted({(p["origin"], p["iteration"]) for p in run.pulled}),
           "pulled_complete": all(set(p["versions"].values()) == {p["iteration"]} for p in run.pulled)}
    print(f"[node memory] full node: {row} ({time.monotonic() - started:.0f} s)", flush=True)
    return row


def dlrover_row(workdir: Path, model: list[str], env: dict) -> dict:
    """DLRover on the schedule in the benchmark worker: its shared memory and skipped checkpoints."""
    result, run_id = workdir / "dlrover.json", f"nm{os.getpid()}"
    job = launch.Launch("benchmarks.worker", (
        "--mode", "schedule", "--run-id", run_id, "--out", str(result), "--methods", "dlrover", "--iters", str(ITERS),
        "--iters-persist-every-iteration", "1", "--memory-restores", "1", "--storage-restores", "1",
        "--floor-reps", "1", "--", *model, "--train-iters", "5000"), nproc=2, module=True,
        options=("--rdzv-id", run_id))
    with open(workdir / "dlrover.log", "w") as out:
        code = launch.run(job, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, timeout=900,
                          env=dict(env, PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))).returncode
    if code or not result.exists():
        return {"error": f"exit code {code}, see {workdir / 'dlrover.log'}"}
    measured = json.loads(result.read_text())
    rows = [r for n, r in measured["rows"].items() if "every iteration" in r.get("schedule", "")] or \
        list(measured["rows"].values())
    r, state = rows[0], measured.get("optimizer_state_bytes_per_rank")
    memory = r.get("node_memory_bytes")
    return {"skipped": r.get("skipped"), "bytes_per_rank": memory, "state_bytes": state,
            "ratio": memory / state if memory and state else None, "restored": "its newest completed save",
            "lost_iterations": None, "plt": None, "implied_k": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BASELINE, help=f"commit of the three-region rows (default {BASELINE})")
    p.add_argument("--no-dlrover", action="store_true")
    p.add_argument("--json", default=str(RESULTS / "node_memory.json"))
    p.add_argument("--budget-rows", action="store_true",
                   help="only the persistent saves under the tightest budget (node_memory.md's last section)")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="pec_node_memory_"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    markdown = Path(args.json).with_suffix(".md")
    if args.budget_rows:
        budget = budget_rows(workdir, env)
        kept = markdown.read_text().split(BUDGET_HEADING)[0].rstrip("\n") if markdown.exists() else ""
        markdown.write_text(kept + "\n" + "\n".join(budget_table(budget)) + "\n")
        Path(args.json).with_name("node_memory_budget.json").write_text(json.dumps(budget, indent=1))
        print("\n".join(budget_table(budget)))
        return 0
    baseline = workdir / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(baseline), args.baseline],
                   check=True)
    base_env = dict(env, PYTHONPATH=str(baseline) + os.pathsep + env.get("PYTHONPATH", ""))
    out = {"machine": machine(), "baseline": args.baseline, "model": MODEL, "schedule": SCHEDULE, "iterations": ITERS,
           "kill_at": KILL_AT, "rows": {}}
    try:
        for name, (tree, extra) in ROWS.items():
            here = baseline if tree == "baseline" else REPO
            out["rows"][name] = pec_row(name, here, extra, workdir, MODEL, ITERS, KILL_AT,
                                        base_env if tree == "baseline" else env)
        for name, extra in (("58 x 256 experts, K=all", []),
                            ("58 x 256 experts, snapshot-K 2 / persist-K 1", ["--pec-snapshot-k", "2",
                                                                             "--pec-persist-k", "1"])):
            out["rows"][f"new default, {name}"] = pec_row(name, REPO, extra, workdir, DEEPSEEK, 22, None, env)
        out["full_node"] = full_node_row()
        out["budget"] = budget_rows(workdir, env)
        if not args.no_dlrover:
            out["rows"]["DLRover flash checkpoint"] = dlrover_row(workdir, MODEL, env)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    Path(args.json).write_text(json.dumps(out, indent=1))
    lines = node_memory_table(out, args.baseline) + full_node_table(out["full_node"]) + budget_table(out["budget"])
    markdown.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def node_memory_table(out: dict, baseline: str) -> list[str]:
    """The rows' table: node memory per rank over its state, skips, K held, the restart after the kill."""
    lines = ["# Node memory per rank against its state", "",
             f"`python -m benchmarks.node_memory` ({out['machine'].get('cpu', 'CPU')}); the example trainer on 2 CPU "
             f"ranks of one node, `{' '.join(MODEL)}`, {ITERS} iterations, a snapshot every iteration and a persist "
             f"every 20 (nothing waits for a slot), rank 0 SIGKILLed in its optimizer step {KILL_AT}, then relaunched. "
             f"Three regions: commit {baseline}. State: one complete snapshot of a rank as a slot file of its "
             "own (its tensors and a header naming every one of them, with the room for a save's metadata: what a "
             "replica of the rank holds, and each slot of the three-region layout; `slots.snapshot_file_bytes`).", "",
             "| row | node memory per rank ÷ state | skipped snapshots | snapshot-K held | restored after the kill "
             "| iterations lost | PLT |", "|---|---|---|---|---|---|---|"]
    for name, r in out["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | | |")
            continue
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        plt = f"{r['plt'] * 100:.2f}%" if r.get("plt") is not None else "-"
        lost = r.get("lost_iterations")
        lines.append(f"| {name} | {ratio} | {r['skipped']} | {r.get('implied_k') or 'as asked'} | "
                     f"{r.get('restored') or '-'} | {'-' if lost is None else lost} | {plt} |")
    return lines


BUDGET_HEADING = "## Persistent saves under the tightest budget"


def budget_rows(workdir: Path, env: dict) -> dict:
    return {"machine": machine(), "model": MODEL, "schedule": SCHEDULE, "iterations": ITERS, "kill_at": KILL_AT,
            "rows": {name: pec_row(name, REPO, extra, workdir, MODEL, ITERS, KILL_AT, env, saves=True)
                     for name, extra in BUDGET_ROWS.items()}}


def budget_table(out: dict) -> list[str]:
    lines = ["", BUDGET_HEADING, "",
             f"`python -m benchmarks.node_memory --budget-rows` ({out['machine'].get('cpu', 'CPU')}): the model and "
             f"schedule above (K=all asked, a persistent save every 20 of {out['iterations']} iterations), rank 0 "
             f"SIGKILLed in its optimizer step {out['kill_at']}, then relaunched; the tightest budget is the smallest "
             "the job admits (what its refusal of `1x` names). Longest blocking: the longest any save held training, "
             "both launches (metrics file); persists whole: each committed persistent save holds every expert at its "
             "iteration (`inspect`).", "",
             "| row | budget | node memory per rank ÷ state | ÷ its rank file (newest persist) "
             "| longest save blocking (s) | skipped snapshots "
             "| snapshot-K held | persists whole | restored after the kill | iterations lost | PLT |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["rows"].items():
        whole = ", ".join(f"{i}: {'yes' if ok else 'NO'}" for i, ok in sorted(r["whole_persists"].items()))
        to_file = f"{r['ratio_to_rank_file']:.3f}" if r.get("ratio_to_rank_file") else "-"
        lines.append(f"| {name} | {r.get('budget', 'none')} | {r['ratio']:.3f} | {to_file} | "
                     f"{r['longest_blocking_s']:.3f} | "
                     f"{r['skipped']} | {r.get('implied_k') or 'as asked'} | {whole} | {r.get('restored') or '-'} | "
                     f"{r.get('lost_iterations', '-')} | {r['plt'] * 100:.2f}% |")
    return lines


def full_node_table(row: dict) -> list[str]:
    lines = ["", f"A full node: {row['ranks_per_node']} scripted ranks on each of two nodes sharing one node agent "
             f"each, every node keeping the other's replicas, {row['snapshots']} measured snapshots (one every "
             f"{1e3 * STEP_S:.0f} ms), a persist every {row['persist_every']} (committed: {row['committed']}); "
             f"skipped snapshots: {row['skipped']} (the longest wait for a home {row['longest_wait_s'] * 1e3:.0f} ms). "
             f"Node 1 lost: its ranks pulled iteration(s) {', '.join(str(i) for _, i in row['pulled'])} from node "
             f"{', '.join(str(o) for o, _ in row['pulled'])}'s memory, every item at that version: "
             f"{row['pulled_complete']}.", "",
             "| node | own ÷ node state | own + replicas ÷ node state | node agent CPU per snapshot of the node (ms) "
             "| of which (ms) |", "|---|---|---|---|---|"]
    for n, node in enumerate(row["nodes"]):
        parts = ", ".join(f"{p} {v:.1f}" for p, v in sorted(node["agent_phases_ms_per_snapshot"].items(),
                                                            key=lambda pv: -pv[1]) if v >= 0.05)
        rest = node["agent_cpu_ms_per_snapshot"] - sum(node["agent_phases_ms_per_snapshot"].values())
        parts += f", in no phase (replicas landing, threads) {rest:.1f}"
        lines.append(f"| {n} | {node['own_ratio']:.3f} | {node['with_replicas_ratio']:.3f} | "
                     f"{node['agent_cpu_ms_per_snapshot']:.1f} | {parts} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
