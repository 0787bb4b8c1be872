"""Megatron's load options through the example trainer: --finetune/--no-load-optim load the weights only
and start at iteration 0; a --load directory in another format is refused with a clear message."""

import pytest
from conftest import REPO, checkpoints, read_jsonl, torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.newest_only]

PRETRAIN = str(REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py")
SMALL = ["--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--expert-model-parallel-size", "2", "--log-interval", "100", "--eval-iters", "1"]


def test_finetune_loads_weights_only_and_foreign_dirs_are_refused(tmp_path, shm_dir):
    ckpt = tmp_path / "ckpt"
    common = SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--pec-shm-dir", shm_dir]
    torchrun(PRETRAIN, *common, "--train-iters", "12", "--save-interval", "12", "--pec-job-id", "a",
             "--metrics-file", str(tmp_path / "first.jsonl"))
    proc = torchrun(PRETRAIN, *common, "--train-iters", "2", "--finetune", "--no-load-optim", "--pec-job-id", "b",
                    "--metrics-file", str(tmp_path / "tuned.jsonl"))
    assert "restored iteration 12 from storage" in proc.stdout
    assert "training from iteration 0 to 2" in proc.stdout
    first = [r["lm loss"] for r in read_jsonl(tmp_path / "first.jsonl") if "lm loss" in r]
    tuned = [r for r in read_jsonl(tmp_path / "tuned.jsonl") if "lm loss" in r]
    assert [r["iteration"] for r in tuned] == [1, 2]
    # The trained weights came back: the first fine-tuning step starts far below the untrained loss.
    assert tuned[0]["lm loss"] < first[0] - 0.5

    # --pretrained-checkpoint with nothing under --load: fine-tune from it, as Megatron does.
    proc = torchrun(PRETRAIN, *SMALL, "--train-iters", "2", "--load", str(tmp_path / "empty"),
                    "--pretrained-checkpoint", str(ckpt), "--pec-shm-dir", shm_dir, "--pec-job-id", "d",
                    "--metrics-file", str(tmp_path / "pretrained.jsonl"))
    assert "fine-tuning from --pretrained-checkpoint" in proc.stdout
    assert "restored iteration 12 from storage" in proc.stdout and "training from iteration 0 to 2" in proc.stdout
    pretrained = [r for r in read_jsonl(tmp_path / "pretrained.jsonl") if "lm loss" in r]
    assert pretrained[0]["lm loss"] < first[0] - 0.5
    proc = torchrun(PRETRAIN, *SMALL, "--train-iters", "2", "--pretrained-checkpoint", str(tmp_path / "empty"),
                    "--pec-shm-dir", shm_dir, "--pec-job-id", "e", check=False)
    assert proc.returncode != 0 and "holds no megatron-pec checkpoint" in proc.stdout + proc.stderr

    foreign = tmp_path / "foreign" / "iter_0000005"
    foreign.mkdir(parents=True)
    (foreign / "mp_rank_00").mkdir()
    proc = torchrun(PRETRAIN, *SMALL, "--train-iters", "2", "--load", str(tmp_path / "foreign"),
                    "--pec-shm-dir", shm_dir, "--pec-job-id", "c", check=False)
    assert proc.returncode != 0
    assert "it is not a megatron-pec checkpoint" in proc.stderr + proc.stdout
    # A user error: the message, not a stack trace from the trainer processes.
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


def test_a_finetune_that_saves_an_iteration_the_directory_holds_commits_it_under_new_names(tmp_path, shm_dir):
    """--finetune into the directory it loads starts again at 0 and saves 4, which the first run
    committed: the first run's files of 4 are never written again, the finetune's save of 4 goes to files
    of its own and replaces the commit atomically (the first run's files go once unreferenced), and
    ``verify`` passes."""
    from megatron_pec.testing.cluster import run_megatron_pec

    ckpt = tmp_path / "ckpt"
    common = SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--pec-shm-dir", shm_dir, "--save-interval", "4"]
    torchrun(PRETRAIN, *common, "--train-iters", "6", "--pec-job-id", "a")
    first = {p.name: p.stat().st_mtime_ns for p in (ckpt / "iter_0000004" / "pec").iterdir()
             if p.name.startswith("rank_")}
    generation = checkpoints(ckpt).read_manifest(4).generation
    proc = torchrun(PRETRAIN, *common, "--train-iters", "4", "--finetune", "--no-load-optim", "--pec-job-id", "b")
    assert "--finetune saves into" in proc.stdout + proc.stderr  # the restart would resume from the first run's 6
    m = checkpoints(ckpt).read_manifest(4)
    assert m.generation != generation and m.job_id == "b", m
    files = {p.name for p in (ckpt / "iter_0000004" / "pec").iterdir() if p.name.startswith("rank_")}
    assert not set(first) & {e.file.rsplit("/", 1)[-1] for e in m.ranks.values()}, (first, m.ranks)
    assert files == {e.file.rsplit("/", 1)[-1] for e in m.ranks.values()}  # the first run's files of 4 went
    verify = run_megatron_pec("verify", ckpt)
    assert verify.returncode == 0, verify.stdout + verify.stderr
