"""Checkpoint benchmark driver: every method measured side by side, in one run, on the real
megatron-core GPT-MoE (2 ranks, gloo, CPU), next to the memcpy and write+fsync floors.

    python -m benchmarks.checkpoint --quick --json out.json    # <= 10 minutes on 2 cores
    python -m benchmarks.checkpoint --full  --json out.json    # 3 model sizes, more saves

Each model size is one torchrun job (``benchmarks/worker.py``) that measures every method in
the same process group; a second job measures the experts-scaling curve. Before each job the
driver waits (up to a few minutes) for the machine's 1-minute load to drop below 1.5 and
records it. Results: the JSON (``--json`` and ``benchmarks/results/<mode>.json``), a markdown
table and PNG plots under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks import report, targets
from benchmarks.common import REPO, RESULTS, machine, wait_for_quiet
from megatron_pec.testing import launch

COMMON = ["--num-layers", "2", "--num-attention-heads", "4", "--moe-router-topk", "2",
          "--expert-model-parallel-size", "2", "--seq-length", "64", "--micro-batch-size", "4",
          "--global-batch-size", "8", "--train-iters", "5000", "--lr-warmup-iters", "5",
          "--hidden-dropout", "0", "--attention-dropout", "0"]

PROFILES = {
    "quick": {
        "runs": [["--hidden-size", "256", "--num-experts", "8"]],
        "saves": 5, "iters": 8, "intervals": "1,4",
        "scaling": ["--hidden-size", "128"], "scaling_saves": 3,
    },
    "full": {
        "runs": [["--hidden-size", "256", "--num-experts", "8"],
                 ["--hidden-size", "512", "--num-experts", "8"],
                 ["--hidden-size", "512", "--num-experts", "16"]],
        "saves": 7, "iters": 8, "intervals": "1,4,8",
        "scaling": ["--hidden-size", "256"], "scaling_saves": 5,
    },
}
METHODS = "pec_all,pec_4,pec_2,pec_1,torch_dist_sync,torch_dist_async,legacy,dlrover"


def torchrun(worker_args: list[str], model_args: list[str], port: int, run_id: str, log_path: str,
             timeout: float) -> None:
    """The benchmark worker on 2 ranks; ``port`` is the first master port tried."""
    job = launch.Launch("benchmarks.worker", ("--run-id", run_id, *worker_args, "--", *COMMON, *model_args), nproc=2,
                        module=True, options=("--rdzv-id", run_id))
    port = launch.free_port(port)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"[bench] {shlex.join(launch.command(job, port)[1:])}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        code = launch.run(job, port=port, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                          timeout=timeout).returncode
    with open(log_path) as f:
        for line in f:
            if line.startswith("[bench"):
                print(line.rstrip(), flush=True)
    if code:
        raise SystemExit(f"benchmark worker failed with exit code {code}; see {log_path}")


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    mode = "full" if a.full else "quick"
    prof = PROFILES[mode]
    os.makedirs(RESULTS, exist_ok=True)
    logs = os.path.join(RESULTS, "logs")
    os.makedirs(logs, exist_ok=True)
    command = "python -m benchmarks.checkpoint " + " ".join(argv if argv is not None else sys.argv[1:])
    start = time.time()
    result = {"mode": mode, "command": command, "machine": machine(), "runs": []}
    loads = _run_models(a, mode, prof, logs, result)
    if not a.no_scaling:
        loads.append(wait_for_quiet(max_wait_s=a.max_load_wait))
        part = os.path.join(logs, f"{mode}_scaling.json")
        torchrun(["--mode", "scaling", "--out", part, "--saves", str(prof["scaling_saves"]),
                  "--experts", "4,8,16,32"], prof["scaling"], a.port + 20, f"bench{os.getpid()}sc",
                 os.path.join(logs, f"{mode}_scaling.log"), timeout=3600)
        with open(part) as f:
            result["scaling"] = json.load(f)
    _summarize(result, loads)
    result["wall_s"] = round(time.time() - start, 1)
    out = os.path.join(RESULTS, f"{mode}.json")
    for path in filter(None, (out, a.json)):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(RESULTS, f"{mode}.md"), "w") as f:
        f.write(report.markdown(result))
    pngs = report.plots(result, RESULTS, mode)
    print(f"[bench] done in {result['wall_s']:.0f}s: {out}, {os.path.join(RESULTS, mode + '.md')}, "
          + ", ".join(pngs), flush=True)
    for t in result["targets"]:
        print(f"[bench] {t}", flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="one ~50 MB/rank model + small scaling run (default)")
    g.add_argument("--full", action="store_true", help="~50, ~200 and ~400 MB/rank models, more saves")
    p.add_argument("--json", default=None, help="also write the result JSON here")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--no-scaling", action="store_true")
    p.add_argument("--port", type=int, default=29640,
                   help="first master port tried (the launcher takes the next free one)")
    p.add_argument("--max-load-wait", type=float, default=180.0)
    p.add_argument("--resume", action="store_true",
                   help="reuse the per-model results (benchmarks/results/logs/<mode>_run<i>.json, each one "
                        "self-contained torchrun job) that an interrupted invocation already finished")
    return p


def _run_models(a, mode: str, prof: dict, logs: str, result: dict) -> list[dict]:
    """One torchrun per model of the profile (or its finished part, with --resume) into ``result["runs"]``;
    the machine's load before each run started."""
    loads, reused = [], []
    for i, model_args in enumerate(prof["runs"]):
        part = os.path.join(logs, f"{mode}_run{i}.json")
        if a.resume and os.path.exists(part):
            with open(part) as f:
                result["runs"].append(json.load(f))
            reused.append({"part": os.path.basename(part), "finished": time.ctime(os.path.getmtime(part))})
            print(f"[bench] reusing {part} (finished {reused[-1]['finished']})", flush=True)
            continue
        loads.append(wait_for_quiet(max_wait_s=a.max_load_wait))
        torchrun(["--mode", "main", "--out", part, "--methods", a.methods, "--saves", str(prof["saves"]),
                  "--iters", str(prof["iters"]), "--intervals", prof["intervals"]], model_args,
                 a.port + i, f"bench{os.getpid()}r{i}", os.path.join(logs, f"{mode}_run{i}.log"), timeout=3600)
        with open(part) as f:
            result["runs"].append(json.load(f))
    result["reused_parts"] = reused
    return loads


def _summarize(result: dict, loads: list[dict]) -> None:
    """The machine's load per run and method; the issue's schema at top level (the largest model's run);
    the targets."""
    result["machine"]["load_1min_before_runs"] = [x["load_1min_before"] for x in loads]
    result["machine"]["load_wait_s"] = [x["waited_s"] for x in loads]
    result["machine"]["load_1min_at_each_method"] = [
        {name: m["load_1min_at_start"] for name, m in r["methods"].items()} for r in result["runs"]]
    last = result["runs"][-1]
    result["model"], result["floors"] = last["model"], {
        "memcpy_s": last["floors"]["memcpy_s"], "write_MBps": last["floors"]["write_MBps"],
        **{k: v for k, v in last["floors"].items() if k not in ("memcpy_s", "write_MBps")}}
    keys = ("blocking_s_median", "blocking_s_p90", "bytes_per_rank", "persist_MBps", "restore_memory_s",
            "restore_storage_s", "train_throughput_ratio")
    result["methods"] = {name: {**{k: m.get(k) for k in keys}, **{k: v for k, v in m.items() if k not in keys}}
                         for name, m in last["methods"].items()}
    result["targets"] = targets.evaluate(result)

if __name__ == "__main__":
    sys.exit(main())
