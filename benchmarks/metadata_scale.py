"""Metadata at scale: what a save costs besides its copy, against the experts per layer.

    python -m benchmarks.metadata_scale [--experts 8,64,256] [--iters 5] [--repo PATH]   # ~8 min on 2 cores

The example trainer at DeepSeek-V3's expert topology (58 MoE layers, top-8, EP=2 on 2 CPU ranks;
hidden 32 and expert FFN 16 so that it runs on CPU) with E experts per layer, a snapshot every
iteration (snapshot K=8, persisted every 2nd iteration with K=4). Per E:

* blocking time of a save on rank 0 (median of saves 2..N: the first one binds the optimizer views);
* the bytes that save copies (its items in the slot's tensor table) and the memcpy time of as many
  bytes on this machine, from memory not in the caches (as a save's sources are after a training
  step): the difference is the fixed per-save cost (planning, the agreement all-reduce, small state,
  header, and one copy call per run of contiguous bytes: ~1,400 runs per save here at every E);
* the slot header (its tensor table and the metadata a save rewrites) and the persisted rank file's
  header;
* where a save's blocking time goes (the example trainer's ``save_phases_s``, medians);
* a restart's restore from node memory (rank 0, as it logs it: reading = choosing, reading and
  checking the sources; applying = the rest, into Megatron), the restarted trainer's optimizer
  without state, as after a crash.

``--repo`` runs another checkout of megatron-pec (e.g. ``git worktree add /tmp/old <commit>``) for a
before/after table. Prints a table and writes ``benchmarks/results/metadata_scale{,_<label>}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.common import REPO, RESULTS, machine, wait_for_quiet
from megatron_pec.testing import launch

SHM = Path("/dev/shm/bench_helper/metadata_scale")
WORK = Path("/tmp/bench_helper_metadata_scale")
RESTORE_TOOK = re.compile(r"rank 0: restore took ([\d.]+) s \((.*)\)")
# (releases before phases.py: "waiting for the agent W s, choosing, reading and checking R s, applying A s, ...")
OLD_PHASES = re.compile(r"choosing, reading and checking ([\d.]+) s, applying ([\d.]+) s")
LOADER_PHASES = {"waiting for the agent", "listing sources", "reading and checking", "agreeing", "deciding",
                 "the rest of the loader"}
CACHE_EVICT_BYTES = 256 << 20  # written before each timed floor copy: several times any last-level cache
MODEL = ["--num-layers", "58", "--moe-router-topk", "8", "--expert-model-parallel-size", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--moe-ffn-hidden-size", "16", "--ffn-hidden-size", "64", "--seq-length", "32",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "1", "--log-interval", "1",
         "--eval-iters", "1", "--eval-interval", "1000", "--pec-snapshot-k", "8", "--pec-persist-k", "4",
         "--non-persistent-save-interval", "1", "--save-interval", "2", "--pec-keep-shm"]


def run(repo: Path, experts: int, iters: int) -> dict:
    shutil.rmtree(SHM, ignore_errors=True)
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    metrics = WORK / "metrics.jsonl"
    job = launch.Launch(repo / "examples" / "gpt_moe" / "pretrain_gpt_moe.py",
                        (*MODEL, "--num-experts", str(experts), "--train-iters", str(iters), "--save",
                         str(WORK / "ckpt"), "--pec-shm-dir", str(SHM), "--pec-job-id", "scale", "--metrics-file",
                         str(metrics)), nproc=2)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(repo))
    started = time.monotonic()
    proc = launch.run(job, capture_output=True, text=True, env=env, cwd=repo, timeout=1800)
    row = {"experts": experts, "wall_s": round(time.monotonic() - started, 1)}
    if proc.returncode != 0:
        error = next((line.strip() for line in reversed((proc.stdout + proc.stderr).splitlines())
                      if "Error" in line and "ChildFailed" not in line), "failed")
        _stop_agents()
        return {**row, "error": error[-200:]}
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("save_blocking_s") is not None]
    row["blocking_ms"] = round(1000 * statistics.median(r["save_blocking_s"] for r in records[1:]), 2)
    phases = [r["save_phases_s"] for r in records[1:] if r.get("save_phases_s")]  # (releases before: none)
    if phases:
        names = dict.fromkeys(name for p in phases for name in p)
        row["save_phases_ms"] = {name: round(1000 * statistics.median(p.get(name, 0.0) for p in phases), 2)
                                 for name in names}
    row.update(_slot_facts())
    row.update(_rank_file_facts(WORK / "ckpt"))
    row["memcpy_ms"] = round(1000 * _memcpy_s(row["bytes_per_save"]), 2)
    row["fixed_ms"] = round(row["blocking_ms"] - row["memcpy_ms"], 2)
    row.update(_restart(repo, job, env, iters))
    _stop_agents()
    return row


def _restart(repo: Path, job: launch.Launch, env: dict, iters: int) -> dict:
    """A restarted trainer (fresh processes, the node agent and its memory kept) restores the newest
    snapshot from node memory and trains one more iteration: rank 0's restore time, as it logs it."""
    args = list(job.args)
    at = args.index("--train-iters")
    again = replace(job, args=(*args[:at], "--train-iters", str(iters + 1), "--load", str(WORK / "ckpt"),
                               *args[at + 2:]))
    proc = launch.run(again, capture_output=True, text=True, env=env, cwd=repo, timeout=1800)
    took = RESTORE_TOOK.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or took is None:
        return {"restore_error": "the restart failed" if proc.returncode else "no restore logged"}
    old = OLD_PHASES.search(took.group(2))
    if old:
        return {"restore_s": float(took.group(1)), "restore_reading_s": float(old.group(1)),
                "restore_applying_s": float(old.group(2))}
    phases = {}
    for part in took.group(2).split(", "):  # "copy 0.123 s"
        name, seconds, _ = part.rsplit(" ", 2)
        phases[name] = float(seconds)
    reading = sum(s for name, s in phases.items() if name in LOADER_PHASES)
    return {"restore_s": float(took.group(1)), "restore_reading_s": round(reading, 3),
            "restore_applying_s": round(sum(phases.values()) - reading, 3), "restore_phases_s": phases}


def _slot_facts() -> dict:
    """Rank 0's newest complete snapshot: its home slot's header, the expert pool's, and the bytes it wrote."""
    from megatron_pec.memory.slots import SlotCache, open_slot

    best = None
    for path in SHM.glob("scale/node0/rank0.slot*"):
        mapping, header = open_slot(str(path))
        mapping.close()
        if header.metadata.get("state") == "complete":
            it = int(header.metadata["iteration"])
            if best is None or it > best[0]:
                best = (it, header)
    _, header = best
    layout = SlotCache().layout(str(SHM / "scale" / "node0"), 0)
    written = set(json.loads(header.metadata["items"]))
    pool = SHM / "scale" / "node0" / "rank0.pool"
    with open(pool, "rb") as f:
        pool_header = 8 + int.from_bytes(f.read(8), "little")
    meta = len(json.dumps(header.metadata, separators=(",", ":")))
    return {"tensors_per_rank": len(layout.full_entries()), "slot_header_bytes": 8 + header.header_len + pool_header,
            "metadata_bytes": meta, "bytes_per_save": sum(layout.nbytes(i) for i in written)}


def _rank_file_facts(root: Path) -> dict:
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import open_storage

    checkpoints = CheckpointDir(str(root), open_storage("posix"))
    newest = checkpoints.committed_iterations()[0]
    path = Path(checkpoints.rank_file(newest, 0))
    with open(path, "rb") as f:
        return {"rank_file_header_bytes": 8 + int.from_bytes(f.read(8), "little")}


def _memcpy_s(nbytes: int) -> float:
    """One copy of ``nbytes`` into a mapped tmpfs file, as a snapshot writes its slot (pages touched once
    before, as the slots' are), from memory that is not in the CPU's caches: the training step between
    two saves streams far more than the last-level cache through it (a hot copy of a few MiB would run
    from the cache and make the floor several times too low)."""
    import mmap

    import torch

    n = max(1, nbytes // 4)
    path = SHM.parent / "memcpy_floor"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w+b") as f:
        f.truncate(4 * n)
        mapping = mmap.mmap(f.fileno(), 4 * n)
    try:
        dst, src = torch.frombuffer(mapping, dtype=torch.float32, count=n), torch.rand(n)
        evict = torch.empty(CACHE_EVICT_BYTES // 4)
        dst.copy_(src)
        times = []
        for _ in range(7):
            evict.fill_(1.0)
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        del dst
    finally:
        mapping.close()
        path.unlink()
    return statistics.median(times)


def _stop_agents() -> None:
    launch.stop_agents(SHM)
    shutil.rmtree(SHM, ignore_errors=True)


def table(rows: list[dict]) -> str:
    head = ("| E per layer | tensors per rank | slot header | metadata per save | persisted header | bytes per save "
            "| blocking | memcpy of those bytes | fixed per save | the save's phases (ms) "
            "| restore from memory (reading; applying) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['experts']} | failed: {r['error']} |||||||||| ")
            continue
        lines.append(f"| {r['experts']} | {r['tensors_per_rank']:,} | {r['slot_header_bytes'] / 2**20:.2f} MiB | "
                     f"{r['metadata_bytes'] / 2**10:.0f} KiB | {r['rank_file_header_bytes'] / 2**10:.0f} KiB | "
                     f"{r['bytes_per_save'] / 2**20:.2f} MiB | {r['blocking_ms']:.1f} ms | {r['memcpy_ms']:.2f} ms | "
                     f"{r['fixed_ms']:.1f} ms | {_phases_cell(r.get('save_phases_ms'))} | {_restore_cell(r)} |")
    return "\n".join(lines)


def _phases_cell(phases: dict | None) -> str:
    if not phases:
        return "-"
    return ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(phases.items(), key=lambda kv: -kv[1]) if ms >= 0.05)


def _restore_cell(r: dict) -> str:
    if "restore_s" not in r:
        return r.get("restore_error", "-")
    return f"{r['restore_s']:.2f} s ({r['restore_reading_s']:.2f}; {r['restore_applying_s']:.2f})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,64,256")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repo", type=Path, default=REPO, help="the megatron-pec checkout to run (default: this one)")
    p.add_argument("--label", default="", help="suffix of the result files (e.g. before)")
    args = p.parse_args(argv)
    quiet = wait_for_quiet()
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    rows = []
    for e in map(int, args.experts.split(",")):
        print(f"[metadata_scale] E={e} ({args.repo}, {commit}) ...", flush=True)
        rows.append(run(args.repo.resolve(), e, args.iters))
        print(f"[metadata_scale] {rows[-1]}", flush=True)
    text = (f"# Metadata at scale (58 MoE layers, top-8, EP=2, 2 CPU ranks; megatron-pec {commit})\n\n"
            f"`python -m benchmarks.metadata_scale {' '.join(argv or sys.argv[1:])}`\n\n{table(rows)}\n")
    print(text)
    name = "metadata_scale" + (f"_{args.label}" if args.label else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": machine(), "load": quiet, "commit": commit,
                                                      "rows": rows}, indent=1))
    (RESULTS / f"{name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
