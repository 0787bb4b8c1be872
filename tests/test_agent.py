"""The node agent as a real process: persist, two-node commit, retention, inspect and verify.

No Megatron here: slots are filled with known bytes through the same SlotFiles the trainer uses.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO
from megatron_pec import manifest
from megatron_pec.agent.client import AgentClient, AgentUnavailable, agent_pid, check_socket_path, ensure_agent
from megatron_pec.agent.memory import JobKey, NodeMemory
from megatron_pec.protocol import (Begin, Begun, Flushed, Hello, JobInfo, Released, Settle, SlotHeader,
                                   SnapshotReady, Stop)
from megatron_pec.slots import SlotFiles, SlotGrants, node_dir, open_slot
from megatron_pec.sources import SourceError, storage_source
from megatron_pec.stformat import decode_header, item_checksums, layout
from megatron_pec.storage import PosixStorage

ENTRIES = layout([("dense/w.param", torch.float32, 256)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(4) for k in ("param", "exp_avg")])
ALL = ("dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3")


class Trainer:
    """One rank speaking the agent protocol as the engine does: hello, begin, snapshots into granted slots."""

    def __init__(self, directory, rank, root, nodes=2, keep=0, job="t", run="run-1", resumed_from=None, replicas=0,
                 fingerprint="f"):
        self.directory, self.rank, self.root, self.run = directory, rank, root, run
        self.job = JobInfo(job_id=job, fingerprint=fingerprint, save=root, local_world_size=1, node_rank=rank,
                           num_nodes=nodes, topology={"ep": 2}, keep=keep, replicas=replicas)
        ensure_agent(directory, rank, idle_timeout=60, keep_shm=False)
        self.files = SlotFiles(directory, rank, ENTRIES, 1)
        self.client = AgentClient(directory, rank)
        self.client.connect(Hello(rank, self.job))
        self.grants = SlotGrants()
        self.begin(run, resumed_from)

    def begin(self, run, resumed_from):
        self.run = run
        self.grants.revoke_all()
        answer, _ = self.client.request(Begin(run, resumed_from), Begun, timeout=30)
        self.grants.add(answer.grants)
        return answer.grants

    def snapshot(self, iteration, persist_items=None, written=ALL, persist=True, slot=None, wait=True,
                 also_written=()):
        """Write ``written`` items at ``iteration`` into a granted slot, announce, wait for the release
        (``wait=False``: return the slot at once); ``also_written``: items a skipped attempt changed."""
        slot = self.grants.take() if slot is None else slot
        assert slot is not None, "the agent granted no free slot"
        for name, view in self.files.views[slot].items():
            if name.split("/")[0] in written:
                view.fill_(iteration + 0.5)
        header = SlotHeader(job_id=self.job.job_id, fingerprint=self.job.fingerprint, save=self.root, rank=self.rank,
                            world_size=2, iteration=iteration, items=dict.fromkeys(written, iteration),
                            tokens={f"L1.E{e}": 100 * iteration + e for e in range(4)}, small="{}", pec="{}",
                            run=self.run)
        self.files.write_header(slot, header.to_metadata())
        assert self.client.send(SnapshotReady(slot, iteration, persist, persist_items, sorted(also_written)))
        if not wait:
            return slot
        for _ in range(100):
            for msg in self.client.poll(block_s=0.2):
                if isinstance(msg, Released):
                    self.grants.add(msg.grants)
                    if msg.iteration == iteration:
                        return slot, msg
        raise AssertionError("no release from the agent")

    def memory(self):
        return NodeMemory.read(self.directory)

    def close(self):
        self.files.close()
        self.client.send(Stop())


@pytest.fixture
def trainers(shm_dir, tmp_path):
    """Factory: a trainer (and its node's agent) per call; all stopped at the end."""
    made = []

    def make(rank, **kw):
        t = Trainer(node_dir(shm_dir, kw.get("job", "t"), rank), rank, str(tmp_path / "ckpt"), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_pec", *args], capture_output=True, text=True, cwd=REPO)


def test_two_nodes_commit_persist_subset_and_verify(trainers):
    t0, t1 = trainers(0), trainers(1)
    root = t0.root
    t0.snapshot(10)
    assert not manifest.committed_iterations(root), "one node's marker must not commit"
    t1.snapshot(10)
    assert manifest.committed_iterations(root) == [10]
    for t in (t0, t1):
        assert t.snapshot(20, ["L1.E1"])[1].error is None
    m = manifest.read_manifest(root, 20)
    assert m.ranks["0"].items == ["L1.E1", "dense"]
    assert m.experts == {"L1.E0": 10, "L1.E1": 20, "L1.E2": 10, "L1.E3": 10}
    assert set(m.sources) == {"10"}
    full, partial = (os.path.getsize(manifest.rank_file(root, i, 0)) for i in (10, 20))
    assert partial < full / 2
    assert manifest.read_tracker(root) == "20"

    report = json.loads(cli("inspect", root, "--json").stdout)
    assert [it["committed"] for it in report["iterations"]] == [True, True]
    assert cli("verify", root).returncode == 0
    # A flipped byte in an older file that iteration 20 still references is caught.
    path = manifest.rank_file(root, 10, 1)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = cli("verify", root)
    assert result.returncode == 1 and "corrupt" in result.stdout


def test_partial_restore_reads_and_checks_only_the_experts_it_needs(trainers):
    """An older version's file is read for a few experts: the header and their byte ranges only,
    each against its own crc32 recorded in the manifest; damage elsewhere does not matter,
    damage in them is caught."""
    t0, t1 = trainers(0), trainers(1)
    root = t0.root
    for t in (t0, t1):
        t.snapshot(10)
    entry = manifest.read_manifest(root, 10).ranks["0"]
    assert set(entry.item_crc32) == {"dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3"}
    path = os.path.join(root, entry.file)
    with open(path, "rb") as f:
        header = decode_header(f.read(1 << 20), file_len=os.path.getsize(path))
    ranges = {e.item: (header.data_start + e.begin, header.data_start + e.end) for e in header.tensors}

    source = storage_source(root, 10, entry)
    source.open(PosixStorage(), {"L1.E2"})
    assert source._buffer is None, "the whole file was read"
    assert all(float(t[0]) == 10.5 for t in source.tensors({"L1.E2/w.param", "L1.E2/w.exp_avg"}).values())
    with pytest.raises(SourceError, match="before being read"):
        source.tensors({"L1.E3/w.param"})

    def flip(offset):
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))

    flip(ranges["L1.E1"][0] + 5)
    fresh = storage_source(root, 10, entry)
    fresh.open(PosixStorage(), {"L1.E2"})                       # untouched expert: still restorable
    with pytest.raises(SourceError, match="fails its checksum for L1.E1"):
        fresh.open(PosixStorage(), {"L1.E1"})
    with pytest.raises(SourceError, match="fails its checksum"):
        storage_source(root, 10, entry).open(PosixStorage())  # a full read checks the whole file
    flip(ranges["L1.E1"][0] + 5)
    flip(20)                                                   # inside the header's JSON
    with pytest.raises(SourceError, match="header checksum"):
        storage_source(root, 10, entry).open(PosixStorage(), {"L1.E2"})


def test_a_flush_leaves_the_agents_cpu_time_by_phase(trainers):
    """The benchmarks' breakdown of what persisting costs: after a flush the agent's ledger holds its
    CPU time in each phase of the snapshots so far, within its whole CPU time."""
    from megatron_pec.agent.cpu import read_ledger
    from megatron_pec.protocol import Flush

    t0, t1 = trainers(0), trainers(1)
    assert read_ledger(t0.directory) is None  # nothing written before a flush
    for t in (t0, t1):
        t.snapshot(10)
    for t in (t0, t1):  # (a partial snapshot: the agent carries the other experts in)
        t.snapshot(20, ["L1.E1"], written=("dense", "L1.E1"))
    t0.client.request(Flush(), Flushed, timeout=30)
    ledger = read_ledger(t0.directory)
    assert set(ledger["phases"]) == {"checking and writing", "node-memory index", "committing", "carrying"}
    assert all(s >= 0 for s in ledger["phases"].values())
    assert 0 < sum(ledger["phases"].values()) <= ledger["process_s"]


def test_retention_keeps_referenced_versions(trainers):
    t0, t1 = trainers(0, keep=1), trainers(1, keep=1)
    for iteration in (10, 20, 30):
        for t in (t0, t1):
            t.snapshot(iteration, ["L1.E1"] if iteration > 10 else None)
    # keep=1 retains 30, and 10's files because experts E0/E2/E3 are still at version 10; 20 goes.
    assert manifest.iterations_on_disk(t0.root) == [10, 30]
    assert manifest.committed_iterations(t0.root) == [30]  # 10 holds files for 30, it is no restore point
    assert cli("verify", t0.root).returncode == 0


def test_retention_never_leaves_a_committed_iteration_pointing_at_deleted_files(trainers):
    """30 still needs 20's file (E1 at 20), 20 needed 10's (E0/E2/E3 at 10), 30 does not: 10 goes, and 20,
    kept for its file, stops being committed - so nothing committed points at a deleted file."""
    t0, t1 = trainers(0, keep=1), trainers(1, keep=1)
    for iteration, persisted in ((10, None), (20, ["L1.E1"]), (30, ["L1.E0", "L1.E2", "L1.E3"])):
        for t in (t0, t1):
            t.snapshot(iteration, persisted)
    assert manifest.read_manifest(t0.root, 30).experts == {"L1.E0": 30, "L1.E1": 20, "L1.E2": 30, "L1.E3": 30}
    assert manifest.iterations_on_disk(t0.root) == [20, 30] and manifest.committed_iterations(t0.root) == [30]
    result = cli("verify", t0.root)
    assert result.returncode == 0, result.stdout
    shown = cli("inspect", t0.root).stdout
    assert "iteration      20: files kept for the expert versions of iteration(s) 30 (not a restore point)" in shown


def test_agent_reports_failed_persist_and_keeps_serving(trainers, monkeypatch):
    monkeypatch.setenv("MEGATRON_PEC_FAULT", "persist_write=enospc")  # the agent inherits it
    t = trainers(0, nodes=1)
    _, msg = t.snapshot(10)
    assert "ENOSPC" in msg.error or "No space" in msg.error
    assert not manifest.committed_iterations(t.root)
    assert not [n for _, _, fs in os.walk(t.root) for n in fs if n.endswith(".safetensors")], "partial file left"
    assert agent_pid(t.directory) is not None
    assert t.snapshot(20)[1].error is None
    assert manifest.committed_iterations(t.root) == [20]


def test_agent_grants_slots_and_never_hands_out_what_it_still_needs(trainers):
    """Triple buffering through grants: the newest complete snapshot and every announced slot stay
    with the agent; a released slot comes back."""
    t = trainers(0, nodes=1)
    assert sorted(t.grants._free) == [0, 1, 2]
    slot, released = t.snapshot(1, persist=False)
    assert released.grants == []                       # slot 1's snapshot is the newest: kept
    second, released = t.snapshot(2, persist=False)
    assert released.grants == [slot]                   # the previous newest, carried from, comes back
    newest = t.memory().newest(0)[0]
    assert newest == second and second not in t.grants._free
    # A restart that resumes from 1 (run 2): 2's slot is abandoned and handed out, 1's is kept.
    grants = t.begin("run-2", 1)
    assert slot not in grants and second in grants


def test_agent_carries_unwritten_experts_forward_from_its_newest_snapshot(trainers):
    t = trainers(0, nodes=1)
    first, _ = t.snapshot(1, persist=False)                                 # every expert at 1
    second, released = t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    assert released.error is None
    record = t.memory().slots[0][second]
    assert record.items == {"dense": 2, "L1.E0": 2, "L1.E1": 1, "L1.E2": 1, "L1.E3": 1}
    assert record.tokens == {"L1.E1": 101, "L1.E2": 102, "L1.E3": 103}
    views = t.files.views[second]
    assert float(views["L1.E1/w.param"][0]) == 1.5 and float(views["L1.E2/w.exp_avg"][-1]) == 1.5
    assert float(views["L1.E0/w.param"][0]) == 2.5
    mapping, header = open_slot(os.path.join(t.directory, f"rank0.slot{second}"))
    try:
        assert item_checksums(mapping, header, set(record.items)) == record.crcs
    finally:
        mapping.close()
    # Carried a second time, the tokens still name the version's counts, not the base's.
    third, _ = t.snapshot(3, written=("dense", "L1.E0"), persist=False)
    assert t.memory().slots[0][third].tokens == {"L1.E1": 101, "L1.E2": 102, "L1.E3": 103}
    found, _ = t.memory().restorable(0, JobKey("t", "f", t.root))
    assert [r.iteration for _, r, _ in found] == [3, 2, 1]


def _mark_in_slot(t, slot, item, value):
    """Change an item's bytes behind everyone's back (what no carry would leave alone)."""
    for name, view in t.files.views[slot].items():
        if name.split("/")[0] == item:
            view.fill_(value)


def _value_in_slot(t, slot, item):
    values = {float(v.flatten()[0]) for n, v in t.files.views[slot].items() if n.split("/")[0] == item}
    assert len(values) == 1, values
    return values.pop()


def test_a_carry_leaves_in_place_what_the_slot_still_holds(trainers):
    """One expert of four per snapshot: into the slot its own trainer last filled, a carry copies only
    the experts written since (E0, E1); E3, unchanged since that slot's snapshot, is already there.
    A mark put on E3 behind the agent's back proves it was not copied; every copied byte is checked."""
    t = trainers(0, nodes=1)
    first, _ = t.snapshot(1, persist=False)
    t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    t.snapshot(3, written=("dense", "L1.E1"), persist=False)
    assert t.grants._free[0] == first  # oldest contents first
    _mark_in_slot(t, first, "L1.E3", 7.0)
    slot, _ = t.snapshot(4, written=("dense", "L1.E2"), persist=False)
    assert slot == first
    record = t.memory().slots[0][slot]
    assert record.items == {"dense": 4, "L1.E0": 2, "L1.E1": 3, "L1.E2": 4, "L1.E3": 1}
    assert [_value_in_slot(t, slot, i) for i in ("L1.E0", "L1.E1", "L1.E2", "L1.E3")] == [2.5, 3.5, 4.5, 7.0]
    mapping, header = open_slot(os.path.join(t.directory, f"rank0.slot{slot}"))
    try:
        copied = {"dense", "L1.E0", "L1.E1", "L1.E2"}
        assert item_checksums(mapping, header, copied) == {i: record.crcs[i] for i in copied}
    finally:
        mapping.close()


def test_an_expert_a_skipped_attempt_wrote_is_carried_again(trainers):
    """A save skipped after its copy began (another rank could not snapshot) leaves the slot granted
    with bytes of its plan; the next snapshot into it names them (``also_written``) and they are
    carried, not taken for the slot's previous contents."""
    t = trainers(0, nodes=1)
    first, _ = t.snapshot(1, persist=False)
    t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    t.snapshot(3, written=("dense", "L1.E1"), persist=False)
    _mark_in_slot(t, first, "L1.E3", 7.0)  # the skipped attempt's copy of E3
    slot, _ = t.snapshot(4, written=("dense", "L1.E2"), persist=False, also_written=("L1.E3",))
    assert slot == first
    assert _value_in_slot(t, slot, "L1.E3") == 1.5


def test_a_slot_another_trainer_was_granted_is_carried_in_full(trainers):
    """A trainer killed mid-copy may have written anything into its granted slot: once another trainer
    (process) was granted the slot, nothing in it is trusted and every unwritten expert is copied."""
    t = trainers(0, nodes=1)
    first, _ = t.snapshot(1, persist=False)
    t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    t.snapshot(3, written=("dense", "L1.E1"), persist=False)
    t.client.close(detach=False)  # killed: the slots it was granted go to its successor
    successor = trainers(0, nodes=1, resumed_from=3)
    assert successor.grants._free[0] == first
    _mark_in_slot(successor, first, "L1.E3", 7.0)
    slot, _ = successor.snapshot(4, written=("dense", "L1.E2"), persist=False)
    assert slot == first
    assert _value_in_slot(successor, slot, "L1.E3") == 1.5  # carried from iteration 3's slot


def test_a_snapshot_is_restorable_before_its_experts_are_carried(trainers, monkeypatch):
    """The agent records a snapshot once it is checked; carrying in the experts it did not write is
    later work that no restore waits for. Agent SIGKILLed between the two: memory still restores
    iteration 2, its unwritten experts from the slot they were to be carried from, every byte checked."""
    from megatron_pec.sources import expert_source_for, memory_sources

    monkeypatch.setenv("MEGATRON_PEC_FAULT", "agent_carried=kill@2")
    t = trainers(0, nodes=1)
    first, _ = t.snapshot(1, persist=False)
    pid = agent_pid(t.directory)  # this process started it: reaped here
    second = t.snapshot(2, written=("dense", "L1.E0"), persist=False, wait=False)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, open(os.path.join(t.directory, "agent.log")).read()
        time.sleep(0.05)
    assert t.memory().slots[0][second].items == {"dense": 2, "L1.E0": 2}
    memory = memory_sources(t.directory, 0, JobKey("t", "f", t.root))
    assert [s.iteration for s in memory] == [2, 1]
    for item, version, value in (("dense", 2, 2.5), ("L1.E0", 2, 2.5), ("L1.E1", 1, 1.5), ("L1.E3", 1, 1.5)):
        source = expert_source_for(item, version, memory, {}, t.root, 0, None)
        assert source.where.endswith(f"slot{first if version == 1 else second}"), item
        source.open(PosixStorage(), {item})
        names = {e.name for e in source._layout.tensors if e.item == item}
        assert names and all(float(v.flatten()[0]) == value for v in source.tensors(names).values()), item


def test_a_restore_through_the_trainers_mapping_takes_its_own_views(trainers):
    """A restore reading the trainer's own slot through its mapping takes the views the trainer
    already has of it (no 90k new ones on a large rank): the same objects, the verified bytes."""
    from megatron_pec.sources import memory_sources

    t = trainers(0, nodes=1)
    slot, _ = t.snapshot(1, persist=False)
    job = JobKey("t", "f", t.root)
    (own,) = memory_sources(t.directory, 0, job, t.files)
    (fresh,) = memory_sources(t.directory, 0, job)
    names = set(t.files.views[slot])
    for source in (own, fresh):
        source.open(PosixStorage())
    taken, built = own.tensors(names), fresh.tensors(names)
    assert all(taken[n] is t.files.views[slot][n] for n in names)
    assert not any(built[n] is t.files.views[slot][n] for n in names)
    assert all(torch.equal(taken[n], built[n]) and float(taken[n][0]) == 1.5 for n in names)


def test_settle_answers_only_once_every_announced_snapshot_is_recorded(trainers):
    """A restore first asks the agent to Settle. The answer may come from the connection's own thread
    (not queued behind carries and commits), so it must still never precede the record of a snapshot
    announced before it: announced and settled back to back, the index already holds it."""
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    for iteration in range(2, 6):
        slot = t.snapshot(iteration, written=("dense", "L1.E0"), persist=iteration % 2 == 0, wait=False)
        _, others = t.client.request(Settle(), Flushed, timeout=30)
        assert t.memory().slots[0][slot].iteration == iteration
        messages, deadline = list(others), time.monotonic() + 30
        while not any(isinstance(m, Released) and m.iteration == iteration for m in messages):
            assert time.monotonic() < deadline, "no release from the agent"
            messages += t.client.poll(block_s=0.2)
        for msg in messages:
            if isinstance(msg, Released):
                t.grants.add(msg.grants)
    t.client.request(Settle(), Flushed, timeout=30)  # nothing announced since: answered at once


def test_carries_wait_while_a_trainer_restores(trainers):
    """Between a trainer's Settle (a restore starts) and its Begin (it ends) the agent carries
    nothing: the restore reads the experts from the older slot and has the node's CPU to itself.
    The carry runs once the Begin arrives."""
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    slot = t.snapshot(2, written=("dense", "L1.E0"), persist=False, wait=False)
    t.client.request(Settle(), Flushed, timeout=30)
    time.sleep(1.0)  # without the hold, the carry takes milliseconds
    assert t.memory().slots[0][slot].items == {"dense": 2, "L1.E0": 2}, "carried during a restore"
    t.begin("run-2", 2)
    deadline = time.monotonic() + 30
    while t.memory().slots[0][slot].items != {"dense": 2, "L1.E0": 2, "L1.E1": 1, "L1.E2": 1, "L1.E3": 1}:
        assert time.monotonic() < deadline, "not carried after the restore ended"
        time.sleep(0.05)


def test_agent_never_carries_from_another_job_or_an_abandoned_timeline(trainers, shm_dir):
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    t.snapshot(2, persist=False)
    # The restart restored 1: run 2's first snapshot must not take experts from iteration 2.
    t.begin("run-2", 1)
    slot, _ = t.snapshot(3, written=("dense", "L1.E0"), persist=False)
    assert t.memory().slots[0][slot].items == {"dense": 3, "L1.E0": 3, "L1.E1": 1, "L1.E2": 1, "L1.E3": 1}
    # A trainer of another --save on the same node directory: nothing carried from this job's slots.
    t.client.close(detach=False)  # a new trainer process takes the rank over
    other = Trainer(t.directory, 0, t.root + "_elsewhere", nodes=1, run="run-3", resumed_from=None)
    try:
        slot, _ = other.snapshot(4, written=("dense", "L1.E0"), persist=False)
        assert other.memory().slots[0][slot].items == {"dense": 4, "L1.E0": 4}
    finally:
        other.close()


def test_retire_removes_half_written_files_of_killed_agents_only(tmp_path):
    """A killed writer's file goes everywhere; a live writer's (an agent still persisting while its
    trainer restarts: ``Settle`` does not wait for persists) stays unless its iteration is retired."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = str(tmp_path)
    for i in (4, 8):
        d = tmp_path / f"iter_{i:07d}" / "pec"
        d.mkdir(parents=True)
        (d / f"rank_00000.safetensors.tmp{dead.pid}").write_bytes(b"half")
        (d / f"rank_00002.safetensors.tmp{os.getpid()}").write_bytes(b"being written")
        (d / "rank_00001.safetensors").write_bytes(b"whole")
    manifest.retire_after(root, 4)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("rank_*"))
    writing = f"iter_0000004/pec/rank_00002.safetensors.tmp{os.getpid()}"
    assert left == ["iter_0000004/pec/rank_00001.safetensors", writing, "iter_0000008/pec/rank_00001.safetensors"]


def test_too_long_socket_path_is_refused_with_the_fix():
    with pytest.raises(AgentUnavailable, match="use a shorter --pec-shm-dir or --pec-job-id"):
        check_socket_path("/dev/shm/" + "x" * 100)
    check_socket_path("/dev/shm/megatron_pec/job/node0")


# ---- replication between node agents ---------------------------------------------------------------
def replica(node_dir, node, rank, iteration, timeout=30.0):
    """The entry of ``node``'s replica of ``rank`` held in ``node_dir``, once it holds ``iteration``."""
    from megatron_pec.agent.replicas import INDEX, REPLICA_DIR
    from megatron_pec.protocol import ReplicaIndex

    path = os.path.join(node_dir, REPLICA_DIR, INDEX)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            entry = ReplicaIndex.loads(open(path, "rb").read()).entries.get(f"{node}.{rank}")
            if entry is not None and entry.record.iteration == iteration:
                return entry
        time.sleep(0.05)
    raise AssertionError(f"no replica of node {node} rank {rank} at iteration {iteration} in {node_dir}")


def item_bytes(path, item):
    mapping, header = open_slot(path)
    try:
        return b"".join(mapping[header.data_start + e.begin:header.data_start + e.end]
                        for e in header.tensors if e.item == item)
    finally:
        mapping.close()


def test_replicas_carry_what_a_snapshot_did_not_write_and_a_replacement_pulls_them(trainers, shm_dir):
    """Node 1's snapshots go to node 0's agent: the first whole, then only what each one wrote; the
    replica equals node 1's slot item for item. Node 1 is lost; a replacement's agent pulls the replica,
    verifies it and records it as its own slot, marked with the node it came from."""
    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t1.snapshot(1, persist=False)
    slot, _ = t1.snapshot(2, written=("dense", "L1.E0"), persist=False)
    entry = replica(t0.directory, 1, 1, 2)
    assert entry.record.items == {"dense": 2, "L1.E0": 2, "L1.E1": 1, "L1.E2": 1, "L1.E3": 1}
    held = os.path.join(t0.directory, "replicas", f"node1.rank1.slot{entry.slot}")
    for item in ALL:
        assert item_bytes(held, item) == item_bytes(os.path.join(t1.directory, f"rank1.slot{slot}"), item), item

    # Node 1 lost: its agent and memory gone; a replacement trainer starts a new agent on empty memory.
    os.kill(agent_pid(t1.directory), 9)
    t1.files.close()
    subprocess.run(["rm", "-rf", t1.directory], check=True)
    t1.client.close(detach=False)
    fresh = trainers(1, replicas=1, run="run-2", resumed_from=None)
    memory = fresh.memory()  # Begin(from scratch) abandons it for *this* run, but the pull recorded it
    logs = open(os.path.join(fresh.directory, "agent.log")).read()
    assert "pulled iteration 2 from node 0's memory" in logs, logs
    assert memory.slots[1][0].origin == 0 and memory.slots[1][0].items == entry.record.items
    for item in ALL:
        assert item_bytes(os.path.join(fresh.directory, "rank1.slot0"), item) == item_bytes(held, item), item


def test_a_corrupt_or_foreign_replica_is_never_pulled(trainers, shm_dir):
    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t1.snapshot(1, persist=False)
    entry = replica(t0.directory, 1, 1, 1)
    held = os.path.join(t0.directory, "replicas", f"node1.rank1.slot{entry.slot}")
    os.kill(agent_pid(t1.directory), 9)
    t1.files.close()
    t1.client.close(detach=False)
    subprocess.run(["rm", "-rf", t1.directory], check=True)

    with open(held, "r+b") as f:  # a flipped byte in the replica's data
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x01]))
    damaged = trainers(1, replicas=1, run="run-y")
    logs = open(os.path.join(damaged.directory, "agent.log")).read()
    assert "replica fails its checksum" in logs and "it restores from storage" in logs, logs
    assert not damaged.memory().slots.get(1), "a corrupt replica became restorable"
    damaged.files.close()
    damaged.client.close(detach=False)
    os.kill(agent_pid(damaged.directory), 9)
    subprocess.run(["rm", "-rf", damaged.directory], check=True)

    foreign = trainers(1, replicas=1, run="run-z", fingerprint="g")  # another configuration of the job
    logs = open(os.path.join(foreign.directory, "agent.log")).read()
    assert "no replica of that rank for this job" in logs, logs
    assert not foreign.memory().slots.get(1)


def test_a_slow_replica_push_holds_a_slot_only_until_it_ends(trainers):
    """The newest snapshot, the newest committed one and one being pushed to a peer can be three
    different slots: then the trainer holds none and its saves are skipped. Once the push ends the
    agent hands the slot back unasked (``Granted``); before, nothing was ever sent again."""
    from megatron_pec.protocol import Granted

    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t0.snapshot(1)
    committed, _ = t1.snapshot(1)
    assert manifest.committed_iterations(t1.root) == [1]
    replica(t0.directory, 1, 1, 1)
    holder = agent_pid(t0.directory)
    os.kill(holder, 19)  # SIGSTOP: the holder takes the next push's bytes but never answers
    try:
        pushed, released = t1.snapshot(2, persist=False)
        assert released.grants == []
        time.sleep(1.0)  # the replicator has taken snapshot 2 and waits for the holder's answer
        newest, released = t1.snapshot(3, persist=False)
        assert released.grants == [], f"slot {pushed} was handed out while being pushed"
        assert len({committed, pushed, newest}) == 3 and not t1.grants._free
    finally:
        os.kill(holder, 18)  # SIGCONT
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        granted = [m for m in t1.client.poll(block_s=0.2) if isinstance(m, Granted)]
        if granted:
            assert granted[0].grants == [pushed]
            break
    else:
        raise AssertionError("the agent never handed back the slot of the finished push")
    replica(t0.directory, 1, 1, 3)
