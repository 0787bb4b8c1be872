"""Where the example's step overhead and a relaunched restore go on a GPU (a probe, not a benchmark: the
rows that count are benchmarks.gpu's). Runs the example trainer on the GPU model without checkpoints and at
K=all in memory only, a snapshot every iteration, copied by the checksum kernel and by the copy engine
(--pec-copy-engine), each with iterations 21-22 traced by torch.profiler (a summary per step:
scripts/gpu_trace_summary.py; the traces in $OUT/traces.tar.gz); then a trainer killed and relaunched twice,
printing its restore lines. ~200 s on an H200. PROBE_PARTS (default "base,kernel,engine,restore") picks the
parts; PROBE_PROGRAMS (default "16"; a snapshot's copy runs on 4 unless asked): the kernel's programs, one run
each (MEGATRON_PEC_COPY_PROGRAMS).
Its output on an H200 is in the GPU session's log, benchmarks/results/gpu_session_h200.log

    OUT=/tmp/out python3 scripts/gpu_overhead_probe.py     # on the GPU machine, with scripts/gpu_wheels.sh's wheels
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu
from megatron_pec.testing import launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_trace_summary  # noqa: E402 (after the set-up above)
import torch  # noqa: E402 (after the set-up above)

model = gpu.GPU_MODEL if torch.cuda.is_available() else gpu.CPU_MODEL  # (CPU: a dry run of this script)
iters = int(os.environ.get("PROBE_ITERS", "30"))
workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_diag_"))
shm = Path("/dev/shm") / workdir.name
env = {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
t0 = time.monotonic()

def say(m):
    print(f"[diag +{time.monotonic()-t0:5.0f}s] {m}", flush=True)

def steps(r):
    return [round(x["step_s"] + (x.get("save_blocking_s") or 0), 4) for x in r["rows"] if "step_s" in x]

out = Path(os.environ.get("OUT", workdir))
profile = ["--profile", "--profile-step-start", "20", "--profile-step-end", "22"]


def traced(name, extra, env_extra=None):
    trace = ["--tensorboard-dir", str(workdir / f"trace_{name}")]
    r = gpu.example(name, workdir, model, iters, [*extra, *profile, *trace],
                    dict(env, **(env_extra or {})))
    trace = workdir / f"trace_{name}" / "trace_rank0.json.gz"
    if trace.exists():
        print("\n".join("   " + line for line in gpu_trace_summary.summary(gpu_trace_summary.load(str(trace)))),
              flush=True)
    return r


parts = os.environ.get("PROBE_PARTS", "base,kernel,engine,restore").split(",")
b = None
if "base" in parts:
    base = traced("base", [])
    b = gpu.example_row(base, None, None)["step_s"]
    base_row = gpu.example_row(base, None, None)
    say(f"base step {b} (thread CPU {base_row['step_cpu_s']}, GPU stream {base_row['device_step_s']}): {steps(base)}")
memory_only = ["--non-persistent-save-interval", "1", "--save-interval", "100000"]
runs = {}
if "kernel" in parts:
    for programs in os.environ.get("PROBE_PROGRAMS", "16").split(","):
        runs[f"all_memonly_kernel{programs}"] = (memory_only, {"MEGATRON_PEC_COPY_PROGRAMS": programs})
if "engine" in parts:
    runs["all_memonly_engine"] = ([*memory_only, "--pec-copy-engine"], {})
for name, (extra, env_extra) in runs.items():
    ck = ["--save", str(workdir / f"ck_{name}"), "--pec-shm-dir", str(shm), "--pec-job-id", name, *extra]
    r = traced(name, ck, env_extra)
    row = gpu.example_row(r, b, shm / name / "node0")
    say(f"{name}: exit {r['code']} overhead {row['step_overhead']} blocking {row['blocking_s_median']} "
        f"thread CPU {row['step_cpu_s']} GPU stream {row['device_step_s']} "
        f"skipped {row['skipped']}\n   steps {steps(r)}\n   blocking {[x.get('save_blocking_s') for x in r['rows']]}")
    launch.stop_agents(shm / name)
subprocess.run(f"cd {workdir} && tar -czf {out}/traces.tar.gz trace_*/trace_rank0.json.gz", shell=True)
if "restore" not in parts:
    say("done")
    sys.exit(0)

ck = ["--save", str(workdir / "ck_k"), "--load", str(workdir / "ck_k"), "--pec-shm-dir", str(shm),
      "--pec-job-id", "killed", *gpu.SCHEDULE.megatron_flags()]
gpu.example("killed", workdir, model, iters, ck, dict(env, MEGATRON_PEC_FAULT=f"optimizer_step=kill@{gpu.KILL_AT}:0"))
for attempt, fault in (("resumed", {"MEGATRON_PEC_FAULT": f"optimizer_step=kill@{gpu.KILL_AT + 3}:0"}),
                       ("resumed2", {})):
    r = gpu.example(attempt, workdir, model, gpu.KILL_AT + 6, ck, dict(env, **fault))
    say(f"{attempt}: exit {r['code']}")
    for line in r["log"].splitlines():
        wanted = re.search(r"restor|kernel|checksum|took|warn|error", line, re.I)
        if wanted and "warnings.warn" not in line and len(line) < 3000:
            print("   | " + line, flush=True)
launch.stop_agents(shm)
shutil.rmtree(shm, ignore_errors=True)
say("done")
