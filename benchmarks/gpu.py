"""The node tier on one GPU: copy floors, the example trainer with a snapshot every iteration, a restore
from node memory - the rows of ``benchmarks/results/gpu.json``.

    python -m benchmarks.gpu                  # a CUDA machine: the model of ../shared/gpu/README.md, ~10 min
    python -m benchmarks.gpu --cpu-standin    # the same runs on CPU ranks with a small model (checks the script)

One rank under torchrun, the example trainer (``examples/gpt_moe``). Runs: ``base`` (no checkpoints),
``all`` (a snapshot every iteration, every expert, a persist every 20), ``pec2`` (snapshot-K 2 /
persist-K 1), ``killed`` (the same as ``all``, the trainer SIGKILLed in its 31st optimizer step) and
``resumed`` (its restart, from node memory). None waits for a slot (``--pec-wait-for-slot`` off): a
snapshot that finds no free region is skipped and counted. Per run: snapshots skipped, the median step
time and its overhead over ``base``, the median time a save blocks training, the first save's blocking
against the median of the later ones, and the node agent's CPU per memory-only snapshot (its own
ledger). The restart's restore time is compared with the host-to-device floor of the bytes it reads.

Peers, side by side in the same run: the benchmark worker (``benchmarks.worker``, one rank, the same
model) drives megatron-pec (every expert), DLRover's flash checkpoint and Megatron's ``torch_dist``
async save the way each framework is driven, a checkpoint every iteration: skipped snapshots, step
overhead, blocking, restores from memory and storage (``--peers ""`` leaves them out; DLRover must be
installed, ``pip install -e .[bench]``, or its row is an error).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, RESULTS, machine

GPU_MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--num-experts", "8",
             "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "2", "--seq-length", "1024", "--micro-batch-size",
             "4", "--global-batch-size", "8", "--disable-bias-linear"]
CPU_MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-experts", "8",
             "--moe-router-topk", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--disable-bias-linear"]
COMMON = ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "5", "--log-interval", "5",
          "--eval-iters", "1"]
SNAPSHOTS = ["--non-persistent-save-interval", "1", "--save-interval", "20"]
RESTORE = re.compile(r"rank 0: restore took ([0-9.]+) s")
SKIPPED = re.compile(r"skipped the snapshot of iteration (\d+)")
PEERS = "pec_all,dlrover,torch_dist_async"


def floors(nbytes: int, cuda: bool) -> dict:
    """Seconds to copy ``nbytes`` device -> a page-locked /dev/shm mapping and back (CPU ranks: memcpy)."""
    import torch

    device = "cuda" if cuda else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    path = f"/dev/shm/pec_floor_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            host = torch.frombuffer(m, dtype=torch.uint8)
            host.fill_(1)
            if cuda:
                torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)

            def timed(copy) -> float:
                runs = []
                for _ in range(5):
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    copy()
                    if cuda:
                        torch.cuda.synchronize()
                    runs.append(time.perf_counter() - t)
                return statistics.median(runs)

            out = {"bytes": nbytes, "d2h_s": timed(lambda h=host: h.copy_(src, non_blocking=cuda)),
                   "h2d_s": timed(lambda h=host: src.copy_(h, non_blocking=cuda))}
            if cuda:
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            del host
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def run(name: str, workdir: Path, model: list[str], iters: int, extra: list[str], env: dict | None = None) -> dict:
    """One torchrun of the example; its metrics, log and exit code."""
    metrics, log = workdir / f"{name}.jsonl", workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(29500 + os.getpid() % 500), str(REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"),
           *model, *COMMON, "--train-iters", str(iters), "--metrics-file", str(metrics), *extra]
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})),
                              cwd=REPO, timeout=1800).returncode
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    text = log.read_text()
    print(f"[gpu] {name}: exit {code}, {len(rows)} metric rows ({log})", flush=True)
    return {"code": code, "rows": rows, "log": text}


def summary(r: dict, base_step: float | None, warmup: int) -> dict:
    steps = [x for x in r["rows"] if "step_s" in x and x["iteration"] > warmup]
    saves = [x["save_blocking_s"] for x in r["rows"] if x.get("save_blocking_s") is not None]
    step = statistics.median(x["step_s"] + (x.get("save_blocking_s") or 0) for x in steps) if steps else None
    return {"skipped_snapshots": len(set(SKIPPED.findall(r["log"]))),
            "step_s_median": step, "step_overhead": (step / base_step - 1) if step and base_step else None,
            "blocking_s_median": statistics.median(saves[1:]) if len(saves) > 1 else None,
            "first_save_s": saves[0] if saves else None,
            "first_over_later": saves[0] / statistics.median(saves[1:]) if len(saves) > 1 else None}


def peers(workdir: Path, model: list[str], iters: int, env: dict, methods: str, floor: dict) -> tuple[dict, dict]:
    """Every method in ``methods`` measured by the benchmark worker on one rank: (rows by method, errors)."""
    result, log = workdir / "peers.json", workdir / "peers.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
           "--master-port", str(29000 + os.getpid() % 500), "-m", "benchmarks.worker", "--run-id",
           f"gpu{os.getpid()}", "--out", str(result), "--methods", methods, "--iters", str(iters), "--intervals",
           "1", "--", *model, *COMMON, "--train-iters", "5000"]
    env = dict(os.environ, **env, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=3600).returncode
    print(f"[gpu] peers: exit {code} ({log})", flush=True)
    if code or not result.exists():
        return {}, {"worker": f"exit code {code}, see {log}"}
    measured = json.loads(result.read_text())
    rows = {}
    for name, m in measured["methods"].items():
        ratio = (m.get("throughput_ratio_by_interval") or {}).get("1")
        nbytes = m.get("snapshot_bytes_per_rank") or m.get("bytes_per_rank")
        rows[name] = {"skipped_snapshots": m.get("skipped_saves_in_throughput_runs"),
                      "step_overhead": 1 / ratio - 1 if ratio else None,
                      "blocking_s_median": m.get("blocking_s_median"),
                      "restore_memory_s": m.get("restore_memory_s"),
                      "restore_storage_s": m.get("restore_storage_s"),
                      "h2d_floor_s": floor["h2d_s"] * nbytes / floor["bytes"] if nbytes else None,
                      "agent_cpu_s_per_snapshot": None, "bytes_per_rank": nbytes, "harness": "benchmarks.worker"}
    return rows, measured.get("errors", {})


def agent_cpu_per_snapshot(node_dir: Path, snapshots: int) -> float | None:
    """The agent's CPU per snapshot for recording it (header check, node-memory index), from its ledger."""
    try:
        ledger = json.loads((node_dir / "agent_cpu.json").read_text())
    except (OSError, ValueError):
        return None
    phases = ledger.get("phases", {})
    spent = phases.get("checking", 0.0) + phases.get("node-memory index", 0.0)
    return spent / snapshots if snapshots else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-standin", action="store_true", help="CPU ranks and a small model (no GPU needed)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--json", default=None, help="default: benchmarks/results/gpu.json (gpu_cpu_standin.json)")
    p.add_argument("--peers", default=PEERS, help=f"methods of benchmarks.worker to run side by side (default "
                   f"{PEERS}; empty: none)")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_standin
    if not cuda and not args.cpu_standin:
        p.error("no CUDA device: pass --cpu-standin to run the same measurements on CPU ranks")
    model = GPU_MODEL if cuda else CPU_MODEL
    workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_"))
    shm = Path("/dev/shm") / workdir.name
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"), "PYTHONUNBUFFERED": "1"}
    out = {"machine": machine(), "device": torch.cuda.get_device_name() if cuda else "cpu (stand-in)",
           "model": model, "iterations": args.iters, "methods": {}}
    try:
        base = run("base", workdir, model, args.iters, [], env)
        base_step = summary(base, None, 5)["step_s_median"]
        for name, extra in (("all", []), ("pec2", ["--pec-snapshot-k", "2", "--pec-persist-k", "1"])):
            ckpt = ["--save", str(workdir / f"ck_{name}"), "--pec-shm-dir", str(shm), "--pec-job-id", name,
                    "--pec-keep-shm", *SNAPSHOTS, *extra]
            r = run(name, workdir, model, args.iters, ckpt, env)
            s = summary(r, base_step, 5)
            memory_only = sum(1 for x in r["rows"] if x.get("save_blocking_s") is not None) - s["skipped_snapshots"]
            s["agent_cpu_s_per_snapshot"] = agent_cpu_per_snapshot(shm / name / "node0", memory_only)
            out["methods"][name] = s
        ck = ["--save", str(workdir / "ck_k"), "--load", str(workdir / "ck_k"), "--pec-shm-dir", str(shm),
              "--pec-job-id", "killed", *SNAPSHOTS]
        run("killed", workdir, model, args.iters, ck, dict(env, MEGATRON_PEC_FAULT="optimizer_step=kill@31:0"))
        slot = shm / "killed" / "node0" / "rank0.slot0"
        restored_bytes = slot.stat().st_size if slot.exists() else None
        resumed = run("resumed", workdir, model, args.iters, ck, env)
        restore = RESTORE.search(resumed["log"])
        line = re.search(r"rank 0: restored iteration (\d+) from (\w+)", resumed["log"])
        out["floors"] = floors(restored_bytes or 2**26, cuda)
        out["restore"] = {"restored": f"{line.group(1)} from {line.group(2)}" if line else None,
                          "restore_memory_s": float(restore.group(1)) if restore else None,
                          "bytes": restored_bytes,
                          "over_h2d_floor": float(restore.group(1)) / out["floors"]["h2d_s"] if restore else None}
        out["methods"]["all"].update(restore_memory_s=out["restore"]["restore_memory_s"],
                                     h2d_floor_s=out["floors"]["h2d_s"])
        if args.peers:
            rows, out["peer_errors"] = peers(workdir, model, args.iters, env, args.peers, out["floors"])
            out["methods"].update(rows)
    finally:
        subprocess.run(["pkill", "-f", str(shm)], check=False)
        shutil.rmtree(shm, ignore_errors=True)
    path = Path(args.json or RESULTS / ("gpu.json" if cuda else "gpu_cpu_standin.json"))
    path.write_text(json.dumps(out, indent=1))
    ms = lambda v: f"{v * 1e3:.2f}" if v is not None else "-"  # noqa: E731
    command = "python -m benchmarks.gpu" + ("" if cuda else " --cpu-standin")
    lines = [f"# The node tier on {out['device']}", "",
             f"`{command}`, {args.iters} iterations per run; model `{' '.join(model)}`.", "",
             "| run | skipped | step overhead | blocking median (ms) | first save ÷ later | restore from memory (ms) "
             "| H2D floor (ms) | agent CPU per snapshot (ms) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in out["methods"].items():
        overhead = f"{s['step_overhead'] * 100:+.1f}%" if s.get("step_overhead") is not None else "-"
        first = f"{s['first_over_later']:.1f}" if s.get("first_over_later") is not None else "-"
        lines.append(f"| {name} | {s['skipped_snapshots']} | {overhead} | {ms(s['blocking_s_median'])} | {first} | "
                     f"{ms(s.get('restore_memory_s'))} | {ms(s.get('h2d_floor_s'))} | "
                     f"{ms(s['agent_cpu_s_per_snapshot'])} |")
    lines += ["", f"Restart after a kill in optimizer step 31: {out['restore']}.", f"Floors: {out['floors']}."]
    lines += [f"{name}: {error}" for name, error in out.get("peer_errors", {}).items()]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\nwritten: {path} and {path.with_suffix('.md')} (logs: {workdir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
