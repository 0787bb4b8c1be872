"""State parity against Megatron itself : what a restore gives back, item by item.

Megatron-LM's own ``pretrain_gpt.py`` (the oldest and the newest supported release, 2 CPU ranks, EP 2, fp16
with a dynamic loss scale that moves) trains 3 iterations and saves iteration 3 twice in the same process:
through megatron-pec (the patched tree's save_checkpoint) and through Megatron-LM's own save_checkpoint
(``torch_dist``). Each is restored in a fresh process, megatron-pec's by the patched tree and Megatron's by
the pristine tree, and the whole state right after the load is dumped (``megatron_pec.testing.state_dump``):
every model state_dict key with the extra-state keys, ``optimizer.state_dict()``, every main-parameter shard
and its Adam state, the grad scaler, the scheduler, every RNG, the rerun state machine, every argument, the
checkpoint version, the microbatch calculator, and the iteration and FLOPs ``load_checkpoint`` returned.
The model has a frozen parameter and a module whose extra state changes every step (a stand-in for
Transformer Engine's FP8 state), added by a model-provider wrapper; the load runs draw the frozen parameter
from another seed, so a restore that drops it shows.

Megatron-pec's restore must equal Megatron's own restore key by key. Where Megatron's own restore on
these CPU runs is known not to give back what it saved (``MEGATRON_OWN_LOSSY``), megatron-pec's restore
must equal the live state at the save instead.

The example trainer has no Megatron-LM save_checkpoint: there the reference is the trainer's live state
right after it saved iteration 3, in the same run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from megatron_pec.testing import launch, megatron_lm, state_dump

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
ITERATION = 3
MODEL = megatron_lm.SMALL_MOE_ON_CPU + (
    f"--log-interval 1 --seed 1234 --train-iters {ITERATION} "
    # fp16 keeps a grad scaler; Megatron's own torch_dist load of fp32 main params fails on CPU. The scale
    # starts low enough that no step is skipped and doubles after 2 (its state moves).
    "--fp16 --initial-loss-scale 4096 --loss-scale-window 2 "
    # the rerun state machine records the loss (state a release that restores it must get back)
    "--check-for-spiky-loss").split()
SAVE_SEED, LOAD_SEED = "1", "2"  # the probe's frozen parameter: a restore that drops it keeps the load seed's

# Keys where Megatron-LM's own restore, on these CPU runs, does not give back what it saved; megatron-pec's
# restore is held to the live state at the save there.
MEGATRON_OWN_LOSSY = {
    # torch's Adam without apex/TE: after Megatron's own torch_dist load Adam's step is 0 (megatron_lm_cpu
    # creates the state with step 0 before the load, which the load needs on CPU), whatever was saved
    r"^optimizer/(state_dict/\d+/optimizer/param_groups/\d+/step|shard/.*/state/step)$": "Adam step",
    # core_v0.19's torch_dist keeps data-parallel rank 0's RNG only (core_v0.16.1 shards it by DP rank under
    # expert parallelism): rank 1 gets rank 0's expert-parallel tracker state back
    r"^rng/": "RNG of other data-parallel ranks",
}
# Keys that differ by construction between the two restores compared.
NOT_STATE = {
    "args/load": "the two checkpoints' directories",
    "args/save": "the two checkpoints' directories",
    "args/pec_": "megatron-pec's flags (only the patched tree has them)",
}


def run_dump(script: Path, *args: str, dump: Path, seed: str, at: str = "load", torch_dist: Path | None = None,
             nproc: int = 2, env: dict | None = None, timeout: float = 180) -> str:
    """``script`` under ``state_dump`` on ``nproc`` ranks; returns the output rank by rank. Fails with it
    unless every rank wrote its dump."""
    logs = Path(tempfile.mkdtemp(prefix="parity-logs-"))
    job = launch.Launch("megatron_pec.testing.state_dump", (str(script), *args), nproc=nproc, module=True,
                        options=("--log-dir", str(logs), "--redirects", "3"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}), **{
        state_dump.DUMP_ENV: str(dump), state_dump.AT_ENV: at, state_dump.SEED_ENV: seed})
    for name in ("MEGATRON_PEC_FAULT", state_dump.TORCH_DIST_ENV):
        env.pop(name, None)
    if torch_dist is not None:
        env[state_dump.TORCH_DIST_ENV] = str(torch_dist)
    try:
        proc = launch.run(job, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        per_rank = sorted(logs.rglob("*.log"), key=lambda f: f.parts[-2:])
        log = "\n".join([f.read_text(errors="replace") for f in per_rank] + [proc.stdout, proc.stderr])
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    dumped = all((dump / f"rank{r}.json").is_file() for r in range(nproc))
    command = f"{script.name} {' '.join(args[-8:])}"
    assert proc.returncode == 0 and dumped, f"{command}: exit {proc.returncode}\n{log[-5000:]}"
    return log


def ranks(dump: Path) -> list[int]:
    return sorted(int(f.name[4:-5]) for f in dump.glob("rank*.json"))


def check_probe(dump: Path, steps: int) -> None:
    """The dump holds the probe (so the comparisons covered it), its extra state counted ``steps`` forward
    steps and its frozen parameter is not the load runs' draw (so a restore that drops either shows)."""
    import torch

    for rank in ranks(dump):
        tensors, _ = state_dump.read(dump, rank)
        extra = [k for k in tensors if k.endswith(f"{state_dump.PROBE}._extra_state")]
        frozen = [k for k in tensors if k.endswith(f"{state_dump.PROBE}.frozen")]
        assert len(extra) == 1 and len(frozen) == 1, sorted(tensors)[:20]
        assert int.from_bytes(bytes(tensors[extra[0]][:8].tolist()), "little") == steps
        fresh = torch.randn(4, 8, generator=torch.Generator().manual_seed(int(LOAD_SEED)))
        assert not torch.equal(tensors[frozen[0]].float(), fresh.to(tensors[frozen[0]].dtype).float())


def differences(reference: Path, restored: Path, live: Path | None, ignore: dict[str, str],
                lossy: dict[str, str]) -> dict[int, dict[str, str]]:
    """Per rank, every key where ``restored`` differs from ``reference`` (``ignore``'s keys skipped); a key
    matching one of ``lossy`` counts only if ``restored`` also differs from ``live`` there."""
    found = {}
    assert ranks(restored) == ranks(reference), (ranks(restored), ranks(reference))
    for rank in ranks(reference):
        got = state_dump.read(restored, rank)
        diff = state_dump.compare(state_dump.read(reference, rank), got, ignore)
        if live is not None and any(re.search(p, k) for k in diff for p in lossy):
            against_live = state_dump.compare(state_dump.read(live, rank), got, ignore)
            diff = {k: v for k, v in diff.items() if not any(re.search(p, k) for p in lossy) or k in against_live}
        if diff:
            found[rank] = diff
    return found


def report(found: dict[int, dict[str, str]], what: str, per_section: int = 4) -> str:
    """The differences, at most ``per_section`` lines per rank and section (``model0``, ``optimizer/shard``, ...)."""
    lines = [f"{what}: {sum(map(len, found.values()))} items differ"]
    for rank, diff in found.items():
        sections: dict[str, list[str]] = {}
        for key in diff:
            parts = key.split("/")
            sections.setdefault("/".join(parts[:2]) if parts[0] in ("optimizer", "rng", "rerun") else parts[0],
                                []).append(key)
        for section, keys in sections.items():
            lines += [f"  rank {rank}: {key}: {diff[key][:300]}" for key in keys[:per_section]]
            if len(keys) > per_section:
                lines.append(f"  rank {rank}: ... and {len(keys) - per_section} more under {section}/")
    return "\n".join(lines)


@pytest.fixture(params=[megatron_lm.OLDEST, megatron_lm.NEWEST])
def trees(request, tmp_path) -> tuple[Path, Path]:
    """(pristine, patched) trees of one release."""
    tag = request.param
    if shutil.which("git") is None:
        pytest.skip("git not found: patches/apply.sh needs it")
    pristine = megatron_lm.pristine_tree(tag)
    if pristine is None:
        pytest.skip(f"no archive Megatron-LM-{tag}.tar.gz in {[str(d) for d in megatron_lm.archive_dirs()]}")
    patched = megatron_lm.copy_tree(tag, tmp_path / f"Megatron-LM-{tag}")
    applied = subprocess.run([str(REPO / "patches" / "apply.sh"), str(patched)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return pristine, patched


def megatron_lm_parity(pristine: Path, patched: Path, tmp_path: Path, model: list[str], *, steps: int,
                       nproc: int = 2, env: dict | None = None,
                       load_flags: tuple[tuple[str, ...], ...] = ((),)) -> dict[str, dict[int, dict[str, str]]]:
    """Save iteration ``ITERATION`` both ways in one run of ``patched``, restore megatron-pec's with
    ``patched`` and Megatron's own with ``pristine``, each in a fresh process, once per set of
    ``load_flags``; returns the differences (``differences``) per set that has any (its flags joined by
    spaces: "" for none). ``steps``: the forward steps the probe counts by the save."""
    shm = Path("/dev/shm") / f"pec-parity-{os.getpid()}-{tmp_path.name[-12:]}"
    pec, own = tmp_path / "pec", tmp_path / "torch_dist"
    pec_args = ["--save", str(pec), "--load", str(pec), "--save-interval", str(ITERATION),
                "--pec-shm-dir", str(shm), "--pec-job-id", "parity"]
    found = {}
    try:
        run_dump(patched / "pretrain_gpt.py", *model, *pec_args, dump=tmp_path / "live", seed=SAVE_SEED,
                 at=f"save:{ITERATION}", torch_dist=own, nproc=nproc, env=env)
        for flags in load_flags:
            name = "-".join(f.strip("-") for f in flags) or "all"
            log = run_dump(patched / "pretrain_gpt.py", *model, *pec_args, *flags, dump=tmp_path / f"pec_{name}",
                           seed=LOAD_SEED, nproc=nproc, env=env)
            assert f"restored iteration {ITERATION}" in log, log[-3000:]
            log = run_dump(pristine / "pretrain_gpt.py", *model, "--save", str(own), "--load", str(own),
                           "--save-interval", str(ITERATION), *flags, dump=tmp_path / f"own_{name}", seed=LOAD_SEED,
                           nproc=nproc, env=env)
            assert f"loading distributed checkpoint from {own} at iteration {ITERATION}" in log, log[-3000:]
            if not flags:  # the references: what megatron-pec's restore is held to
                check_probe(tmp_path / "live", steps)
                check_probe(tmp_path / f"own_{name}", steps)
            diff = differences(tmp_path / f"own_{name}", tmp_path / f"pec_{name}", tmp_path / "live", NOT_STATE,
                               MEGATRON_OWN_LOSSY if not flags else {})
            if diff:
                found[" ".join(flags)] = diff
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    assert "megatron_pec" not in (pristine / "megatron" / "training" / "training.py").read_text()
    return found


def test_megatron_lm_restore_equals_megatrons_own(trees, tmp_path):
    """Also, for the newest release, with Megatron's load flags: both restores leave out the same."""
    pristine, patched = trees
    flags = ((), ("--no-load-optim", "--no-load-rng"), ("--finetune",)) if megatron_lm.NEWEST in patched.name else ((),)
    found = megatron_lm_parity(pristine, patched, tmp_path, MODEL, steps=ITERATION,  # 1 micro-batch a rank and step
                               load_flags=flags)
    assert not found, "\n".join(report(diff, f"megatron-pec's restore against Megatron-LM's own, load flags "
                                              f"[{name}]") for name, diff in found.items())


@pytest.mark.both_releases
def test_example_trainer_restore_equals_the_state_it_saved(tmp_path):
    """examples/gpt_moe/pretrain_gpt_moe.py (megatron-core only): its restore of iteration 3 against its own
    live state right after it saved iteration 3."""
    shm = Path("/dev/shm") / f"pec-parity-ex-{os.getpid()}-{tmp_path.name[-12:]}"
    ckpt = tmp_path / "ckpt"
    args = ["--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--expert-model-parallel-size", "2", "--log-interval", "100", "--eval-iters", "1", "--hidden-dropout",
            "0.1", "--train-iters", str(ITERATION), "--save", str(ckpt), "--load", str(ckpt), "--save-interval",
            str(ITERATION), "--pec-shm-dir", str(shm), "--pec-job-id", "parityex"]
    script = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
    try:
        run_dump(script, *args, dump=tmp_path / "live", seed=SAVE_SEED, at=f"save:{ITERATION}")
        log = run_dump(script, *args, dump=tmp_path / "restored", seed=LOAD_SEED)
        assert f"restored iteration {ITERATION}" in log, log[-3000:]
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    check_probe(tmp_path / "live", ITERATION * 2)  # two micro-batches per rank and iteration
    # The trainer sets these from load_checkpoint's return after the load (the dump's returned/ keys)
    ignore = {"args/iteration": "", "args/num_floating_point_operations_so_far": ""}
    found = differences(tmp_path / "live", tmp_path / "restored", None, ignore, {})
    assert not found, report(found, "the example trainer's restore against its state at the save")
