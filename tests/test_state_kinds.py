"""Every piece of state Megatron's own checkpoint keeps comes back, or is refused at start-up.

The example trainer with a frozen parameter and a module whose extra state changes every step (a stand-in
for Transformer Engine's FP8 scaling state; ``tests/workers/state_kinds.py``), killed with SIGKILL and
relaunched: restored from node memory and from storage, both bit-exact (digests logged by the trainer at
each save and after each load), its later losses those of the uninterrupted run; the same under
snapshot-K 2 (experts come back older by design there: the losses are not compared) and after a
data-parallel reshard. Megatron's load flags and argument check; a module whose extra state megatron-pec
cannot keep is refused at start-up, naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO, WORKERS, checkpoints, read_jsonl, torchrun
from test_export import read_safetensors

from megatron_pec.testing.cluster import SMALL_MODEL, Cluster, run_megatron_pec

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "state_kinds.py"
PRETRAIN = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
ITERS = 10
EVERY = ["--train-iters", str(ITERS), "--save-interval", "2", "--non-persistent-save-interval", "1",
         "--pec-keep", "0", "--pec-wait-for-slot"]
PEC = ["--pec-snapshot-k", "2", "--pec-persist-k", "1"]
TIMEOUT = 180


def states(log_dir: Path, rank: int) -> list[dict]:
    path = log_dir / f"state.rank{rank}.jsonl"
    return read_jsonl(path) if path.exists() else []


def assert_loads_exact(log_dir: Path, ranks=(0, 1)) -> int:
    """Each load's frozen parameter and extra state equal those of the latest save of that iteration before it
    (in this rank's log, across launches); returns how many restores were checked."""
    checked = 0
    for rank in ranks:
        saved = {}
        for record in states(log_dir, rank):
            if "saved" in record:
                saved[record["saved"]] = record
            elif record["loaded"] > 0:
                want = saved[record["loaded"]]
                assert (record["frozen"], record["extra"], record["steps"]) == \
                       (want["frozen"], want["extra"], want["steps"]), (rank, record, want)
                checked += 1
    return checked


def losses(c: Cluster, launch: int) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in c.metrics(launch) if "lm loss" in r}


@pytest.fixture
def cluster(tmp_path, shm_dir):
    made = []

    def make(name: str) -> Cluster:
        c = Cluster(tmp_path / name, shm_dir, f"sk{name}", model_args=SMALL_MODEL, script=WORKER)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# (~30 s each on 2 cores: the default run takes every expert; the restore of older expert versions with the
# frozen parameter and extra state runs with -m slow)
@pytest.mark.parametrize("pec", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["every_expert", "snapshot_k2"])
def test_frozen_parameter_and_extra_state_survive_sigkill_from_memory_and_storage(cluster, tmp_path, pec):
    flags = EVERY + (PEC if pec else [])
    logs = tmp_path / "state_log"
    logs.mkdir()

    def env(seed: int, log: Path = logs) -> dict:
        # (another seed at each launch: a frozen parameter not restored would differ)
        return {"PEC_TEST_FROZEN_SEED": str(seed), "PEC_TEST_STATE_LOG": str(log)}

    reference = None
    if not pec:
        ref_logs = tmp_path / "ref_log"
        ref_logs.mkdir()
        ref = cluster("ref")
        ref.launch(flags, env=env(11, ref_logs))
        assert ref.wait_exit(TIMEOUT) == {0: 0, 1: 0}, ref.logs()
        reference = losses(ref, 1)
        assert sorted(reference) == list(range(1, ITERS + 1))

    c = cluster("kill")
    # 1. rank 1 is SIGKILLed inside the optimizer step of iteration 5.
    c.launch(flags, env=env(11), faults={1: "optimizer_step=kill@5:1"})
    codes = c.wait_exit(TIMEOUT)
    assert codes[1] != 0 and "fault injection: kill at optimizer_step" in c.log(1)
    # 2. restores 4 from node memory; rank 0 is SIGKILLed in the step of iteration 8; then both nodes' memory is lost.
    # (the cluster fires each point once across its launches unless told otherwise: this one is fired anew)
    c.launch(flags, env={**env(22), "MEGATRON_PEC_FAULT_ONCE": ""}, faults={0: "optimizer_step=kill@4:0"})
    c.wait_exit(TIMEOUT)
    assert {r: (x.iteration, x.source) for r, x in c.restores(2).items()} == {0: (4, "memory"), 1: (4, "memory")}
    for node in (0, 1):
        c.lose_node(node)
    # 3. restores the newest committed iteration from storage and finishes.
    c.launch(flags, env=env(33))
    assert c.wait_exit(TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restored = {r: (x.iteration, x.source) for r, x in c.restores(3).items()}
    at = restored[0][0]
    assert restored == {0: (at, "storage"), 1: (at, "storage")} and at in (4, 6), restored
    assert "frozen parameters (1); modules' extra state (1)" in c.log(0, 1)

    assert assert_loads_exact(logs) == 4  # two restores on two ranks
    if reference is not None:
        # the frozen values of launch 1 (seed 11) came back at every relaunch (seeds 22, 33): the reference's
        first = [r for r in states(logs, 0) if "saved" in r][0]
        assert first["frozen"] == [r for r in states(tmp_path / "ref_log", 0) if "saved" in r][0]["frozen"]
        checked = 0
        for launch in (1, 2, 3):
            for iteration, loss in losses(c, launch).items():
                assert loss == reference[iteration], (launch, iteration, loss, reference[iteration])
                checked += 1
        assert checked == 4 + 3 + (ITERS - at)
    else:
        assert "PLT" in c.log(0, 2)


def test_frozen_parameter_and_extra_state_after_a_data_parallel_reshard(tmp_path, shm_dir):
    """4 ranks (EP 2, DP 4 dense) -> 2 ranks: each rank takes the extra state of the old rank at its
    position (tensor parallel 1: rank r's, as ``reshard._small`` picks), the frozen parameter bit-exact."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "log"
    logs.mkdir()
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "8",
             "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "64",
             "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "100", "--eval-iters", "1"]
    common = [*model, "--save", str(ckpt), "--load", str(ckpt), "--pec-shm-dir", shm_dir, "--pec-job-id", "skr"]
    env = {"PEC_TEST_STATE_LOG": str(logs), "PEC_TEST_FROZEN_SEED": "5"}
    torchrun(str(WORKER), *common, "--train-iters", "4", "--save-interval", "4", nproc=4, env=env, timeout=400)
    shutil.rmtree(shm_dir, ignore_errors=True)
    # export's consolidated weights hold the frozen parameter too
    exported = run_megatron_pec("export", ckpt, tmp_path / "export")
    assert exported.returncode == 0, exported.stderr
    weights = read_safetensors(tmp_path / "export" / "model.safetensors")
    assert "decoder.final_layernorm.weight" in weights
    proc = torchrun(str(WORKER), *common, "--train-iters", "6", "--save-interval", "6", nproc=2,
                    env={**env, "PEC_TEST_FROZEN_SEED": "6"}, timeout=400)
    assert "restored iteration 4 from storage (resharded: world 4 → 2" in proc.stdout, proc.stdout[-3000:]
    for rank in (0, 1):
        saved = [r for r in states(logs, rank) if r.get("saved") == 4]
        loaded = [r for r in states(logs, rank) if r.get("loaded") == 4]
        assert len(saved) == 1 and len(loaded) == 1
        assert (loaded[0]["frozen"], loaded[0]["extra"], loaded[0]["steps"]) == \
               (saved[0]["frozen"], saved[0]["extra"], saved[0]["steps"])


SMALL = ["--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--expert-model-parallel-size", "2", "--log-interval", "100", "--eval-iters", "1"]


def test_refusals_exit_on_missing_checkpoint_and_the_argument_check(tmp_path, shm_dir):
    ckpt = tmp_path / "ckpt"
    common = SMALL + ["--save", str(ckpt), "--load", str(ckpt), "--pec-shm-dir", shm_dir]

    # A module whose extra state megatron-pec cannot keep: refused at start-up, naming it; nothing trains or saves.
    proc = torchrun(str(WORKER), *common, "--train-iters", "2", "--save-interval", "1", "--pec-job-id", "skbad",
                    env={"PEC_TEST_BAD_EXTRA_STATE": "1"}, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "the extra state of module pec_fp8_stand_in (Fp8StandIn.get_extra_state returns a dict" in out, out[-3000:]
    assert "training from iteration" not in out and not checkpoints(ckpt).committed_iterations()

    # --exit-on-missing-checkpoint with an empty --load exits as Megatron does: status 0, its line, no training.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = torchrun(str(PRETRAIN), *SMALL, "--load", str(empty), "--exit-on-missing-checkpoint", "--train-iters", "2",
                    "--pec-shm-dir", shm_dir, "--pec-job-id", "skmiss")
    assert ">> '--exit-on-missing-checkpoint' set ... exiting. <<" in proc.stdout
    assert "training from iteration" not in proc.stdout

    # A changed --num-attention-heads (the same tensor shapes) is refused at load, naming the argument; the
    # checkpoint stays as it was and restores with the saved value.
    torchrun(str(PRETRAIN), *common, "--train-iters", "2", "--save-interval", "2", "--pec-job-id", "skheads")
    committed = checkpoints(ckpt).committed_iterations()
    proc = torchrun(str(PRETRAIN), *common, "--num-attention-heads", "8", "--train-iters", "4", "--save-interval", "2",
                    "--pec-job-id", "skheads", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "num_attention_heads value from checkpoint (4) is not equal to the input argument value (8)" in out, \
        out[-3000:]
    assert "training from iteration" not in out
    assert checkpoints(ckpt).committed_iterations() == committed
    proc = torchrun(str(PRETRAIN), *common, "--train-iters", "3", "--save-interval", "3", "--pec-job-id", "skheads")
    assert "restored iteration 2 from" in proc.stdout and "training from iteration 2 to 3" in proc.stdout


@pytest.mark.both_releases
def test_grad_scaler_before_the_first_step_rerun_state_machine_and_override_iteration(tmp_path, shm_dir):
    """The grad scaler saved before any optimizer step comes back; the rerun state machine is saved as the
    installed megatron-core's save_checkpoint saves it (0.16: only while a rerun is pending; 0.19: whenever it
    is enabled) and a pending rerun comes back whole from memory and from storage; --override-ckpt-iteration
    returns that iteration with the samples it consumed; with --dataloader-save each persistent save hands the
    train iterator to Megatron-LM's maybe_save_dataloader_state (a stand-in of it here)."""
    from importlib.metadata import version

    torchrun("megatron_state.py", str(tmp_path / "ckpt"), shm_dir, env={"PEC_TEST_OUT": str(tmp_path)})
    release = tuple(int(x) for x in version("megatron-core").split(".")[:2])
    for rank in (0, 1):
        r = json.loads((tmp_path / f"mstate.rank{rank}.json").read_text())
        assert "grad_scaler" in r["kinds"] and "rerun_state_machine" in r["kinds"], r["kinds"]
        assert r["scaler"] == {"changed": True, "restored": True, "loaded": [1, 0]}, r["scaler"]
        assert r["saved_while_idle"] == (release >= (0, 19)), (release, r["saved_while_idle"])
        for leg in ("rerun_memory", "rerun_storage"):
            assert r[leg]["loaded"] == [3, 0] and r[leg]["differences"] == [], (leg, r[leg], r["rerun_before"])
        assert r["rerun_memory"]["after"]["call_type"] == "Call"
        assert "WILL_RERUN_FROM_CHECKPOINT" in r["rerun_memory"]["after"]["state"]
        assert r["override"] == {"loaded": [2, 0], "consumed": 16, "skipped": 0}, r["override"]
        assert r["dataloader"] == [[True, 4, "/dataloader/state"]], r["dataloader"]
