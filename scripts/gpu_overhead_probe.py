"""Where the example's step overhead and a relaunched restore go on a GPU (a probe, not a benchmark: the
rows that count are benchmarks.gpu's). Runs the example trainer on the GPU model without checkpoints, at K=all
persisting every 20, at K=all in memory only, at K=all with the node agent's threads at nice 19, and at
snapshot-K 2 in memory only, printing every step time; then a trainer killed and relaunched twice, printing
its restore lines. ~250 s on an H200. Its output from 2026-11-26: benchmarks/results/logs/gpu_h200_overhead_diagnosis.log

    python3 scripts/gpu_overhead_probe.py     # on the GPU machine, with the wheels of scripts/gpu_wheels.sh
"""
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu
from megatron_pec.testing import launch

model = gpu.GPU_MODEL
iters = 40
workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_diag_"))
shm = Path("/dev/shm") / workdir.name
env = {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
t0 = time.monotonic()

def say(m):
    print(f"[diag +{time.monotonic()-t0:5.0f}s] {m}", flush=True)

def renicer(root, stop):
    done = set()
    while not stop.is_set():
        for pid in launch.agents(root):
            for task in os.listdir(f"/proc/{pid}/task") if os.path.exists(f"/proc/{pid}/task") else []:
                if (pid, task) not in done:
                    try:
                        os.setpriority(os.PRIO_PROCESS, int(task), 19); done.add((pid, task))
                    except OSError:
                        pass
        time.sleep(0.2)

def steps(r):
    return [round(x["step_s"] + (x.get("save_blocking_s") or 0), 4) for x in r["rows"] if "step_s" in x]

base = gpu.example("base", workdir, model, iters, [], env)
b = gpu.example_row(base, None, None)["step_s"]
base_row = gpu.example_row(base, None, None)
say(f"base step {b} (thread CPU {base_row['step_cpu_s']}, GPU stream {base_row['device_step_s']}): {steps(base)}")
runs = {
    "all": gpu.SCHEDULE.megatron_flags(),
    "all_memonly": ["--non-persistent-save-interval", "1", "--save-interval", "100000"],
    "all_nice": gpu.SCHEDULE.megatron_flags(),
    "pec2_memonly": ["--non-persistent-save-interval", "1", "--save-interval", "100000", "--pec-snapshot-k", "2"],
}
for name, extra in runs.items():
    stop = threading.Event()
    if name.endswith("nice"):
        threading.Thread(target=renicer, args=(shm / name, stop), daemon=True).start()
    ck = ["--save", str(workdir / f"ck_{name}"), "--pec-shm-dir", str(shm), "--pec-job-id", name, *extra]
    r = gpu.example(name, workdir, model, iters, ck, env)
    stop.set()
    row = gpu.example_row(r, b, shm / name / "node0")
    say(f"{name}: exit {r['code']} overhead {row['step_overhead']} blocking {row['blocking_s_median']} "
        f"thread CPU {row['step_cpu_s']} GPU stream {row['device_step_s']} "
        f"skipped {row['skipped']}\n   steps {steps(r)}\n   blocking {[x.get('save_blocking_s') for x in r['rows']]}")
    ag = shm / name / "node0" / "agent_cpu.json"
    if ag.exists():
        say(f"   agent ledger: {ag.read_text()[:800]}")
    launch.stop_agents(shm / name)

ck = ["--save", str(workdir / "ck_k"), "--load", str(workdir / "ck_k"), "--pec-shm-dir", str(shm),
      "--pec-job-id", "killed", *gpu.SCHEDULE.megatron_flags()]
gpu.example("killed", workdir, model, iters, ck, dict(env, MEGATRON_PEC_FAULT=f"optimizer_step=kill@{gpu.KILL_AT}:0"))
for attempt, fault in (("resumed", {"MEGATRON_PEC_FAULT": f"optimizer_step=kill@{gpu.KILL_AT + 3}:0"}), ("resumed2", {})):
    r = gpu.example(attempt, workdir, model, gpu.KILL_AT + 6, ck, dict(env, **fault))
    say(f"{attempt}: exit {r['code']}")
    for line in r["log"].splitlines():
        if re.search(r"restor|kernel|checksum|took|warn|error", line, re.I) and len(line) < 3000:
            print("   | " + line, flush=True)
launch.stop_agents(shm)
shutil.rmtree(shm, ignore_errors=True)
say("done")
