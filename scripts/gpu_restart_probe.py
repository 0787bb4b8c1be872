"""A relaunched trainer's restore from node memory, timed RESTARTS times against the host-to-device floor:
``benchmarks.gpu``'s kill-and-restart (the example SIGKILLed in optimizer step KILL_AT, with a snapshot every
iteration), then relaunches that each restore iteration KILL_AT - 1 from node memory and are killed in their
first optimizer step, that same step again, before they snapshot anything new. The benchmark times one such
restore; a median over several says what a change to the restore's path did (~25 s a relaunch on an H200).
Each restore's line prints as it ends, its phases with it.

    python3 scripts/gpu_restart_probe.py     # on the GPU machine, with scripts/gpu_wheels.sh's wheels
    RESTARTS=5 python3 scripts/gpu_restart_probe.py
"""
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402 (after the set-up above)

from benchmarks import gpu  # noqa: E402 (after the set-up above)
from megatron_pec.testing import launch  # noqa: E402 (after the set-up above)

cuda = torch.cuda.is_available()
model = gpu.GPU_MODEL if cuda else gpu.CPU_MODEL  # (CPU: a dry run of this script)
iters = gpu.SIZES["cuda" if cuda else "cpu"].iters
restarts = int(os.environ.get("RESTARTS", "3"))
workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_restart_"))
shm = Path("/dev/shm") / workdir.name
env = {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
ck = gpu.restart_flags(workdir, shm, "restart")
t0 = time.monotonic()
took = []
try:
    killed = gpu.example("killed", workdir, model, iters, ck, dict(env, **gpu.kill_in_step(gpu.KILL_AT)))
    restored_bytes = gpu.state_bytes(shm, "restart") or 2**26
    floor = gpu.floors(restored_bytes, cuda)["h2d_s"]
    print(f"[restart +{time.monotonic() - t0:4.0f}s] killed in optimizer step {gpu.KILL_AT} (exit {killed['code']}); "
          f"{restored_bytes / 1e6:.0f} MB to restore, host-to-device floor {floor * 1e3:.1f} ms", flush=True)
    for n in range(restarts):
        # (a fault fires on the n-th time its point is reached in a process: a relaunch's first step is its 1st)
        r = gpu.example(f"resumed{n}", workdir, model, iters, ck, dict(env, **gpu.kill_in_step(1)))
        restore = gpu.restore_in(r["log"])
        if restore is None:
            print(f"[restart +{time.monotonic() - t0:4.0f}s] relaunch {n}: no restore (exit {r['code']}, "
                  f"see {r['log_path']})", flush=True)
            continue
        took.append(restore["seconds"])
        print(f"[restart +{time.monotonic() - t0:4.0f}s] relaunch {n}: restored {restore['restored']} in "
              f"{took[-1] * 1e3:.1f} ms = {took[-1] / floor:.2f}x the floor ({restore['phases']})", flush=True)
finally:  # (the node memory and the checkpoints go, GBs on the GPU model; the logs stay in workdir)
    launch.stop_agents(shm / "restart")
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(workdir / "ck_restart", ignore_errors=True)
if took:
    print(f"[restart] median of {len(took)}: {statistics.median(took) * 1e3:.1f} ms = "
          f"{statistics.median(took) / floor:.2f}x the host-to-device floor of {floor * 1e3:.1f} ms", flush=True)
