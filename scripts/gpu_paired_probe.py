"""A K=all snapshot's cost on the example's step, paired within one run (benchmarks/paired_cost.py), for each
copy path in turn: the checksum kernel on N programs (MEGATRON_PEC_COPY_PROGRAMS) and the copy engine
(--pec-copy-engine). A probe for choosing the default path on a GPU (~35 s a path on an H200); each path's
line prints as its run ends. PAIRED_PATHS (default "kernel4,engine,kernel16,kernel2") picks them.

    python3 scripts/gpu_paired_probe.py     # on the GPU machine, with scripts/gpu_wheels.sh's wheels
"""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402 (after the set-up above)

from benchmarks import gpu  # noqa: E402 (after the set-up above)

model = gpu.GPU_MODEL if torch.cuda.is_available() else gpu.CPU_MODEL  # (CPU: a dry run of this script)
iters = gpu.SIZES["cuda" if torch.cuda.is_available() else "cpu"].iters
workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_paired_"))
shm = Path("/dev/shm") / workdir.name
env = {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
t0 = time.monotonic()
paths = os.environ.get("PAIRED_PATHS", "kernel4,engine,kernel16,kernel2").split(",")
unknown = [name for name in paths if name != "engine" and not name.removeprefix("kernel").isdigit()]
if unknown:
    sys.exit(f"PAIRED_PATHS: {unknown} are not copy paths: name 'engine' or 'kernelN' (N programs), "
             "e.g. kernel4,engine")
for path in paths:
    extra, env_extra = (("--pec-copy-engine",), {}) if path == "engine" else \
        ((), {"MEGATRON_PEC_COPY_PROGRAMS": path.removeprefix("kernel")})
    r, p = gpu.paired_run(path, workdir, shm, model, iters, dict(env, **env_extra), extra)
    row = gpu.example_row(r, None, None)
    shown = p and (f"{p['cost_s_median'] * 1e3:.1f} ms a snapshot = {p['overhead'] * 100:+.1f}% of the clean step "
                   f"{p['clean_step_s_median'] * 1e3:.1f} ms; costs (ms) {[round(c * 1e3, 1) for c in p['costs_s']]}")
    blocking = row["blocking_s_median"]
    print(f"[paired +{time.monotonic() - t0:4.0f}s] {path}: exit {r['code']}, blocking median "
          f"{'-' if blocking is None else f'{blocking * 1e3:.2f}'} ms; {shown}", flush=True)
