"""DeepSeek-V3's expert topology (58 MoE layers x 256 experts, top-8, EP=2; tiny widths so it
runs on CPU) trains with a save every iteration, restores, and ``inspect``/``verify``/``export`` read it.
Before, each rank's ~10 MB header outgrew its reserve and the first save died mid-training."""

import json
import subprocess
import sys
import tempfile
from contextlib import ExitStack

import pytest
from conftest import REPO, read_jsonl, torchrun

pytestmark = pytest.mark.multiprocess

PRETRAIN = str(REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py")
DEEPSEEK_V3_EXPERTS = ["--num-layers", "58", "--num-experts", "256", "--moe-router-topk", "8",
                       "--expert-model-parallel-size", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--moe-ffn-hidden-size", "16", "--ffn-hidden-size", "64", "--seq-length", "32",
                       "--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "1",
                       "--log-interval", "1", "--eval-iters", "1", "--save-interval", "1",
                       "--pec-snapshot-k", "8", "--pec-persist-k", "4"]


def test_deepseek_v3_expert_topology_saves_restores_and_exports(tmp_path, shm_dir):
    ckpt = tmp_path / "ckpt"
    common = DEEPSEEK_V3_EXPERTS + ["--save", str(ckpt), "--load", str(ckpt), "--pec-shm-dir", shm_dir,
                                    "--pec-job-id", "dsv3"]
    # Killed in its third step (a clean end would save every expert: nothing older to restore), so the restart
    # restores 2 from node memory with most experts at older versions.
    torchrun(PRETRAIN, *common, "--train-iters", "3", timeout=600, check=False,
             env={"MEGATRON_PEC_FAULT": "optimizer_step=kill@3:0"})
    proc = torchrun(PRETRAIN, *common, "--train-iters", "3", "--metrics-file", str(tmp_path / "second.jsonl"),
                    timeout=600)
    for rank in (0, 1):
        line = next(x for x in proc.stdout.splitlines() if f"rank {rank}: restored iteration" in x)
        assert f"rank {rank}: restored iteration 2 from memory; experts from older versions:" in line, line
        assert len(line) < 300, line  # thousands of older experts are counted, not listed
    resumed = [r for r in read_jsonl(tmp_path / "second.jsonl") if "lm loss" in r]
    assert [r["iteration"] for r in resumed] == [3]
    # Where the save blocked (the metrics' save_phases_s): its phases add up to the blocking time.
    phases = resumed[0]["save_phases_s"]
    assert {"slot", "agreement", "copy", "plan", "metadata"} <= set(phases), phases
    assert 0.5 * resumed[0]["save_blocking_s"] < sum(phases.values()) <= resumed[0]["save_blocking_s"]

    # The four commands only read the checkpoint (each export writes its own directory) and each is one
    # single-threaded process: run side by side, the cores share them.
    inspected, verified, exported, exported_2 = megatron_pec_together(
        ("inspect", ckpt, "--json"), ("verify", ckpt), ("export", ckpt, tmp_path / "hf"),
        ("export", ckpt, tmp_path / "hf2", "--iteration", "2"))
    assert inspected.returncode == 0, inspected.stderr
    iterations = {e["iteration"]: e for e in json.loads(inspected.stdout)["iterations"]}
    assert iterations[3]["committed"] and iterations[3]["persist_k"] == 4
    assert len(iterations[3]["expert_versions"]) == 58 * 256
    assert verified.returncode == 0, verified.stdout
    assert exported.returncode == 0, exported.stderr
    summary = json.loads((tmp_path / "hf" / "pec_export.json").read_text())
    assert summary["iteration"] == 3 and len(summary["expert_versions"]) == 58 * 256
    # Persist K = 4 of 256 per layer, but training ended at 3: the end saved every expert at 3 once more.
    assert summary["experts_older_than_iteration"] == 0
    # Iteration 2, persisted with K = 4 before the kill: most experts come from older versions, as recorded.
    assert exported_2.returncode == 0, exported_2.stderr
    summary = json.loads((tmp_path / "hf2" / "pec_export.json").read_text())
    assert summary["iteration"] == 2 and summary["experts_older_than_iteration"] >= 58 * (256 - 2 * 4)


def megatron_pec_together(*commands: tuple, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """``python -m megatron_pec ARGS`` for each of ``commands``, all started at once; their results, in order
    (output through files: a pipe nobody reads yet would stall a command that prints much)."""
    with ExitStack() as stack:
        started = []
        for args in commands:
            out, err = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2))
            proc = subprocess.Popen([sys.executable, "-m", "megatron_pec", *map(str, args)], cwd=REPO, stdout=out,
                                    stderr=err, text=True)
            stack.callback(lambda p=proc: p.poll() is None and (p.kill(), p.wait()))  # (a failed wait: no orphans)
            started.append((proc, out, err))
        results = []
        for proc, out, err in started:
            proc.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
        return results
