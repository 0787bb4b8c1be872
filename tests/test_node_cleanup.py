"""Invariant 17: a job that ends without ``--pec-keep-shm`` leaves nothing in node memory but its agent's log.

Checked by looking at the directory after the agent exited (the fixtures remove whole directories, which
would hide what the product leaves behind): the example trainer on 2 CPU ranks of one node, a snapshot
every iteration and a persist every 3, then the directory listed.
"""

import os
import time
from pathlib import Path

import pytest
from conftest import REPO, torchrun

from megatron_pec.memory.node_files import AGENT_LOG, PIDFILE, agent_lock, remove_job_files

PRETRAIN = str(REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py")
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
         "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1"]


def wait_for_agent_exit(node_dir: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (node_dir / PIDFILE).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not (node_dir / PIDFILE).exists(), sorted(os.listdir(node_dir))


@pytest.mark.multiprocess
def test_a_finished_job_leaves_only_its_log_in_node_memory(tmp_path, shm_dir):
    save = tmp_path / "ck"
    torchrun(PRETRAIN, *MODEL, "--train-iters", "6", "--save", str(save), "--load", str(save),
             "--save-interval", "3", "--non-persistent-save-interval", "1", "--pec-shm-dir", shm_dir,
             "--pec-job-id", "tidy")
    node_dir = Path(shm_dir) / "tidy" / "node0"
    wait_for_agent_exit(node_dir)
    assert sorted(os.listdir(node_dir)) == [AGENT_LOG], sorted(os.listdir(node_dir))
    assert "removed the job's node memory" in (node_dir / AGENT_LOG).read_text()


@pytest.mark.multiprocess
def test_a_planned_exit_while_storage_is_down_keeps_node_memory_for_the_relaunch(tmp_path, shm_dir):
    """The store refuses every write (``RefusingStorage``, while its marker exists): the final persistent
    save fails, and so does the planned exit's persist of the newest snapshot. The trained state is
    nowhere else: node memory stays, the agent says so, and a relaunch once the store is back restores it
    from there and persists it at its own clean end, which then tidies node memory."""
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import PosixStorage

    save, down = tmp_path / "ck", tmp_path / "store-down"
    down.touch()
    args = [*MODEL, "--train-iters", "3", "--save", str(save), "--load", str(save), "--non-persistent-save-interval",
            "1", "--pec-shm-dir", shm_dir, "--pec-job-id", "refused",
            "--pec-storage", f"megatron_pec.testing.refusing_storage:RefusingStorage?{down}"]
    first = torchrun(PRETRAIN, *args)
    assert "snapshot of iteration 3 was not persisted: OSError" in first.stdout + first.stderr
    node_dir = Path(shm_dir) / "refused" / "node0"
    wait_for_agent_exit(node_dir)
    log = (node_dir / AGENT_LOG).read_text()
    assert "storage does not hold the newest snapshot of rank 0's iteration 3" in log, log[-3000:]
    assert {"rank0.slot0", "rank0.pool", "rank1.slot0"} <= set(os.listdir(node_dir))
    assert CheckpointDir(str(save), PosixStorage()).committed_iterations() == []
    down.unlink()  # the store is back
    relaunch = torchrun(PRETRAIN, *args)
    assert "rank 0: restored iteration 3 from memory" in relaunch.stdout + relaunch.stderr
    wait_for_agent_exit(node_dir)
    assert CheckpointDir(str(save), PosixStorage()).committed_iterations() == [3]
    assert sorted(os.listdir(node_dir)) == [AGENT_LOG]


def test_the_clean_up_keeps_the_log_and_removes_every_other_file_and_folder(tmp_path):
    for name in ("rank0.slot0", "rank0.pool", "rank0.memory.json", "slots.json", "agent.lock", AGENT_LOG):
        (tmp_path / name).write_text("x")
    (tmp_path / "replicas").mkdir()
    (tmp_path / "replicas" / "node1.rank1.replica").write_text("x")
    remove_job_files(str(tmp_path))
    assert os.listdir(tmp_path) == [AGENT_LOG]


def test_a_waiter_on_a_lock_file_removed_by_its_holder_locks_the_new_one(tmp_path):
    """The holder removes the lock file at the job's end; whoever waited on it must not hold a lock
    nobody else can see (two agents could then start)."""
    import fcntl
    import threading

    entered, release = threading.Event(), threading.Event()

    def wait_then_hold():
        with agent_lock(str(tmp_path)):
            entered.set()
            release.wait(10)

    with agent_lock(str(tmp_path)):
        waiter = threading.Thread(target=wait_then_hold)
        waiter.start()
        assert not entered.wait(0.2)
        remove_job_files(str(tmp_path))
    assert entered.wait(5)
    # the waiter holds the file in place: anyone else has to wait for it
    with open(tmp_path / "agent.lock", "a") as third:
        with pytest.raises(BlockingIOError):
            fcntl.flock(third, fcntl.LOCK_EX | fcntl.LOCK_NB)
    release.set()
    waiter.join(5)
