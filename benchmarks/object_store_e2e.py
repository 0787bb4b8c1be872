"""The example trainer persisting to ``msc://`` and restoring from the store alone, for
``benchmarks/object_store.py --end-to-end``: 2 CPU ranks (EP 2) train ``ITERS`` iterations and persist the
last; with node memory gone, a relaunch restores it. The restore's "reading and checking" phase (its log
line "restore took ... s (phases)", the slower rank) against the bytes of the rank files it read.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.testing import launch

SCRIPT = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
# ~18 M parameters: ~290 MB of state (parameters, gradients' main copy, Adam's two moments) over 2 ranks
MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8", "--num-experts", "8",
         "--moe-ffn-hidden-size", "1024", "--expert-model-parallel-size", "2", "--seq-length", "64",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "100", "--eval-iters", "1"]
ITERS = 2


def _train(args: list[str], timeout: float) -> str:
    logs = Path(tempfile.mkdtemp(prefix="bench-s3e2e-logs-"))
    job = launch.Launch(SCRIPT, tuple(args), nproc=2, options=("--log-dir", str(logs), "--redirects", "3"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    try:
        proc = launch.run(job, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        text = "\n".join([f.read_text(errors="replace") for f in sorted(logs.rglob("*.log"))]
                         + [proc.stdout, proc.stderr])
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the example trainer failed (exit {proc.returncode}):\n{text[-4000:]}")
    return text


def run(url: str, storage, log=print, timeout: float = 600.0) -> dict:
    """Persist iteration ``ITERS`` of the example under ``url``, then restore it from the store alone."""
    shm = Path("/dev/shm") / f"bench-s3e2e-{os.getpid()}"
    args = [*MODEL, "--save", url, "--load", url, "--enable-msc", "--save-interval", str(ITERS),
            "--pec-shm-dir", str(shm), "--pec-job-id", "bench-s3e2e"]
    d = CheckpointDir(url, storage)
    try:
        started = time.monotonic()
        _train([*args, "--train-iters", str(ITERS)], timeout)
        while ITERS not in d.committed_iterations():  # (the agents persist after the trainers exit)
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"iteration {ITERS} not committed under {url}")
            time.sleep(0.2)
        saved_s = time.monotonic() - started
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)  # node memory gone: the store alone
        text = _train([*args, "--train-iters", str(ITERS + 1)], timeout)
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    if f"restored iteration {ITERS} from storage" not in text:
        raise RuntimeError(f"no restore from storage:\n{text[-4000:]}")
    pec = f"{url}/iter_{ITERS:07d}/pec"
    files = [f"{pec}/{name}" for name in storage.list(pec)]
    rank_bytes = sum(storage.size(f) for f in files)
    reading = [float(s) for s in re.findall(r"reading and checking ([\d.]+) s", text)]
    total = [float(s) for s in re.findall(r"restore took ([\d.]+) s", text)]
    log(f"[bench] end to end: {rank_bytes / 1e6:.0f} MB of rank files; restore took {total} s, reading and "
        f"checking {reading} s")
    return {"rank_file_bytes": rank_bytes, "restore_s": total, "reading_and_checking_s": reading,
            "train_and_persist_s": round(saved_s, 2), "model": MODEL, "rank_files": files,
            "restore_lines": re.findall(r"restore took .*", text)}


__all__ = ["run"]
