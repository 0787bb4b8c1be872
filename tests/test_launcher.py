"""The Megatron-LM launcher (``examples/megatron_lm/launch_pretrain_gpt.sh``) builds a command Megatron-LM
accepts, checked with a stand-in ``torchrun`` that prints it: a short run's warmup stays below its
iterations, and without Transformer Engine the local implementations are asked for."""

import os
import stat
import subprocess

from conftest import REPO

LAUNCHER = REPO / "examples" / "megatron_lm" / "launch_pretrain_gpt.sh"


def launch(tmp_path, **env):
    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "training").mkdir(parents=True)
    (checkout / "pretrain_gpt.py").write_text("import megatron_pec\n")
    (checkout / "megatron" / "training" / "training.py").write_text("import megatron_pec\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    torchrun.write_text('#!/bin/sh\necho "$@"\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    full = dict(os.environ, MEGATRON_LM=str(checkout), DATA_PATH="/data/x", VOCAB_FILE="v", MERGE_FILE="m",
                GPUS_PER_NODE="1", PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON="python3", **env)
    return subprocess.run(["bash", str(LAUNCHER)], capture_output=True, text=True, env=full, cwd=tmp_path)


def test_a_short_run_warms_up_for_less_than_it_trains(tmp_path):
    result = launch(tmp_path, TRAIN_ITERS="50")
    assert result.returncode == 0, result.stderr
    args = result.stdout.split()
    assert args[args.index("--lr-warmup-iters") + 1] == "5" and args[args.index("--train-iters") + 1] == "50"
    long_run = launch(tmp_path / "long", TRAIN_ITERS="20000").stdout.split()
    assert long_run[long_run.index("--lr-warmup-iters") + 1] == "200"
    bad = launch(tmp_path / "bad", TRAIN_ITERS="50", LR_WARMUP_ITERS="50")
    assert bad.returncode != 0 and "must be below TRAIN_ITERS" in bad.stderr


def test_without_transformer_engine_the_local_implementations_are_used(tmp_path):
    result = launch(tmp_path)
    assert result.returncode == 0, result.stderr
    has_te = subprocess.run(["python3", "-c", "import transformer_engine"], capture_output=True).returncode == 0
    for flag in ("--transformer-impl", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
                 "--no-masked-softmax-fusion", "--no-bias-dropout-fusion"):
        assert (flag in result.stdout.split()) is not has_te, flag
    assert has_te or "no Transformer Engine" in result.stderr
