"""Fault injection with real processes: torchrun "nodes", real SIGKILLs, real file damage.

Every fault type of the architecture's invariants 1-10 runs here at least once
(the default run, CI). Each test drives a simulated 2-node job (one rank per
node, EP=2, DP=2, one node agent and one node-memory directory per node) with
``megatron_pec.testing.cluster`` and asserts what the invariant promises:

* the restart resumes from the newest valid state, from memory or storage as the
  invariant says, and says so on every rank;
* the resumed state equals the state at that iteration: with every expert saved,
  each loss logged after a resume equals the uninterrupted reference run's loss
  for that iteration *exactly* (floats compared with ==); with PEC (K < all
  experts) the versions and the PLT logged are checked instead;
* nothing partial is ever latest (manifests, tracker, ``python -m megatron_pec verify``);
* a clear message names what happened, and nothing hangs (every wait is bounded).

Checks are combined per launch where they do not interfere (each torchrun launch
costs ~10 s on 2 cores). The scenarios, the checks and the reference run are the fault campaign's
(``megatron_pec.testing.fault_scenarios``), written once: a test that does what a campaign scenario does
runs that scenario with a fixed spec; the others use its checks (``check_sound``, ``Reference.check_losses``,
``relaunch``, ...) in their own sequences. The random campaign is ``python -m megatron_pec.testing.campaign``;
its pytest entry is marked ``campaign``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from conftest import REPO, assert_committed_files_unchanged, checkpoints, committed_files

from megatron_pec.format.item_names import item_name
from megatron_pec.format.protocol import SlotHeader
from megatron_pec.format.stformat import decode_header
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.slots import open_slot
from megatron_pec.pec.state import PecState
from megatron_pec.store.checkpoint_dir import TRACKER
from megatron_pec.testing.cluster import SMALL_MODEL, Cluster, agent_logs, parse_plt, persist_only_plt, run_megatron_pec

# The scenarios, checks and reference run the campaign uses, written once (``held``, ``wait_held`` and
# ``with_flag`` are also imported from here by tests/test_object_store.py).
from megatron_pec.testing.fault_scenarios import (
    FULL,
    FULL_ITERS,
    SCENARIOS,
    Bench,
    Reference,
    can_mount,
    check_nothing_redone,
    check_sound,
    committed,
    flip_bits,
    held,
    iteration_files,
    relaunch,
    replica_path,
    tracker,
    wait_held,
    with_flag,
)

pytestmark = pytest.mark.multiprocess

ITERS = FULL_ITERS
# FULL (fault_scenarios): every expert saved; a memory snapshot every iteration, a persisted checkpoint
# every 2; nothing deleted.
# PEC: 4 of 8 experts per layer to memory every 2 iterations, 1 of them persisted every 4.
PEC = ["--train-iters", "16", "--save-interval", "4", "--non-persistent-save-interval", "2",
             "--pec-snapshot-k", "4", "--pec-persist-k", "1", "--pec-keep", "2"]
LAUNCH_TIMEOUT = 150  # seconds for one launch (~10-20 s expected); a hang fails the test
PRETRAIN = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"


# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shm_root():
    root = Path("/dev/shm/fault_helper") / f"pytest-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def clusters(shm_root):
    """Factory for clusters that are always torn down (processes killed, node memory removed)."""
    made: list[Cluster] = []

    def make(workdir, job_id: str, **kw) -> Cluster:
        c = Cluster(workdir, kw.pop("shm_dir", shm_root), job_id, script=PRETRAIN, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(scope="module")
def reference(shm_root, tmp_path_factory) -> Reference:
    """The campaign's uninterrupted reference run (``FULL``, job 'fref'), its node memory kept: the slots of
    iterations 10-12 are stale node memory for later tests."""
    return Reference.run(tmp_path_factory.mktemp("reference"), shm_root, "fref", PRETRAIN, keep_memory=True)


def no_worker_traceback(text: str) -> bool:
    """No training process printed a traceback (torch prefixes their uncaught exceptions with [rankN]:)."""
    return re.search(r"^\[rank\d+\]: Traceback", text, re.M) is None


# ---- invariant 5: trainer SIGKILL, agent alive -> resume from node memory --------------------------
def test_trainer_sigkill_around_snapshot_and_in_optimizer_step(clusters, reference, tmp_path):
    """Kills before, during and after the snapshot copy and inside the optimizer step, one after another
    in one job; each restart restores from node memory, loses at most one snapshot interval (1 iteration)
    and continues with exactly the reference losses."""
    c = clusters(tmp_path, "fchain")
    # Every iteration gets its snapshot: after a restore from a memory-only snapshot the agent persists
    # it while it persists the next one, and a snapshot without a free slot would be skipped (warned,
    # invariant 2), moving the restore points this test pins down. Skips: the campaign's counting.
    chain = [*FULL, "--pec-wait-for-slot"]

    # 1. rank 0 dies before copying iteration 4, rank 1 halfway through its copy of iteration 4.
    c.launch(chain, faults={0: "snapshot_begin=kill@4:0", 1: "snapshot_mid=kill@4:1"})
    codes = c.wait_exit(LAUNCH_TIMEOUT)
    assert codes[0] != 0 and codes[1] != 0
    assert "fault injection: kill at snapshot_begin {'iteration': 4}" in c.log(0)
    assert "fault injection: kill at snapshot_mid {'iteration': 4}" in c.log(1)
    reached = {1: c.iteration()}

    # 2. resumes at 3; rank 0 dies after copying iteration 6 but before marking it complete, while
    #    rank 1 completes (and persists) its snapshot 6: the ranks must agree on 5.
    c.launch(chain, faults={0: "snapshot_end=kill@3:0"})
    c.wait_exit(LAUNCH_TIMEOUT)
    assert "fault injection: kill at snapshot_end {'iteration': 6}" in c.log(0)
    reached[2] = c.iteration()

    # 3. resumes at 5; rank 1 dies inside the optimizer step of iteration 8 (dense part stepped).
    c.launch(chain, faults={1: "optimizer_step=kill@3:1"})
    c.wait_exit(LAUNCH_TIMEOUT)
    assert "fault injection: kill at optimizer_step" in c.log(1)
    reached[3] = c.iteration()

    # 4. resumes at 7 and finishes.
    c.launch(chain)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()

    for launch, expected in ((2, 3), (3, 5), (4, 7)):
        restores = c.restores(launch)
        assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (expected, "memory"),
                                                                               1: (expected, "memory")}, restores
        lost = reached[launch - 1] - expected
        assert 0 <= lost <= 1, f"launch {launch - 1} reached {reached[launch - 1]}, restored {expected}"
    assert c.iteration() == ITERS
    assert reference.check_losses(c) == 3 + 2 + 2 + 5
    check_sound(c.save)
    assert committed(c.save)[-1] == ITERS and tracker(c.save) == str(ITERS)
    # 3, 5 and 7 were memory snapshots only; restored from memory, the agents persisted them.
    assert {3, 5, 7} <= set(committed(c.save)), committed(c.save)


def test_a_deferred_snapshot_reaches_the_agent_before_the_next_step(clusters, tmp_path):
    """A snapshot completed by the hand-over thread (every rank's path) is handed to the agent
    as soon as its bytes are in, not at the next save or step. With EP=1 the
    example's ``optimizer_step`` fault point is the first hook of the one optimizer: a trainer killed
    there in iteration 31 has run nothing of ours since the save of 30, and restores 30 from memory."""
    ep1 = [("1" if prev == "--expert-model-parallel-size" else a) for prev, a in zip([None] + SMALL_MODEL, SMALL_MODEL)]
    c = clusters(tmp_path, "fdefer", model_args=[*ep1, "--disable-bias-linear"])
    every = ["--train-iters", "34", "--save-interval", "100", "--non-persistent-save-interval", "1",
             "--pec-keep", "0", "--pec-wait-for-slot"]  # (no snapshot skipped for want of a region)
    c.launch(every, faults={1: "optimizer_step=kill@31:1"})
    codes = c.wait_exit(LAUNCH_TIMEOUT)
    assert codes[1] != 0 and "fault injection: kill at optimizer_step" in c.log(1)
    assert "skipped the snapshot" not in c.logs(), c.logs()[-3000:]
    c.launch(every)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(2)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (30, "memory"), 1: (30, "memory")}


def test_pec_trainer_kill_before_the_first_commit_restores_every_expert_from_memory(clusters, tmp_path):
    """K=1 of 8 experts per snapshot and nothing persisted yet: the experts the first snapshot wrote
    (iteration 1) live on only because the agent carries them forward into every later slot, beyond
    the three-slot ring. The restart restores all of them from node memory, at their latest versions."""
    c = clusters(tmp_path, "fearly")
    early = ["--train-iters", "10", "--save-interval", "100", "--non-persistent-save-interval", "1",
             "--pec-snapshot-k", "1", "--pec-persist-k", "1"]
    c.launch(early, faults="snapshot_end=kill@6")
    codes = c.wait_exit(LAUNCH_TIMEOUT)
    assert codes[0] != 0 and codes[1] != 0
    assert committed(c.save) == []

    c.launch(early)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(2)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (5, "memory"), 1: (5, "memory")}
    versions = {**restores[0].older, **restores[1].older}
    # Iterations 2-5 each wrote one expert per layer; every other expert is still at iteration 1.
    assert len(versions) >= 2 * (8 - 4) and 1 in versions.values() and max(versions.values()) < 5, versions
    plt = parse_plt(c.log(0, 2))
    assert plt is not None and plt > 0
    assert c.iteration() == 10
    check_sound(c.save)


# ---- invariant 6: agent SIGKILL -> training continues, a new agent starts, nothing torn visible -----
IDLE_KILL_STALL_S = 20  # the window for the idle kill (the test needs a few seconds of it)


def test_agent_sigkill_idle_mid_persist_before_manifest_and_tracker(clusters, reference, tmp_path):
    c = clusters(tmp_path, "fagent")
    # Iteration 2: node 0's agent dies after its rank file, before its node marker; node 1's agent dies
    # mid-way through writing its rank file. Iteration 4: the committing agent dies with both node
    # markers written, before the manifest. Iteration 6: the committing agent dies between manifest
    # and tracker. Each point fires once per job (restarted agents inherit the environment).
    # Rank 0 is then held IDLE_KILL_STALL_S in its 11th optimizer step, so that the idle kill below comes
    # before the end of training however fast the machine is (the run is 12 iterations of ~0.1 s).
    c.launch(FULL, faults={0: "before_node_marker=kill@1:0,before_manifest=kill,before_tracker=kill,"
                              "optimizer_step=stall@11:0",
                           1: "persist_write=kill@3:1,before_manifest=kill,before_tracker=kill"},
             node_env={0: {"MEGATRON_PEC_FAULT_STALL_S": str(IDLE_KILL_STALL_S)}})
    c.wait_log("fault injection: stall at optimizer_step", node=0, timeout=LAUNCH_TIMEOUT)
    # Every armed point has fired, and node 0 runs an agent again (one killed by a point is replaced at
    # its trainer's next save): the kill below hits a live agent, however the points fell.
    points = ("before_node_marker", "persist_write", "before_manifest", "before_tracker")
    c.wait_for(lambda: all(f"fault injection: kill at {p}" in agent_logs(c) for p in points), LAUNCH_TIMEOUT,
               "every fault point fired")
    c.wait_for(lambda: c.agent_pid(0) is not None, LAUNCH_TIMEOUT, "node 0's agent running")
    # Idle: between persists (the agent only checks a memory snapshot per iteration).
    c.pause()  # so that saves remain to notice the loss, however slow the agents were
    persisted = _wait_for_recorded_persists(c)  # (a kill mid-persist would lose that iteration: not the point)
    before = c.log(0).count("connected to a new node agent")
    killed = c.kill_agent(0)
    assert killed is not None
    c.resume()
    c.wait_for(lambda: c.log(0).count("connected to a new node agent") > before, 60, "node 0 on a new agent")
    replacement = c.agent_pid(0)
    assert replacement is not None and replacement != killed
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()

    faults = agent_logs(c)
    for point in ("before_node_marker", "persist_write", "before_manifest", "before_tracker"):
        assert f"fault injection: kill at {point}" in faults, faults
    # Training never stopped and its numerics were untouched.
    assert c.iteration() == ITERS
    assert reference.check_losses(c) == ITERS
    # Each node warned and moved to a new agent, with a new pid in agent.pid.
    for node, kills in ((0, 2), (1, 1)):
        log = c.log(node)
        assert "lost the node agent" in log
        pids = [int(p) for p in re.findall(r"connected to a new node agent \(pid (\d+)\)", log)]
        assert len(pids) >= kills and len(set(pids)) == len(pids), log
    assert f"connected to a new node agent (pid {replacement})" in c.log(0)
    # No torn file visible: iteration 2 has node 0's rank file but no marker and no rank 1 file, and
    # is not committed; 4 may have been committed by the other agent, but only whole.
    iter2 = checkpoints(c.save).pec_dir(2)
    assert not os.path.exists(os.path.join(iter2, "rank_00001.safetensors"))
    assert not os.path.exists(checkpoints(c.save).node_marker(2, 0))
    assert 2 not in committed(c.save)
    # Which iteration each later point hit depends on how fast the restarted agents came back (a snapshot
    # announced to a dying agent is lost): the one killed between manifest and tracker is committed, and
    # so are the persist recorded before the idle kill and the last one.
    between = int(re.search(r"kill at before_tracker \{'iteration': (\d+)\}", faults).group(1))
    must = {between, ITERS} | ({persisted} if persisted % 2 == 0 else set())
    assert must <= set(committed(c.save)), (must, committed(c.save))
    check_sound(c.save)
    assert tracker(c.save) == str(ITERS)


def _wait_for_recorded_persists(c) -> int:
    """The trainers paused: until the newest snapshot the agents recorded (when it is a persistent one,
    an even iteration) is committed, so that the agents are idle; returns its iteration."""
    def newest() -> int:
        return max((rec.iteration for n in range(c.nnodes)
                    for records in NodeMemory.read(str(c.node_dir(n))).slots.values()
                    for rec in records.values()), default=0)

    time.sleep(1.0)  # (a snapshot announced just before the pause is recorded by then)
    last = newest()
    if last % 2 == 0 and last > 2:
        c.wait_file(checkpoints(c.save).manifest_path(last), timeout=LAUNCH_TIMEOUT)
    return last


def _restorable_slots(node_dir: Path, rank: int) -> dict[int, dict]:
    """slot -> (iteration, recoveries so far) of the snapshots a restore of ``rank`` may use, by the agent's
    own predicate (any job: the test does not know the configuration fingerprint). A slot without a home
    snapshot on the timeline (an expert pool's region: its record has no header) is no snapshot of its own."""
    memory, out = NodeMemory.read(str(node_dir)), {}
    for slot in memory.slots.get(rank, {}):
        verdict = memory.is_restorable(rank, slot, None)
        if not isinstance(verdict, str) and verdict[1] is not None:
            record, header = verdict
            out[slot] = {"iteration": record.iteration, "recoveries": json.loads(header.pec)["recoveries"]}
    return out


@pytest.mark.campaign  # ~45 s: three launches
def test_snapshots_of_an_abandoned_run_are_never_restored(clusters, tmp_path):
    """Invariant 3 across two trainer kills with PEC: after a restore to T, a snapshot newer than T that
    one rank completed before the kill belongs to a run that no longer exists; it must never supply
    state (e.g. an expert version) to a later restore."""
    c = clusters(tmp_path, "ftimeline")
    pec = with_flag(PEC, "--pec-keep", "0")  # iteration 8's manifest is read at the end
    # 1. rank 0 dies after copying iteration 6, before completing it; rank 1 completes its snapshot 6.
    c.launch(pec, faults={0: "snapshot_end=kill@3:0"})
    c.wait_exit(LAUNCH_TIMEOUT)
    # 2. both restore 4; rank 1's snapshot 6 is now abandoned. Rank 0 dies before its snapshot 10,
    #    which rank 1 completes: the next restore will be to 8.
    c.launch(pec, faults={0: "snapshot_begin=kill@3:0"})
    c.wait_exit(LAUNCH_TIMEOUT)
    assert {r: (x.iteration, x.source) for r, x in c.restores(2).items()} == {0: (4, "memory"), 1: (4, "memory")}
    abandoned = {m["iteration"] for m in _restorable_slots(c.node_dir(1), 1).values()
                 if m["iteration"] > 4 and m["recoveries"] == 0}
    current = {m["iteration"] for m in _restorable_slots(c.node_dir(1), 1).values() if m["recoveries"] == 1}
    # 3. both restore 8; rank 1's experts must come from this run's snapshots or from storage.
    c.launch(pec)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(3)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (8, "memory"), 1: (8, "memory")}
    stored = set(checkpoints(c.save).read_manifest(8).experts.values())
    from_abandoned = {v for v in restores[1].older.values() if v in abandoned and v not in current | stored}
    assert not from_abandoned, (f"rank 1 restored experts from snapshot(s) {sorted(from_abandoned)} of the run "
                                f"abandoned at the restore to 4: {restores[1].older}")
    assert not abandoned, f"snapshots {sorted(abandoned)} of an abandoned run were still restorable"
    check_sound(c.save)


# ---- invariant 7: node loss -> its ranks from a replica in peer memory, the others from their own ----


def test_node_loss_with_pec_restores_every_expert_at_its_snapshot_version(clusters, tmp_path):
    """PEC (4 of 8 experts per snapshot): node 1 is lost; its replica in node 0's memory holds every expert
    at its newest snapshot version, so node 1 loses exactly what a trainer crash at that point costs -
    far less than the storage restore (persist-K 1 every 4 iterations) would."""
    c = clusters(tmp_path, "fnode")
    pec = with_flag(PEC, "--pec-keep", "0")  # the target's manifest is read at the end
    c.launch(pec, **held(1, after=10))
    c.wait_file(checkpoints(c.save).manifest_path(8), timeout=LAUNCH_TIMEOUT)
    wait_held(c, 1)
    c.lose_node(1)
    assert not c.node_dir(1).exists()
    # The survivor notices by itself (its collectives fail) and exits: no hang.
    assert c.wait_exit(60, nodes=[0])[0] != 0
    lost_at = c.iteration()
    stored = committed(c.save)[-1]
    assert "restored" not in c.logs(1)
    before = committed_files(c.save)

    c.launch(pec)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    assert_committed_files_unchanged(before)  # the restored iteration, persisted again, went to new files
    restores = c.restores(2)
    assert restores[0].source == "memory" and restores[1].source == "peer memory (node 0)", restores
    target = restores[0].iteration
    assert restores[1].iteration == target and stored <= target and lost_at - target <= 2, (lost_at, restores)

    # Exactly a trainer crash's loss: each expert at the newest version its snapshot level recorded at
    # the target (read from the target's checkpoint, which the agents persisted after the restart).
    saved_at = {}  # each rank's file records the versions of the experts it holds
    for entry in checkpoints(c.save).read_manifest(target).ranks.values():
        path = os.path.join(str(c.save), entry.file)
        with open(path, "rb") as f:
            meta = decode_header(f.read(1 << 20), file_len=os.path.getsize(path)).metadata
        versions = PecState.loads(SlotHeader.from_metadata(meta).pec).snapshot.saved_at
        saved_at.update({item_name(x): v for x, v in versions.items()})
    restored = {**restores[0].older, **restores[1].older}
    assert restored == {item: v for item, v in saved_at.items() if v < target}, (restored, saved_at)
    plt, storage_plt = parse_plt(c.log(0, 2)), persist_only_plt(c.save, stored)
    assert plt is not None, c.log(0, 2)
    assert 0 < plt < storage_plt, (plt, storage_plt)
    assert c.iteration() == 16
    check_sound(c.save)


def lose_node_1_and_restore_from_its_replica(c: Cluster) -> tuple[int, int]:
    """Node 1, launched ``held`` after some iteration, is lost there; the relaunch restores it from node
    0's memory, node 0 from its own, at the same iteration, at most one snapshot interval back; no
    committed file is written again meanwhile. Returns (reached, restored)."""
    wait_held(c, 1)
    c.lose_node(1)
    assert c.wait_exit(60, nodes=[0])[0] != 0
    lost_at = c.iteration()
    before = committed_files(c.save)
    c.launch(FULL)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    assert_committed_files_unchanged(before)
    restores = c.restores(2)
    assert restores[0].source == "memory" and restores[1].source == "peer memory (node 0)", restores
    target = restores[0].iteration
    assert restores[1].iteration == target and lost_at - target <= 1, (lost_at, restores)
    return lost_at, target


@pytest.mark.slow  # (~25 s: the full campaign's replica_holder_kill scenario, run with -m campaign or -m slow)
def test_replica_holder_killed_mid_transfer_then_the_node_is_lost(clusters, reference, tmp_path):
    """Node 0's agent is SIGKILLed halfway through receiving node 1's third snapshot: the half-received
    replica never becomes one, training goes on, node 0's trainer starts a new agent, node 1 sends it a
    whole replica again. Then node 1 is lost and still restores from peer memory, exactly."""
    c = clusters(tmp_path, "fholder")
    c.launch(FULL, **held(1, after=9, faults={0: "replica_receive=kill@3:0"}))
    c.wait_for(lambda: "fault injection: kill at replica_receive" in agent_logs(c), LAUNCH_TIMEOUT,
               "node 0's agent killed mid-transfer")
    lose_node_1_and_restore_from_its_replica(c)
    assert "connected to a new node agent" in c.log(0, 1)
    assert reference.check_losses(c) >= ITERS
    check_sound(c.save)


def test_three_nodes_the_replica_lives_outside_the_lost_nodes_failure_domain(clusters, tmp_path):
    """Nodes 0 and 1 share a rack, node 2 is in another: node 0's replica goes to node 2, past its ring
    neighbour. Node 0 is lost; its rank restores from node 2's memory, the others from their own, and
    the iterations replayed after the resume reproduce the first run's losses exactly."""
    three = with_flag(with_flag(with_flag(SMALL_MODEL, "--expert-model-parallel-size", "3"), "--num-experts", "6"),
                      "--global-batch-size", "12")
    c = clusters(tmp_path, "fracks", nnodes=3, model_args=three)
    racks = {0: {"MEGATRON_PEC_FAILURE_DOMAIN": "rack-a"}, 1: {"MEGATRON_PEC_FAILURE_DOMAIN": "rack-a"},
             2: {"MEGATRON_PEC_FAILURE_DOMAIN": "rack-b"}}
    run = ["--train-iters", "8", "--save-interval", "8", "--non-persistent-save-interval", "3"]
    c.launch(run, **held(0, after=4, node_env=racks))
    wait_held(c, 0)  # the newest snapshot is 3 (nothing persisted yet): 4 is replayed
    c.lose_node(0)
    c.wait_stopped(60, nodes=[1, 2])
    first = {r["iteration"]: r["lm loss"] for r in c.metrics(1) if "lm loss" in r}

    c.launch(run, node_env=racks)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0, 2: 0}, c.logs()
    restores = c.restores(2)
    assert {r: x.source for r, x in restores.items()} == {0: "peer memory (node 2)", 1: "memory", 2: "memory"}, \
        restores
    target = restores[0].iteration
    assert {x.iteration for x in restores.values()} == {target} == {3}, (first, restores)
    assert "replica(s) of node 0's snapshots go to node(s) [2]" in (c.node_dir(0) / "agent.log").read_text()
    replayed = {r["iteration"]: r["lm loss"] for r in c.metrics(2) if "lm loss" in r and r["iteration"] in first}
    assert replayed and all(first[i] == loss for i, loss in replayed.items()), (first, replayed)
    check_sound(c.save)


def test_a_damaged_replica_or_the_loss_of_every_copy_falls_back_to_storage(clusters, reference, tmp_path):
    """1. node 1 is lost and its replica in node 0's memory has a flipped byte: the replacement refuses
    it (checksum) and restores from storage, node 0 the same iteration from its memory. 2. later both
    nodes are lost (the lost node and its only replica holder): everything restores from storage.
    Training continues exactly each time."""
    c = clusters(tmp_path, "fcopies")
    c.launch(FULL, **held(1, after=7))
    wait_held(c, 1)
    c.lose_node(1)
    assert c.wait_exit(60, nodes=[0])[0] != 0
    replica = replica_path(c, 0, 1, 1)
    assert replica is not None, "node 0 holds no replica of node 1"
    flip_bits(replica, -9, 0x04)
    stored = committed(c.save)[-1]

    c.launch(FULL, **held(0, after=10, restored_at=stored))
    wait_held(c, 0)
    restores = c.restores(2)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (stored, "memory"),
                                                                           1: (stored, "storage")}, restores
    assert "replica fails its checksum" in agent_logs(c)
    c.lose_node(0)
    c.lose_node(1)
    stored = committed(c.save)[-1]

    c.launch(FULL)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(3)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (stored, "storage"),
                                                                           1: (stored, "storage")}, restores
    assert reference.check_losses(c) > ITERS
    check_sound(c.save)


# Persisted every 5 iterations, a memory snapshot every iteration: more than three snapshots between two
# commits, so a three-slot ring alone would have recycled the committed iteration's slot.
RARE = with_flag(FULL, "--save-interval", "5")


def test_node_loss_survivor_restores_the_committed_iteration_from_memory_whatever_the_intervals(
        clusters, reference, tmp_path):
    """Without replicas, node 1 is lost after iteration 8: storage holds 5, the survivor's memory 7 and 8 -
    and 5, because the agent keeps the slot of the newest committed iteration until a newer one commits.
    The survivor restores 5 from memory, the lost node from storage, and training continues exactly.

    The restart takes a GPU rank's path (``MEGATRON_PEC_CHECK_ON_DEVICE=1``): the lost node's rank file lands
    through the staging buffers, and its items are checked where they landed, as on the device."""
    c = clusters(tmp_path, "frare")
    no_replicas = RARE + ["--pec-replicas", "0"]  # the lost node then has storage only
    c.launch(no_replicas, **held(1, after=8))
    wait_held(c, 1)
    # (node 1's agent persists 5 while its trainer runs on to the hold: on a loaded machine it may lag)
    c.wait_file(checkpoints(c.save).manifest_path(5), timeout=LAUNCH_TIMEOUT)
    c.lose_node(1)
    assert c.wait_exit(60, nodes=[0])[0] != 0
    assert committed(c.save) == [5]

    c.launch(no_replicas, env={"MEGATRON_PEC_CHECK_ON_DEVICE": "1"})
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(2)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (5, "memory"), 1: (5, "storage")}
    assert re.search(r"rank 1: restored iteration 5 from storage.*; \d+ item\(s\) from storage checked where "
                     r"they landed$", c.log(1, 2), re.M), c.log(1, 2)[-3000:]
    assert reference.check_losses(c, launches=[2]) == ITERS - 5
    check_sound(c.save)


@pytest.mark.slow  # (~38 s: the full campaign's relaunch_finished scenario, run with -m campaign or -m slow)
def test_a_finished_job_relaunched_restores_its_last_iteration_whole_every_time(clusters, tmp_path):
    """Train to 24 (persisted every 10, snapshot-K 2 / persist-K 1), then launch the same job twice
    more, the second time with another PEC configuration. The end of training is a planned exit: 24 is
    committed with every expert, each relaunch restores it with PLT 0 and saves nothing over it (its files
    are never written again), and ``verify`` passes after every launch."""
    c = clusters(tmp_path, "frelaunch")
    job = ["--train-iters", "24", "--save-interval", "10", "--non-persistent-save-interval", "1",
           "--pec-snapshot-k", "2", "--pec-persist-k", "1", "--pec-keep", "0"]
    c.launch(job)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    c.wait_agents_exited()
    assert committed(c.save)[-1] == 24 and set(checkpoints(c.save).read_manifest(24).experts.values()) == {24}
    check_sound(c.save)
    files = iteration_files(c.save, 24)
    for args in (job, with_flag(with_flag(job, "--pec-snapshot-k", "4"), "--pec-persist-k", "2")):
        # the relaunch_finished scenario's checks: exit 0, every rank restores 24 whole from storage with
        # PLT 0; nothing left to train, the files of 24 never written again
        relaunch(c, args, 24, {})
        check_nothing_redone(c, 24, files)
        check_sound(c.save)


@pytest.mark.slow  # (~22 s: the default run has it in the real Megatron-LM loop, test_megatron_lm_loop.py)
def test_planned_exit_under_pec_loses_nothing(clusters, reference, tmp_path):
    """Snapshot-K 2 / persist-K 1 and --exit-interval 7 between persists (every 5): the trainers
    save 7 once more with every expert before they detach, the restart restores 7 with PLT 0.0000% and
    every later loss equals the uninterrupted run's. The campaign's ``planned_exit`` scenario, persists every 5
    (``RARE``); it checks: both launches end cleanly, [5, 7] committed, 7 with every expert at 7; every rank
    restores 7 whole from storage with PLT 0; training finishes; verify passes, the tracker names a commit,
    every loss of both launches equals the reference's."""
    c = clusters(tmp_path, "fexitpec")
    result: dict = {}
    SCENARIOS["planned_exit"](Bench(reference, PRETRAIN), c, {"exit": 7, "k": 2, "save_interval": 5}, result)
    assert c.launches == 2
    assert result["fired"], "iteration 7 was not saved once more with every expert"
    assert "PLT 0.0000%" in c.log(0, 2)
    assert result["losses_compared"] == 7 + ITERS - 7


def test_planned_exit_between_persists_loses_nothing(clusters, reference, tmp_path):
    """--exit-interval 7 with persists every 5: like Megatron-LM, the trainers leave right after the
    memory snapshot of 7 without a second save. Their agents persist and commit 7 before removing node
    memory, and the restart continues from 7 exactly."""
    c = clusters(tmp_path, "fexit")
    c.launch(RARE + ["--exit-interval", "7"])
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    assert "exiting program at iteration 7" in c.log(0)
    c.wait_agents_exited()
    for node in (0, 1):
        # the agent persists the snapshot of 7 - or, when it was skipped (no free region on a loaded
        # machine), the trainers saved 7 once more at the exit, persisted
        assert f"planned exit: persisted rank {node}'s snapshot of iteration 7" in agent_logs(c) or \
            "planned exit: iteration 7 saved once more with every expert" in c.logs(), agent_logs(c)
        assert not list(c.node_dir(node).glob("rank*.slot*")), "a planned exit leaves no node memory behind"
    assert committed(c.save) == [5, 7] and tracker(c.save) == "7"
    check_sound(c.save)

    c.launch(RARE)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    restores = c.restores(2)
    assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (7, "storage"), 1: (7, "storage")}
    assert reference.check_losses(c) == 7 + (ITERS - 7)
    assert committed(c.save)[-1] == ITERS
    check_sound(c.save)


def test_node_loss_lost_node_restores_from_its_replica_in_peer_memory(clusters, reference, tmp_path):
    """Every snapshot is replicated to the other node's agent (the default on more than one node). Node 1
    is lost after iteration 7: a replacement starts with empty memory, its agent pulls the replica from
    node 0 and verifies it, and both ranks restore the newest snapshot before the kill from memory."""
    c = clusters(tmp_path, "fpeer")
    c.launch(FULL, **held(1, after=7))
    lost_at, target = lose_node_1_and_restore_from_its_replica(c)
    assert f"pulled iteration {target} from node 0's memory" in agent_logs(c)
    assert reference.check_losses(c) >= lost_at + ITERS - target
    assert target in committed(c.save), "the iteration restored from memory was persisted after the restart"
    check_sound(c.save)


# ---- invariant 8: storage errors -> training continues, error reported, nothing partial latest ------
def remount(path, mode: str, timeout: float = 30.0) -> None:
    """Remount the bind mount ``ro``/``rw``; "busy" while the agent still has a file open for
    writing, so retry until it has closed it (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(["mount", "-o", f"remount,{mode},bind", str(path)], capture_output=True, text=True)
        if result.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"cannot remount {path} {mode}: {result.stderr}")
        time.sleep(0.1)


def test_storage_enospc_eio_and_read_only_directory(clusters, reference, tmp_path):
    """ENOSPC (injected, mid-file) on node 0 and EIO (injected, before the rename) on node 1 at iteration
    2; later the checkpoint directory turns read-only for a while (a read-only bind mount). Replication
    keeps going meanwhile (its address was published before)."""
    if not can_mount():
        pytest.skip("needs root and mount(8) for a read-only bind mount of the checkpoint directory")
    store, ckpt = tmp_path / "store", tmp_path / "checkpoints"
    store.mkdir()
    ckpt.mkdir()
    subprocess.run(["mount", "--bind", str(store), str(ckpt)], check=True)
    try:
        c = clusters(tmp_path / "job", "fstorage", save=ckpt)
        # Each agent's first storage write publishes its replication address: the faults hit the second
        # write (mid-way through iteration 2's rank file) and the second rename (that file's).
        c.launch(FULL, faults={0: "persist_write=enospc@3:0", 1: "before_rename=eio@2:1"})
        # The trainers are paused while the mount changes, so later saves surely see each state.
        c.wait_file(checkpoints(ckpt).manifest_path(4), timeout=LAUNCH_TIMEOUT)
        c.pause()
        remount(ckpt, "ro")
        c.resume()
        c.wait_log(r"was not persisted: .*Read-only file system", timeout=60)
        c.pause()
        remount(ckpt, "rw")
        c.resume()
        assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    finally:
        if "c" in locals():
            c.close()  # nothing may hold the mount any more
        subprocess.run(["umount", str(ckpt)], check=False)

    log = c.logs()
    failed = {int(i) for i in re.findall(r"snapshot of iteration (\d+) was not persisted", log)}
    assert re.search(r"iteration 2 was not persisted: OSError: \[Errno 28\] injected ENOSPC", c.log(0)), c.log(0)
    assert re.search(r"iteration 2 was not persisted: OSError: \[Errno 5\] injected EIO", c.log(1)), c.log(1)
    assert "training continues" in log
    # Nothing that failed on any node is committed; the rest is; the run never stopped or changed.
    assert 2 in failed and len(failed) >= 2
    assert not failed & set(committed(store)), (failed, committed(store))
    assert set(committed(store)) == set(range(2, ITERS + 1, 2)) - failed
    assert ITERS in committed(store) and tracker(store) == str(ITERS)
    assert reference.check_losses(c) == ITERS
    check_sound(store)
    leftovers = [p for p in store.rglob("*") if p.is_file() and ".safetensors" in p.name and ".tmp" in p.name]
    assert not leftovers, leftovers  # failed writes clean up their temporary files


# ---- invariants 4 and 9: corruption -> fall back with a clear message; other jobs' slots ignored -----
def test_corruption_falls_back_to_previous_valid_iteration(clusters, reference, shm_root):
    """Five kinds of damage on five iterations of the reference checkpoint; the restart must walk back to
    iteration 4, say why at each step, continue bit-exactly, and leave a sound directory behind. Node 0's
    memory holds the reference job's slots of iterations 10-12 (same configuration, same --load path,
    another job id): they must be ignored."""
    root = reference.save_path
    shutil.copytree(reference.archive, root)
    try:
        c = clusters(root.parent / "corrupt", "fcorrupt", save=root)
        files = {i: checkpoints(root).read_manifest(i).ranks for i in (6, 8, 10, 12)}
        path = lambda i, r: root / files[i][str(r)].file
        flip_bits(path(12, 0), -100, 0x01)                   # a flipped byte in the tensor data
        with open(path(10, 1), "r+b") as f:                  # a truncated rank file
            f.truncate(os.path.getsize(path(10, 1)) // 2)
        os.unlink(path(8, 0))                                # a deleted rank file
        m6 = json.loads(Path(checkpoints(root).manifest_path(6)).read_text())
        m6["ranks"]["1"]["file"] = "iter_0000006/pec/rank_00007.safetensors"   # a manifest naming a missing file
        Path(checkpoints(root).manifest_path(6)).write_text(json.dumps(m6))
        (root / TRACKER).write_text("14")          # a stale tracker
        shutil.copytree(reference.memory / "node0", c.node_dir(0))   # another job's slots, same config

        result = run_megatron_pec("verify", root)
        assert result.returncode != 0
        for i in (6, 8, 10, 12):
            assert f"iteration {i} (file of {i})" in result.stdout, result.stdout
        assert run_megatron_pec("verify", root, "--iteration", "4").returncode == 0

        c.launch(FULL)
        assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
        log = c.logs()
        restores = c.restores()
        assert {r: (x.iteration, x.source) for r, x in restores.items()} == {0: (4, "storage"), 1: (4, "storage")}
        assert "belongs to job 'fref'" in c.log(0)                     # invariant 9: not loaded
        assert "fails its checksum" in log and "the file is corrupt" in log
        assert "the manifest says" in log and "(truncated?)" in log
        assert "rank_00000.safetensors is missing" in log and "rank_00007.safetensors is missing" in log
        assert "names iteration 14, which has no valid manifest" in log
        assert log.count("falling back to an older checkpoint") >= 4
        assert no_worker_traceback(log)
        assert reference.check_losses(c) == ITERS - 4
        # The abandoned iterations were written again from the restored state and committed whole.
        assert committed(c.save) == list(range(2, ITERS + 1, 2))
        check_sound(c.save)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("env, checked", [({}, "(checked while copied)"),
                                           ({"MEGATRON_PEC_CHECK_ON_DEVICE": "1"},
                                            "(checked on the device after the copy)")],
                         ids=["host-copy", "device-path"])
def test_a_byte_flipped_in_node_memory_is_caught_where_it_lands(clusters, reference, tmp_path, env, checked):
    """A restore from node memory checks the bytes where they land: on a GPU on the device, after
    the host-to-device copy (``MEGATRON_PEC_CHECK_ON_DEVICE=1`` runs that path on CPU ranks); on CPU ranks
    by the copy that sums them . A byte flipped in node 0's newest snapshot is caught there,
    every rank falls back to an older snapshot, says why, and continues exactly as the uninterrupted run."""
    c = clusters(tmp_path, "fdevice")
    c.launch(FULL, faults="optimizer_step=kill@7")
    assert all(code != 0 for code in c.wait_exit(LAUNCH_TIMEOUT).values())
    memory = NodeMemory.read(str(c.node_dir(0)))
    home, record = memory.newest(0)
    assert record.iteration == 6
    path = c.node_dir(0) / f"rank0.slot{home}"
    _, header = open_slot(str(path))
    dense = next(e for e in header.tensors if e.item == "dense")
    flip_bits(path, header.data_start + dense.begin + 40, 0x04)  # a flipped byte in the dense state of iteration 6
    c.launch(FULL, env=env)
    assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    log = c.logs()
    assert f"{checked} fails its checksum for dense" in log, log[-3000:]
    assert "cannot restore iteration 6" in log and "falling back to an older checkpoint" in log
    restores = c.restores(2)
    assert {x.iteration for x in restores.values()} == {5} and {x.source for x in restores.values()} == {"memory"}
    assert log.count("from node memory checked where they landed") >= 2, log[-3000:]  # (each rank says so)
    assert reference.check_losses(c, launches=[2]) == ITERS - 5
    assert no_worker_traceback(log)


def test_slots_of_same_job_with_other_configuration_are_never_loaded(clusters, reference, shm_root, tmp_path):
    """The reference job's node memory (iterations 10-12, hidden size 64) met by the same job id with
    hidden size 32: nothing from memory may be restored."""
    # Same job id, same --load path as the slots record: only the configuration differs.
    c = clusters(tmp_path, "fref", model_args=with_flag(SMALL_MODEL, "--hidden-size", "32"),
                 shm_dir=shm_root / "other_config", save=reference.save_path)
    for node in (0, 1):
        shutil.copytree(reference.memory / f"node{node}", c.node_dir(node))
        assert NodeMemory.read(str(c.node_dir(node))).slots, "the reference run left no slot index"
    try:
        c.launch(["--train-iters", "2", "--save-interval", "2", "--pec-keep", "0"])
        assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
    finally:
        shutil.rmtree(reference.save_path, ignore_errors=True)
    assert not c.restores(), c.restores()
    assert "no checkpoint found" in c.logs() and "training from iteration 0" in c.logs()


# ---- invariant 10: tmpfs too small -> clear error at start-up naming the size needed -----------------
def test_tmpfs_too_small_fails_at_startup_with_the_size_needed(clusters, tmp_path):
    if not can_mount():
        pytest.skip("needs root and mount(8) to mount a 4 MiB tmpfs")
    tiny = tmp_path / "tiny_shm"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(tiny)], check=True)
    try:
        c = clusters(tmp_path / "job", "ftiny", shm_dir=tiny)
        c.launch(FULL)
        codes = c.wait_exit(60)
        c.close()
    finally:
        subprocess.run(["umount", str(tiny)], check=False)
    assert codes[0] != 0 and codes[1] != 0
    for node in (0, 1):
        log = c.log(node)
        m = re.search(r"megatron-pec: node memory \S+/node%d has (\d+) MiB free, but the snapshot files of (\d+) "
                      r"MiB for each of 1 local rank\(s\) need (\d+) MiB\. Enlarge the tmpfs" % node, log)
        assert m, log
        assert int(m.group(1)) <= 4 and int(m.group(3)) > 4
        assert no_worker_traceback(log) and "SIGBUS" not in log and "Bus error" not in log
    assert not c.metrics(), "training must not start"


# ---- the random campaign (slow; deselected by default: ./run_tests.sh -m campaign) ---------------------
@pytest.mark.campaign
def test_random_fault_campaign(shm_root, tmp_path):
    """Three random runs of every fault type (``python -m megatron_pec.testing.campaign`` runs more)."""
    from megatron_pec.testing.campaign import Campaign, format_table, summarize

    campaign = Campaign(tmp_path, shm_root / "campaign", seed=int(os.environ.get("MEGATRON_PEC_CAMPAIGN_SEED", 7)),
                        script=PRETRAIN)
    campaign.prepare()
    runs, per_type = [], dict.fromkeys(campaign.types, 0)
    while min(per_type.values()) < 3:
        spec = campaign.draw()
        if spec["type"] in per_type and per_type[spec["type"]] < 3:
            per_type[spec["type"]] += 1
            runs.append(campaign.run(len(runs) + 1, spec))
    print(format_table(summarize(runs)))
    failed = [r for r in runs if not r["recovered"]]
    assert not failed, json.dumps(failed, indent=1)
