"""Megatron-LM's own training loop (``pretrain_gpt.py``), patched by ``patches/apply.sh``, on 2 CPU ranks.

For the oldest and the newest supported release, from the archives in ``../shared/megatron-lm/``
(skipped with the reason when they are absent). One job of 10 iterations, a snapshot to node
memory every iteration and a persisted checkpoint every 4, the router's aux-loss-free
``expert_bias`` on (a module buffer, not a parameter), lives through:

1. a planned exit by ``--exit-interval 3`` between two persists: the restart resumes at 3;
2. SIGKILL of both trainers while they snapshot iteration 7 (never announced to the agent): the
   restart restores 6 from memory;
3. SIGKILL while they snapshot iteration 9, then the node agent killed and node memory deleted:
   the restart restores the persisted iteration 8 from storage.

Every loss Megatron logs after each restart equals the uninterrupted run's at that iteration. That needs
every snapshot whole, so the job runs under a budget (``--pec-node-memory 3x``, room for every expert): there
a snapshot waits for the regions a persist still reads (``Save.await_snapshot_room``). Without one it keeps
those experts at their older versions instead of stalling training, as a slow agent on a loaded machine
makes it do, and the restore counts their lost work (PLT): correct, but not the uninterrupted run's losses.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import assert_committed_files_unchanged, checkpoints, committed_files

from megatron_pec.testing import launch, megatron_lm

pytestmark = [pytest.mark.multiprocess, pytest.mark.megatron_lm]

REPO = Path(__file__).resolve().parents[1]
MODEL = [*megatron_lm.SMALL_MOE_ON_CPU, "--log-interval", "1", "--seed", "1234", "--train-iters", "10"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
RESTORED = re.compile(r"megatron-pec: rank (\d): restored iteration (\d+) from (memory|storage)")


@pytest.fixture(params=[megatron_lm.OLDEST, megatron_lm.NEWEST])
def patched_tree(request, tmp_path) -> Path:
    tag = request.param
    if shutil.which("git") is None:
        pytest.skip("git not found: patches/apply.sh needs it")
    tree = megatron_lm.copy_tree(tag, tmp_path / f"Megatron-LM-{tag}")
    if tree is None:
        pytest.skip(f"no archive Megatron-LM-{tag}.tar.gz in {[str(d) for d in megatron_lm.archive_dirs()]}")
    applied = subprocess.run([str(REPO / "patches" / "apply.sh"), str(tree)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return tree


def pretrain(tree: Path, *extra: str, fault: str | None = None) -> tuple[int, str]:
    """Run the script; returns the exit code and the output, rank by rank (torchrun's merged
    stream interleaves the two ranks' lines mid-line)."""
    logs = Path(tempfile.mkdtemp(prefix="mlm-logs-"))
    job = launch.Launch("megatron_pec.testing.megatron_lm_cpu", (str(tree / "pretrain_gpt.py"), *MODEL, *extra),
                        nproc=2, module=True, options=("--log-dir", str(logs), "--redirects", "3"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("MEGATRON_PEC_FAULT", None)
    if fault:
        env["MEGATRON_PEC_FAULT"] = fault
    try:
        proc = launch.run(job, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        per_rank = [f.read_text(errors="replace") for f in sorted(logs.rglob("*.log"), key=lambda f: f.parts[-2:])]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return proc.returncode, "\n".join(per_rank + [proc.stdout, proc.stderr])


def losses(log: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(log)}


def restored(log: str) -> set[tuple[int, str]]:
    found = {(int(rank), int(it), source) for rank, it, source in RESTORED.findall(log)}
    assert {rank for rank, _, _ in found} == {0, 1}, log[-3000:]
    return {(it, source) for _, it, source in found}


def check_resumed(log: str, reference: dict[int, float], resumed_at: int) -> None:
    after = {i: v for i, v in losses(log).items() if i > resumed_at}
    assert after, log[-3000:]
    # Megatron's training_log keeps its loss accumulator across a restart's first logged line, so
    # the line after it averages two iterations: compare the first one and those from the third on.
    skip = {resumed_at + 2}
    for i, v in after.items():
        if i not in skip:
            assert v == reference[i], f"iteration {i}: loss {v!r} after the restore, {reference[i]!r} uninterrupted"


def lose_node_memory(shm: Path) -> None:
    launch.stop_agents(shm)
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def uninterrupted():
    """``uninterrupted(tree)``: the losses of ``tree``'s uninterrupted run of ``MODEL`` (no checkpointing), run
    once per release for the module (trees are keyed by their name, ``Megatron-LM-<tag>``): every test that
    holds a resume to it runs the same command on a patched tree of the same release."""
    runs: dict[str, dict[int, float]] = {}

    def losses_of(tree: Path) -> dict[int, float]:
        if tree.name not in runs:
            code, log = pretrain(tree)
            assert code == 0, log[-4000:]
            runs[tree.name] = losses(log)
        return runs[tree.name]

    return losses_of


def test_megatron_lm_pretrain_gpt_resumes_exactly(patched_tree, uninterrupted, tmp_path):
    shm = Path("/dev/shm") / f"pec-mlm-{os.getpid()}-{tmp_path.name[-12:]}"
    save = tmp_path / "checkpoints"
    ckpt = ["--save", str(save), "--load", str(save), "--save-interval", "4", "--non-persistent-save-interval", "1",
            "--pec-shm-dir", str(shm), "--pec-job-id", "mlm", "--pec-node-memory", "3x"]
    try:
        reference = uninterrupted(patched_tree)
        assert sorted(reference) == list(range(1, 11))

        code, log = pretrain(patched_tree, *ckpt, "--exit-interval", "3")
        assert code == 0 and "exiting program at iteration 3" in log, log[-4000:]
        assert all(reference[i] == v for i, v in losses(log).items())

        # The restart after the planned exit resumes at 3; killed at its 4th snapshot (iteration 7).
        code, log = pretrain(patched_tree, *ckpt, fault="snapshot_end=kill@4")
        assert code != 0 and "fault injection: kill at snapshot_end" in log, log[-4000:]
        assert restored(log) == {(3, "storage")} or restored(log) == {(3, "memory")}
        check_resumed(log, reference, 3)

        code, log = pretrain(patched_tree, *ckpt, fault="snapshot_end=kill@3")  # iteration 9
        assert code != 0, log[-4000:]
        assert restored(log) == {(6, "memory")}, log[-4000:]
        check_resumed(log, reference, 6)

        deadline = time.monotonic() + 60  # killed at iteration 9: the agent commits the persisted 8
        while 8 not in checkpoints(save).committed_iterations() and time.monotonic() < deadline:
            time.sleep(0.2)
        lose_node_memory(shm)
        code, log = pretrain(patched_tree, *ckpt)
        assert code == 0, log[-4000:]
        assert restored(log) == {(8, "storage")}, log[-4000:]
        check_resumed(log, reference, 8)
        assert max(losses(log)) == 10
    finally:
        lose_node_memory(shm)


@pytest.fixture
def newest_tree(tmp_path) -> Path:
    """The newest supported release, patched (one release is enough for what the example covers too)."""
    tree = megatron_lm.copy_tree(megatron_lm.NEWEST, tmp_path / f"Megatron-LM-{megatron_lm.NEWEST}")
    if tree is None:
        pytest.skip(f"no archive of {megatron_lm.NEWEST} in {[str(d) for d in megatron_lm.archive_dirs()]}")
    applied = subprocess.run([str(REPO / "patches" / "apply.sh"), str(tree)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return tree


def test_megatron_lm_planned_exit_under_pec_loses_nothing(newest_tree, uninterrupted, tmp_path):
    """Snapshot-K 2 of 4, persist-K 1, Megatron's --exit-interval 7 between persists (every 4):
    at the clean exit the trainers save iteration 7 once more with every expert and the agents commit it,
    so the restart restores 7 with PLT 0.0000% and every later loss equals the uninterrupted run's."""
    shm = Path("/dev/shm") / f"pec-mlm-exit-{os.getpid()}-{tmp_path.name[-12:]}"
    save = tmp_path / "checkpoints"
    ckpt = ["--save", str(save), "--load", str(save), "--save-interval", "4", "--non-persistent-save-interval", "1",
            "--pec-shm-dir", str(shm), "--pec-job-id", "mlmexit", "--pec-snapshot-k", "2", "--pec-persist-k", "1"]
    try:
        reference = uninterrupted(newest_tree)
        code, log = pretrain(newest_tree, *ckpt, "--exit-interval", "7")
        assert code == 0 and "exiting program at iteration 7" in log, log[-4000:]
        assert "iteration 7 saved once more with every expert" in log, log[-4000:]
        m = checkpoints(save).read_manifest(7)
        assert set(m.experts.values()) == {7} and m.generation.endswith(".exit"), m
        code, log = pretrain(newest_tree, *ckpt)
        assert code == 0, log[-4000:]
        assert restored(log) == {(7, "storage")}, log[-4000:]
        assert "PLT 0.0000%" in log and "experts from older versions" not in log, log[-4000:]
        check_resumed(log, reference, 7)
    finally:
        lose_node_memory(shm)


def test_megatron_formats_in_and_out(tmp_path):
    """Out: ``--ckpt-convert-format torch_dist`` on a megatron-pec checkpoint writes Megatron's own format
    through Megatron's own save_checkpoint: the unpatched tree resumes from it exactly as from its
    own torch_dist save of the same iteration (same losses, iteration by iteration).
    In: a job switches to megatron-pec mid-run: the patched tree given unpatched Megatron-LM's torch_dist
    checkpoint loads it with Megatron's own loader and saves megatron-pec checkpoints, and a restart from
    those resumes exactly (the losses equal the unpatched tree's own resume)."""
    tag = megatron_lm.NEWEST
    pristine = megatron_lm.pristine_tree(tag)
    if pristine is None or shutil.which("git") is None:
        pytest.skip(f"needs git and the archive Megatron-LM-{tag}.tar.gz")
    tree = megatron_lm.copy_tree(tag, tmp_path / "patched")
    assert subprocess.run([str(REPO / "patches" / "apply.sh"), str(tree)], capture_output=True).returncode == 0
    bf16 = ["--bf16"]  # Megatron's own torch_dist load of fp32 main params fails on CPU
    shm = Path("/dev/shm") / f"pec-mlm-{os.getpid()}-convert"
    save, converted, own = tmp_path / "pec", tmp_path / "converted", tmp_path / "own"
    ckpt = ["--save", str(save), "--load", str(save), "--save-interval", "4", "--non-persistent-save-interval", "1",
            "--pec-shm-dir", str(shm), "--pec-job-id", "conv"]
    try:
        code, log = pretrain(tree, *bf16, *ckpt, "--exit-interval", "4")
        assert code == 0, log[-4000:]
        before = committed_files(save)
        code, log = pretrain(tree, *bf16, *ckpt, "--ckpt-convert-format", "torch_dist",
                             "--ckpt-convert-save", str(converted))
        assert code == 0 and "converts to --ckpt-convert-format torch_dist" in log, log[-4000:]
        assert_committed_files_unchanged(before)  # the conversion saves iteration 4 elsewhere only
        assert restored(log) == {(4, "storage")} or restored(log) == {(4, "memory")}
    finally:
        lose_node_memory(shm)
    code, log = pretrain(pristine, *bf16, "--load", str(converted / "torch_dist"))
    assert code == 0, log[-4000:]
    from_conversion = losses(log)
    code, log = pretrain(pristine, *bf16, "--save", str(own), "--save-interval", "4", "--exit-interval", "4")
    assert code == 0, log[-4000:]
    code, log = pretrain(pristine, *bf16, "--load", str(own))
    assert code == 0, log[-4000:]
    assert sorted(from_conversion) == list(range(5, 11))
    reference = losses(log)
    assert from_conversion == reference

    switched = tmp_path / "switched"
    ckpt = ["--save", str(switched), "--save-interval", "2", "--non-persistent-save-interval", "1",
            "--pec-shm-dir", str(shm), "--pec-job-id", "switch"]
    try:
        code, log = pretrain(tree, *bf16, "--load", str(own))  # switched, uninterrupted
        assert code == 0 and "found Megatron's torch_dist checkpoint of iteration 4 under --load" in log, log[-4000:]
        assert "using Megatron-LM's own load_checkpoint" in log
        uninterrupted = losses(log)
        # The loss before the first step equals unpatched Megatron-LM's resume. (Later ones need not: on CPU
        # without apex/TE, Megatron's own load gives all params one shared Adam step tensor, which torch's
        # foreach Adam then advances once per param per step; megatron-pec gives each param its own.)
        assert sorted(uninterrupted) == list(range(5, 11)) and uninterrupted[5] == reference[5]
        code, log = pretrain(tree, *bf16, *ckpt, "--load", str(own), "--exit-interval", "6")
        assert code == 0, log[-4000:]
        assert {i: v for i, v in losses(log).items()} == {i: uninterrupted[i] for i in (5, 6)}
        assert checkpoints(switched).committed_iterations()[0] == 6
        code, log = pretrain(tree, *bf16, *ckpt, "--load", str(switched))
        assert code == 0, log[-4000:]
        assert restored(log) in ({(6, "storage")}, {(6, "memory")}), log[-4000:]
        check_resumed(log, uninterrupted, 6)
    finally:
        lose_node_memory(shm)
