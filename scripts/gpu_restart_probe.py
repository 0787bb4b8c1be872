"""A relaunched trainer's restore from node memory, timed RESTARTS times against the host-to-device floor:
``benchmarks.gpu``'s kill-and-restart (the example SIGKILLed in optimizer step KILL_AT, with a snapshot every
iteration), then relaunches that each restore iteration KILL_AT - 1 from node memory and are killed in their
first optimizer step, that same step again, before they snapshot anything new. The benchmark times one such
restore; a median over several says what a change to the restore's path did (~25 s a relaunch on an H200).
Each restore's line prints as it ends, its phases with it.

    python3 scripts/gpu_restart_probe.py     # on the GPU machine, with scripts/gpu_wheels.sh's wheels
    RESTARTS=5 python3 scripts/gpu_restart_probe.py
"""
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import gpu  # noqa: E402
from megatron_pec.testing import launch  # noqa: E402

import torch  # noqa: E402

cuda = torch.cuda.is_available()
model = gpu.GPU_MODEL if cuda else gpu.CPU_MODEL  # (CPU: a dry run of this script)
restarts = int(os.environ.get("RESTARTS", "3"))
workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_restart_"))
shm = Path("/dev/shm") / workdir.name
env = {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
# (a fault fires on the n-th time its point is reached in a process: a relaunch's first step is its 1st)
first, again = (dict(env, MEGATRON_PEC_FAULT=f"optimizer_step=kill@{n}:0") for n in (gpu.KILL_AT, 1))
ck = ["--save", str(workdir / "ck"), "--load", str(workdir / "ck"), "--pec-shm-dir", str(shm),
      "--pec-job-id", "restart", *gpu.SCHEDULE.megatron_flags()]
t0 = time.monotonic()
iters = gpu.SIZES["cuda" if cuda else "cpu"].iters
killed = gpu.example("killed", workdir, model, iters, ck, first)
plan = shm / "restart" / "node0" / "rank0.memory.json"
restored_bytes = json.loads(plan.read_text())["state_bytes"] if plan.exists() else 2**26
floor = gpu.floors(restored_bytes, cuda)["h2d_s"]
print(f"[restart +{time.monotonic() - t0:4.0f}s] killed in optimizer step {gpu.KILL_AT} (exit {killed['code']}); "
      f"{restored_bytes / 1e6:.0f} MB to restore, host-to-device floor {floor * 1e3:.1f} ms", flush=True)
took = []
for n in range(restarts):
    r = gpu.example(f"resumed{n}", workdir, model, iters, ck, again)
    restore, line = gpu.RESTORE.search(r["log"]), gpu.RESTORED.search(r["log"])
    if restore is None or line is None:
        print(f"[restart +{time.monotonic() - t0:4.0f}s] relaunch {n}: no restore (exit {r['code']}, "
              f"see {r['log_path']})", flush=True)
        continue
    took.append(float(restore.group(1)))
    print(f"[restart +{time.monotonic() - t0:4.0f}s] relaunch {n}: restored {line.group(1)} from {line.group(2)} in "
          f"{took[-1] * 1e3:.1f} ms = {took[-1] / floor:.2f}x the floor ({restore.group(2)})", flush=True)
launch.stop_agents(shm / "restart")
if took:
    print(f"[restart] median of {len(took)}: {statistics.median(took) * 1e3:.1f} ms = "
          f"{statistics.median(took) / floor:.2f}x the host-to-device floor of {floor * 1e3:.1f} ms", flush=True)
