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
from conftest import REPO, checkpoints

from megatron_pec.agent.client import AgentUnavailable, agent_pid, check_socket_path
from megatron_pec.format.protocol import Flush, Flushed, Pin, Released, Settle, SlotHeader, SnapshotReady
from megatron_pec.format.stformat import decode_header, layout
from megatron_pec.integrity.sum64 import item_sums
from megatron_pec.memory.history import JobKey
from megatron_pec.memory.regions import RegionBook
from megatron_pec.memory.slot_map import POOL
from megatron_pec.memory.slots import SlotCache, node_dir, open_slot, slot_path
from megatron_pec.restore.sources import SourceError, storage_source
from megatron_pec.store.storage import PosixStorage
from megatron_pec.testing.scripted import ScriptedTrainer

pytestmark = pytest.mark.megatron_free

ENTRIES = layout([("dense/w.param", torch.float32, 256)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(4) for k in ("param", "exp_avg")])
ALL = ("dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3")


class Trainer(ScriptedTrainer):
    """The scripted trainer on this file's slot layout."""

    def __init__(self, directory, rank, root, **kw):
        super().__init__(directory, rank, root, ENTRIES, ALL, **kw)


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


def test_every_job_of_the_worker_has_its_one_handler_and_every_trainer_message_too():
    from megatron_pec.agent import jobs
    from megatron_pec.agent.server import Agent
    from megatron_pec.format import protocol

    assert set(Agent.HANDLERS) == {getattr(jobs, name) for name in jobs.__all__} - {jobs.Shutdown}
    sent_by_trainers = {protocol.Hello, protocol.Begin, protocol.SnapshotReady, protocol.Flush, protocol.Settle,
                        protocol.Detach, protocol.Stop}
    assert set(Agent.MESSAGES) == sent_by_trainers


def test_two_nodes_commit_persist_subset_and_verify(trainers):
    t0, t1 = trainers(0), trainers(1)
    root = t0.root
    t0.snapshot(10)
    assert not checkpoints(root).committed_iterations(), "one node's marker must not commit"
    t1.snapshot(10)
    assert checkpoints(root).committed_iterations() == [10]
    for t in (t0, t1):
        assert t.snapshot(20, ["L1.E1"])[1].error is None
    m = checkpoints(root).read_manifest(20)
    assert m.ranks["0"].items == ["L1.E1", "dense"]
    assert m.experts == {"L1.E0": 10, "L1.E1": 20, "L1.E2": 10, "L1.E3": 10}
    assert set(m.sources) == {"10"}
    full, partial = (os.path.getsize(checkpoints(root).rank_file(i, 0)) for i in (10, 20))
    assert partial < full / 2
    assert checkpoints(root).read_tracker() == "20"

    report = json.loads(cli("inspect", root, "--json").stdout)
    assert [it["committed"] for it in report["iterations"]] == [True, True]
    assert cli("verify", root).returncode == 0
    # A flipped byte in an older file that iteration 20 still references is caught.
    path = checkpoints(root).rank_file(10, 1)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = cli("verify", root)
    assert result.returncode == 1 and "corrupt" in result.stdout


def test_partial_restore_reads_and_checks_only_the_experts_it_needs(trainers):
    """An older version's file is read for a few experts: the header and their byte ranges only,
    each against its own checksum recorded in the manifest; damage elsewhere does not matter,
    damage in them is caught."""
    t0, t1 = trainers(0), trainers(1)
    root = t0.root
    for t in (t0, t1):
        t.snapshot(10)
    entry = checkpoints(root).read_manifest(10).ranks["0"]
    assert set(entry.item_sums) == {"dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3"} and not entry.item_crc32
    path = os.path.join(root, entry.file)
    with open(path, "rb") as f:
        header = decode_header(f.read(1 << 20), file_len=os.path.getsize(path))
    ranges = {e.item: (header.data_start + e.begin, header.data_start + e.end) for e in header.tensors}

    source = storage_source(checkpoints(root), 10, entry)
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
    fresh = storage_source(checkpoints(root), 10, entry)
    fresh.open(PosixStorage(), {"L1.E2"})                       # untouched expert: still restorable
    with pytest.raises(SourceError, match="fails its checksum for L1.E1"):
        fresh.open(PosixStorage(), {"L1.E1"})
    with pytest.raises(SourceError, match="fails its checksum"):
        storage_source(checkpoints(root), 10, entry).open(PosixStorage())  # a full read checks the whole file
    flip(ranges["L1.E1"][0] + 5)
    flip(20)                                                   # inside the header's JSON
    with pytest.raises(SourceError, match="header checksum"):
        storage_source(checkpoints(root), 10, entry).open(PosixStorage(), {"L1.E2"})


def test_a_flush_leaves_the_agents_cpu_time_by_phase(trainers):
    """The benchmarks' breakdown of what persisting costs: after a flush the agent's ledger holds its
    CPU time in each phase of the snapshots so far, within its whole CPU time."""
    from megatron_pec.agent.cpu_ledger import read_ledger

    t0, t1 = trainers(0), trainers(1)
    assert read_ledger(t0.directory) is None  # nothing written before a flush
    for t in (t0, t1):
        t.snapshot(10)
    for t in (t0, t1):  # (a partial snapshot)
        t.snapshot(20, ["L1.E1"], written=("dense", "L1.E1"))
    t0.client.request(Flush(), Flushed, timeout=30)
    ledger = read_ledger(t0.directory)
    assert set(ledger["phases"]) == {"checking", "node-memory index", "replicating", "writing",
                                     "checking persisted items", "committing"}
    assert all(s >= 0 for s in ledger["phases"].values())
    assert 0 < sum(ledger["phases"].values()) <= ledger["process_s"]


def test_retention_keeps_referenced_versions(trainers):
    t0, t1 = trainers(0, keep=1), trainers(1, keep=1)
    for iteration in (10, 20, 30):
        for t in (t0, t1):
            t.snapshot(iteration, ["L1.E1"] if iteration > 10 else None)
    for t in (t0, t1):
        t.client.request(Flush(), Flushed, timeout=30)  # retention runs off the commit's path: a flush waits for it
    # keep=1 retains 30, and 10's files because experts E0/E2/E3 are still at version 10; 20 goes.
    assert checkpoints(t0.root).iterations_on_disk() == [10, 30]
    assert checkpoints(t0.root).committed_iterations() == [30]  # 10 holds files for 30, it is no restore point
    assert cli("verify", t0.root).returncode == 0


def test_retention_never_leaves_a_committed_iteration_pointing_at_deleted_files(trainers):
    """30 still needs 20's file (E1 at 20), 20 needed 10's (E0/E2/E3 at 10), 30 does not: 10 goes, and 20,
    kept for its file, stops being committed - so nothing committed points at a deleted file."""
    t0, t1 = trainers(0, keep=1), trainers(1, keep=1)
    for iteration, persisted in ((10, None), (20, ["L1.E1"]), (30, ["L1.E0", "L1.E2", "L1.E3"])):
        for t in (t0, t1):
            t.snapshot(iteration, persisted)
    for t in (t0, t1):
        t.client.request(Flush(), Flushed, timeout=30)  # retention runs off the commit's path: a flush waits for it
    assert checkpoints(t0.root).read_manifest(30).experts == {"L1.E0": 30, "L1.E1": 20, "L1.E2": 30, "L1.E3": 30}
    assert checkpoints(t0.root).iterations_on_disk() == [20, 30] and checkpoints(t0.root).committed_iterations() == [30]
    result = cli("verify", t0.root)
    assert result.returncode == 0, result.stdout
    shown = cli("inspect", t0.root).stdout
    assert "iteration      20: files kept for the expert versions of iteration(s) 30 (not a restore point)" in shown


def test_agent_reports_failed_persist_and_keeps_serving(trainers, monkeypatch):
    monkeypatch.setenv("MEGATRON_PEC_FAULT", "persist_write=enospc")  # the agent inherits it
    t = trainers(0, nodes=1)
    _, msg = t.snapshot(10)
    assert "ENOSPC" in msg.error or "No space" in msg.error
    assert not checkpoints(t.root).committed_iterations()
    assert not [n for _, _, fs in os.walk(t.root) for n in fs if n.endswith(".safetensors")], "partial file left"
    assert agent_pid(t.directory) is not None
    assert t.snapshot(20)[1].error is None
    assert checkpoints(t.root).committed_iterations() == [20]


def trainer_sums(t, placement) -> dict:
    """Each item's checksum over the region the trainer wrote it to, as the trainer computes it."""
    return {item: item_sums(t.files.mapping(slot), t.files.item_header(slot, item), {item})[item]
            for item, slot in placement.items()}


def regions_of(t, rank=0):
    """item -> (slot, version) of each item's newest version in node memory, as the agent recorded it."""
    return t.memory().regions(rank)


def test_partial_snapshots_leave_each_expert_where_it_was_written(trainers):
    """One expert per snapshot: the agent records each region where the trainer wrote it and copies
    nothing between slots; node memory still holds every expert at its newest version, each with the
    checksum the trainer computed, and a restore finds them all."""
    from megatron_pec.restore.sources import memory_sources

    t = trainers(0, nodes=1)
    (_, first), _ = t.snapshot(1, persist=False)                            # every expert at 1
    for iteration, expert in ((2, "L1.E0"), (3, "L1.E1"), (4, "L1.E2")):
        (home, placement), released = t.snapshot(iteration, written=("dense", expert), persist=False)
        assert released.recorded and released.error is None
        assert placement["dense"] == home and placement[expert] >= POOL     # (experts in pool regions)
    newest = regions_of(t)
    assert {i: v for i, (_, v) in newest.items()} == {"dense": 4, "L1.E0": 2, "L1.E1": 3, "L1.E2": 4, "L1.E3": 1}
    assert newest["L1.E3"][0] == first["L1.E3"]                             # never moved
    for item, (slot, version) in newest.items():                            # the bytes where the index says
        assert {float(v.flatten()[0]) for v in t.files.item_views(slot, item).values()} == {version + 0.5}, item
    memory = memory_sources(t.directory, 0, JobKey("t", "f", t.root))
    assert memory[0].iteration == 4
    for item, (slot, version) in newest.items():
        source = next(m for m in memory if m.items.get(item) == version)
        assert source.where == slot_path(t.directory, 0, slot)
        source.open(PosixStorage(), {item})                                 # checked against the trainer's sums


def test_the_agent_records_a_memory_snapshot_without_reading_its_bytes(trainers):
    """The header's checksums are the record: bytes changed in node memory after the trainer summed
    them are not read by the agent (the snapshot is recorded) but caught by the restore that reads them."""
    from megatron_pec.restore.sources import memory_sources

    t = trainers(0, nodes=1)
    home, placement = t.write(1)
    sums = trainer_sums(t, placement)
    t.files.item_views(placement["L1.E2"], "L1.E2")["L1.E2/w.param"][3] = 99.0  # after the trainer's sums
    header = SlotHeader(job_id="t", fingerprint="f", save=t.root, rank=0, world_size=2, iteration=1,
                        items=dict.fromkeys(ALL, 1), tokens={}, small="{}", pec="{}", run=t.run, sums=sums)
    t.files.write_header(home, header.to_metadata())
    places = {i: s for i, s in placement.items() if s != home}
    assert t.client.send(SnapshotReady(home, 1, False, None, places, t.book.announced(1, placement)))
    assert t.released(1).recorded
    sources = {item: source for source in memory_sources(t.directory, 0, JobKey("t", "f", t.root))
               for item in source.items}
    sources["dense"].open(PosixStorage(), {"dense"})
    sources["L1.E0"].open(PosixStorage(), {"L1.E0"})
    with pytest.raises(SourceError, match="fails its checksum for L1.E2"):
        sources["L1.E2"].open(PosixStorage(), {"L1.E2"})


def test_a_slot_of_an_older_trainer_is_checked_by_the_agent(trainers):
    """A header without checksums (written by an earlier release's trainer): the agent computes them,
    as that release's agent did, and the snapshot restores."""
    t = trainers(0, nodes=1)
    _, released = t.snapshot(1, persist=True, legacy=True)
    assert released.recorded and released.error is None
    record = t.memory().slots[0][t.memory().newest(0)[0]]
    assert record.crcs and not record.sums
    assert cli("verify", t.root).returncode == 0 and checkpoints(t.root).read_manifest(1).ranks["0"].item_crc32


def test_a_corrupt_region_never_becomes_a_rank_file(trainers):
    """A persisted item is checked against the trainer's checksum while it is written: a byte changed
    in node memory fails the persist (reported), and no rank file appears. The snapshot is recorded from
    its header as every snapshot is (a restore from node memory checks the bytes it reads)."""
    t = trainers(0, nodes=1)
    home, placement = t.write(5)
    sums = trainer_sums(t, placement)
    t.files.views[home]["dense/w.param"][0] = -1.0
    header = SlotHeader(job_id="t", fingerprint="f", save=t.root, rank=0, world_size=2, iteration=5,
                        items=dict.fromkeys(ALL, 5), tokens={}, small="{}", pec="{}", run=t.run, sums=sums)
    t.files.write_header(home, header.to_metadata())
    places = {i: s for i, s in placement.items() if s != home}
    assert t.client.send(SnapshotReady(home, 5, True, None, places, t.book.announced(5, placement)))
    released = t.released(5)
    assert released.recorded and "fails its checksum for dense" in released.error
    pec = os.path.dirname(checkpoints(t.root).rank_file(5, 0))
    assert not [f for f in (os.listdir(pec) if os.path.isdir(pec) else []) if f.endswith(".safetensors")]
    assert not checkpoints(t.root).committed_iterations()


def test_what_a_skipped_attempt_overwrote_is_dropped_from_node_memory(trainers):
    """A save skipped after its copy began (another rank could not snapshot) overwrote regions it never
    announces: the next announcement names them (``stale``) and the agent forgets what they held."""
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    _, attempt = t.write(3, written=("dense", "L1.E3"))                    # skipped: never announced
    t.book.skipped(attempt)
    assert regions_of(t)["L1.E3"][1] == 1                                   # not known to the agent yet
    t.snapshot(4, written=("dense", "L1.E1"), persist=False)
    memory = t.memory()
    assert all(attempt["L1.E3"] != slot or "L1.E3" not in record.items
               for slot, record in memory.slots[0].items())
    assert regions_of(t)["L1.E3"] == (regions_of(t)["L1.E3"][0], 1)        # its newest version, intact


def test_regions_never_overwrite_the_newest_version_in_flight_or_pinned_ones():
    """The trainer's choice of regions (``RegionBook``), on its own: the newest recorded version of every
    item, what is in flight and what the agent pinned are never handed out; with no dense region left
    there is no snapshot (skipped, never torn), and an expert takes any free pool region."""
    from megatron_pec.format.protocol import Pin

    book = RegionBook(["dense", "L1.E0"], pool=2)                           # home slots 0, 1; pool POOL, POOL + 1
    assert book.home() == 0 and book.capacity() == 2
    first = book.place(0, ["dense", "L1.E0"])
    assert first == {"dense": 0, "L1.E0": POOL}
    book.writing(1, first)
    book.announced(1, first)
    book.released(1, True)
    assert book.home() == 1 and book.capacity() == 1                        # 1's dense and E0 are the newest
    second = book.place(1, ["dense", "L1.E0"])
    assert second == {"dense": 1, "L1.E0": POOL + 1}
    book.writing(2, second)
    book.announced(2, second)                                               # in flight
    assert book.home() is None and book.capacity() == 0                     # newest or in flight: nothing free
    book.pin([Pin(1, ["dense", "L1.E0"])])                                  # 1 kept (being persisted)
    book.released(2, True)                                                  # 2 is newest now, 1 pinned
    assert book.home() is None and book.capacity() == 0
    with pytest.raises(RuntimeError, match="1 experts to write and 0 pool regions free"):
        book.place(None, ["L1.E0"])
    book.pin([Pin(1, ["dense"])])                                           # E0 of 1 handed back
    assert book.home() is None and book.capacity() == 1
    book.pin([])
    assert book.home() == 0
    writing = book.place(0, ["dense"])
    book.writing(3, writing)                                                # dense: newest, or being written
    assert book.home() is None
    book.skipped(writing)
    assert book.home() == 0
    book.released(1, True)                                                  # (unknown iteration: nothing)
    book.pin([Pin(2, None, newest=True)])                                   # each item's newest up to 2
    assert book.home() == 0 and book.capacity() == 1 and book.pinned[1] and book.pinned[POOL + 1]


def test_what_a_snapshot_may_overwrite_is_kept_up_to_date_through_every_change():
    """The book works out what may be overwritten when the agent's answers change it, not when a save
    asks: after each of a random run of writes, announcements, answers, skips and pins, the home slot,
    capacity and writable regions it keeps are what working them out from scratch gives."""
    import random

    import numpy

    from megatron_pec.format.protocol import Pin

    items = ["dense", "L1.E0", "L1.E1", "L1.E2"]
    book, rng, iteration = RegionBook(items, pool=5), random.Random(0), 0

    def kept_as_worked_out():
        fresh = book._work_out_writable()
        assert (book.writable() == fresh).all()
        assert book.capacity() == int(fresh[POOL:].sum())
        assert book.home() == (None if book.hold else book._home(fresh))
        pool = numpy.nonzero(fresh[POOL:])[0] + POOL
        oldest_first = pool[numpy.argsort(book.version[pool], kind="stable")].tolist()
        experts = items[1:1 + min(len(pool), 3)]
        assert book.place(None, experts) == dict(zip(experts, oldest_first))

    for _ in range(300):
        step = rng.choice(["write", "write", "answer", "skip", "pin"])
        home = book.home()
        if step == "write" and home is not None:
            iteration += 1
            experts = rng.sample(items[1:], min(book.capacity(), rng.randint(0, 3)))
            placed = book.place(home, ["dense", *experts])
            book.writing(iteration, placed)
            kept_as_worked_out()  # (in flight, not yet answered)
            if rng.random() < 0.2:
                book.skipped(placed)
            else:
                book.announced(iteration, placed)
        elif step == "answer" and book.pending:
            book.released(book.pending[0][0], rng.random() < 0.9)
        elif step == "pin":
            pins = [Pin(iteration, rng.choice([None, ["dense"], ["L1.E1"]]), newest=rng.random() < 0.5)]
            book.pin(pins if rng.random() < 0.7 else [], hold=rng.choice([None, None, "a replica lags"]))
        kept_as_worked_out()


def test_one_iteration_saved_twice_answers_each_save_and_pins_the_later_version():
    """A planned exit saves the iteration of its last snapshot once more: the book keeps both announcements
    apart (answered in order), the later version is the newest, and a pin of each item's newest version
    holds that one, leaving the earlier one free."""
    from megatron_pec.format.protocol import Pin

    book = RegionBook(["dense", "L1.E0"], pool=2)
    for iteration in (4, 5):
        placed = book.place(book.home(), ["dense", "L1.E0"])
        book.writing(iteration, placed)
        book.announced(iteration, placed)
        book.released(iteration, True)
    assert book.newest[1] == POOL + 1
    again = book.place(None, ["L1.E0"])                                     # the exit's save of 5
    assert again == {"L1.E0": POOL}
    book.writing(5, again)
    book.announced(5, again)
    held = book.place(book.home(), ["dense"])                               # a second announcement of 5,
    book.writing(5, held)                                                   # before the first is answered
    book.announced(5, held)
    book.released(5, True)
    assert book.pending == [(5, list(held.values()))]                       # the second is still in flight
    book.released(5, True)
    assert not book.pending and book.newest[1] == POOL
    book.pin([Pin(5, ["L1.E0"], newest=True)])
    assert book.pinned[POOL] and not book.pinned[POOL + 1] and book.capacity() == 1


def test_a_restart_resumes_the_regions_of_its_timeline_only(trainers):
    """After a restore of 1, regions of the abandoned iteration 2 are free (and never restored); those of 1
    stay. A trainer of another --save on the same node directory starts from nothing."""
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    t.snapshot(2, written=("dense", "L1.E0"), persist=False)
    t.begin("run-2", 1)
    assert {i: v for i, (_, v) in regions_of(t).items()} == dict.fromkeys(ALL, 1)
    (home, _), _ = t.snapshot(3, written=("dense", "L1.E0"), persist=False)
    assert {i: v for i, (_, v) in regions_of(t).items()} == {**dict.fromkeys(ALL, 1), "dense": 3, "L1.E0": 3}
    t.client.close(detach=False)  # a new trainer process takes the rank over
    other = Trainer(t.directory, 0, t.root + "_elsewhere", nodes=1, run="run-3", resumed_from=None)
    try:
        assert regions_of(other) == {}
        other.snapshot(4, written=("dense", "L1.E0"), persist=False)
        assert {i: v for i, (_, v) in regions_of(other).items()} == {"dense": 4, "L1.E0": 4}
    finally:
        other.close()


def test_a_restore_of_an_iteration_storage_holds_writes_nothing_to_storage(trainers):
    """Restored from node memory, an iteration committed with every item its snapshot wrote is persisted by
    the committed files themselves: the agent leaves the checkpoint directory untouched - no node marker
    written and deleted again at every restore, no commit said - however often a job restores it."""
    t = trainers(0, nodes=1)
    t.snapshot(10)
    pec = checkpoints(t.root).pec_dir(10)
    before = (sorted(os.listdir(pec)), os.stat(pec).st_mtime_ns, open(os.path.join(pec, "manifest.json"), "rb").read())
    time.sleep(0.05)  # (a file made and removed would move the directory's time past the coarse clock's tick)
    for run in ("run-2", "run-3"):
        t.begin(run, 10)
        t.client.request(Flush(), Flushed, timeout=30)  # (the persist of the restored iteration is done)
        after = (sorted(os.listdir(pec)), os.stat(pec).st_mtime_ns,
                 open(os.path.join(pec, "manifest.json"), "rb").read())
        assert after == before
    assert open(os.path.join(t.directory, "agent.log")).read().count("committed iteration 10") == 1


def test_a_restarts_uncommitted_persist_keeps_its_dense_state_pinned(trainers):
    """Node 1 never commits, so every persist here stays uncommitted. The old run persisted 20; the
    restart resumes at 10 and persists 12: the agent pins 12's dense state (the old run's higher
    iteration must not count as the newest write), so later snapshots keep off it until 12 commits."""
    t = trainers(0)                                           # two nodes; the second never reports
    t.snapshot(10)
    t.snapshot(20)
    t.begin("run-2", 10)
    t.snapshot(11, written=("dense", "L1.E0"), persist=False)
    _, released = t.snapshot(12, written=("dense", "L1.E1"))
    assert released.error is None and checkpoints(t.root).committed_iterations() == []
    home_of_12 = t.memory().regions(0, upto=12)["dense"][0]
    assert Pin(12, ["dense"], slots=[home_of_12]) in released.pins   # (exactly its home)
    for iteration in (13, 14):                                # each needs a region for the dense state
        _, released = t.snapshot(iteration, written=("dense",), persist=False)
        assert Pin(12, ["dense"], slots=[home_of_12]) in released.pins
    assert regions_of(t)["dense"][1] == 14 and t.memory().regions(0, upto=12)["dense"][1] == 12


def test_a_restore_through_the_trainers_mapping_takes_its_own_views(trainers):
    """A restore reading the trainer's own slot through its mapping takes the views the trainer
    already has of it (no 90k new ones on a large rank): the same objects, the verified bytes."""
    from megatron_pec.restore.sources import memory_sources

    t = trainers(0, nodes=1)
    (slot, _), _ = t.snapshot(1, persist=False)
    job = JobKey("t", "f", t.root)
    own = next(s for s in memory_sources(t.directory, 0, job, t.files) if s.iteration == 1)
    fresh = next(s for s in memory_sources(t.directory, 0, job) if s.iteration == 1)
    names = set(t.files.views[slot])
    for source in (own, fresh):
        source.open(PosixStorage())
    taken, built = own.tensors(names), fresh.tensors(names)
    assert all(taken[n] is t.files.views[slot][n] for n in names)
    assert not any(built[n] is t.files.views[slot][n] for n in names)
    assert all(torch.equal(taken[n], built[n]) and float(taken[n][0]) == 1.5 for n in names)


def test_settle_answers_only_once_every_announced_snapshot_is_recorded(trainers):
    """A restore first asks the agent to Settle. The answer may come from the connection's own thread
    (not queued behind commits), so it must still never precede the record of a snapshot announced
    before it: announced and settled back to back, the index already holds it."""
    t = trainers(0, nodes=1)
    t.snapshot(1, persist=False)
    for iteration in range(2, 6):
        home, _ = t.snapshot(iteration, written=("dense", "L1.E0"), persist=iteration % 2 == 0, wait=False)
        _, others = t.client.request(Settle(), Flushed, timeout=30)
        assert t.memory().slots[0][home].iteration == iteration
        messages, deadline = list(others), time.monotonic() + 30
        while not any(isinstance(m, Released) and m.iteration == iteration for m in messages):
            assert time.monotonic() < deadline, "no release from the agent"
            messages += t.client.poll(block_s=0.2)
        for msg in messages:
            t.hear(msg)
    t.client.request(Settle(), Flushed, timeout=30)  # nothing announced since: answered at once


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
    checkpoints(root).retire_after(4)
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
    from megatron_pec.agent.replica_transport import INDEX
    from megatron_pec.format.protocol import ReplicaIndex
    from megatron_pec.memory.node_files import REPLICAS

    path = os.path.join(node_dir, REPLICAS, INDEX)
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


def region_bytes(directory, rank, slot, item):
    """The bytes of ``item`` in ``slot`` of a rank's node memory."""
    mapping, header = SlotCache().item(directory, rank, slot, item)
    return b"".join(mapping[header.data_start + e.begin:header.data_start + e.end]
                    for e in header.tensors if e.item == item)


def test_replicas_hold_what_a_snapshot_did_not_write_and_a_replacement_pulls_them(trainers, shm_dir):
    """Node 1's snapshots go to node 0's agent: the first whole, then only what each one wrote, into one
    replica file, each item once; the replica equals node 1's memory item for item. Node 1 is lost; a
    replacement's agent pulls the replica (one whole file), writes each item into its own node memory,
    verifies it and records it, marked with the node it came from."""
    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t1.snapshot(1, persist=False)
    t1.snapshot(2, written=("dense", "L1.E0"), persist=False)
    entry = replica(t0.directory, 1, 1, 2)
    assert entry.record.items == {"dense": 2, "L1.E0": 2, "L1.E1": 1, "L1.E2": 1, "L1.E3": 1}
    held = os.path.join(t0.directory, "replicas", "node1.rank1.replica")
    assert os.path.getsize(held) < 1.1 * sum(os.path.getsize(os.path.join(t1.directory, f"rank1.slot{s}"))
                                             for s in (0,)) + 4 * 2 * 128 * 4 + (1 << 20)  # (the state's size)
    own = regions_of(t1, 1)
    for item in ALL:
        assert item_bytes(held, item) == region_bytes(t1.directory, 1, own[item][0], item), item

    # Node 1 lost: its agent and memory gone; a replacement trainer starts a new agent on empty memory.
    os.kill(agent_pid(t1.directory), 9)
    t1.files.close()
    subprocess.run(["rm", "-rf", t1.directory], check=True)
    t1.client.close(detach=False)
    fresh = trainers(1, replicas=1, run="run-2", resumed_from=None)
    memory = fresh.memory()  # Begin(from scratch) abandons it for *this* run, but the pull recorded it
    logs = open(os.path.join(fresh.directory, "agent.log")).read()
    assert "pulled iteration 2 from node 0's memory" in logs, logs
    pulled = {item: (slot, version) for slot, record in memory.slots[1].items()
              for item, version in record.items.items()}
    assert {item: v for item, (_, v) in pulled.items()} == entry.record.items
    assert memory.slots[1][0].origin == 0 and pulled["dense"][0] == 0
    assert all(record.origin == 0 for record in memory.slots[1].values())
    for item, (slot, _) in pulled.items():
        assert region_bytes(fresh.directory, 1, slot, item) == item_bytes(held, item), item


def test_a_corrupt_or_foreign_replica_is_never_pulled(trainers, shm_dir):
    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t1.snapshot(1, persist=False)
    replica(t0.directory, 1, 1, 1)
    held = os.path.join(t0.directory, "replicas", "node1.rank1.replica")
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


def test_a_slow_replica_push_holds_the_next_snapshot_back_only_as_far_as_the_lag_bound(trainers):
    """The replica lag is a bound, not a timing assumption. The holder stopped (SIGSTOP) in the
    middle of a push: the snapshot being pushed is pinned on its trainer, and once the newest replica is
    --pec-replica-lag (2) snapshots behind, the agent holds the next snapshot back (``hold``) instead of
    letting a node loss lose more. The push ends: the agent says so unasked (``Granted``), without hold."""
    t0, t1 = trainers(0, replicas=1), trainers(1, replicas=1)
    t0.snapshot(1)
    t1.snapshot(1)
    replica(t0.directory, 1, 1, 1)
    holder = agent_pid(t0.directory)
    os.kill(holder, 19)  # SIGSTOP: the holder takes the next push's bytes but never answers
    try:
        _, released = t1.snapshot(2, persist=False)
        assert released.hold is None                                      # 1 snapshot behind: within the bound
        time.sleep(1.0)  # the replicator has taken snapshot 2 and waits for the holder's answer
        _, released = t1.snapshot(3, persist=False)
        assert any(p.iteration == 2 for p in released.pins), released.pins  # what is being read stays
        assert released.hold and "2 snapshots behind" in released.hold and "--pec-replica-lag 2" in released.hold
        assert t1.book.home() is None and t1.book.held_by_replicas()
    finally:
        os.kill(holder, 18)  # SIGCONT
    assert t1.hear_until(lambda: t1.book.home() is not None), "the agent never said the push ended"
    replica(t0.directory, 1, 1, 3)


def test_snapshots_are_recorded_and_released_while_a_persist_is_written(trainers, monkeypatch):
    """A persist takes as long as storage needs (here its rename stalls 3 s): it is released once recorded,
    the regions its write has read are handed back as it goes, the memory-only snapshots after it are
    recorded and released meanwhile (in the regions it read), its second release comes once it is written,
    and that late release does not make its regions the newest again."""
    monkeypatch.setenv("MEGATRON_PEC_FAULT", "before_rename=stall")
    t = trainers(0, nodes=1)
    heard = []
    hear = t.hear
    t.hear = lambda msg: (heard.append((msg.iteration, msg.persisting)) if isinstance(msg, Released) else None,
                          hear(msg))
    t.snapshot(10, wait=False)
    for i in (11, 12, 13):
        _, released = t.snapshot(i, persist=False, written=("dense", f"L1.E{i % 4}"))
        assert released.recorded and released.error is None
    assert heard == [(10, True), (11, False), (12, False), (13, False)]  # 10 recorded, still being written
    home13 = t.book.newest[t.book.index["dense"]]
    persisted = t.released(10)
    assert persisted.recorded and persisted.error is None and heard[-1] == (10, False)
    assert t.book.newest[t.book.index["dense"]] == home13 and t.memory().newest(0)[1].iteration == 13
    assert checkpoints(t.root).committed_iterations() == [10]


def test_a_trainer_that_begins_while_a_persist_is_written_keeps_off_its_regions(trainers, monkeypatch):
    """The restarted trainer hears pins for what the writes in flight read - the stalled persist of 10 (all
    of it read once its rename stalls: nothing), and the persist of 13, restored from node memory - and hears
    them dropped once the writes end (on one node nothing stays: a node loss loses everything anyway)."""
    monkeypatch.setenv("MEGATRON_PEC_FAULT", "before_rename=stall")
    t = trainers(0, nodes=1)
    t.snapshot(10, wait=False)
    for i in (11, 12, 13):
        t.snapshot(i, persist=False, written=("dense", f"L1.E{i % 4}"))
    read_all = ([], [Pin(10, [], slots=[])])
    # (how far the persist has read by now depends on the machine's storage: wait until it has read all)
    t.hear_until(lambda: [p for p in t.book.pins if p.iteration == 10] in read_all)
    begun = t.begin("run-2", 13)
    assert Pin(13, None, newest=True) in begun.pins and [p for p in begun.pins if p.iteration == 10] in read_all, \
        begun.pins
    t.hear_until(lambda: not t.book.pins and checkpoints(t.root).committed_iterations() == [13, 10])
    assert t.book.pins == [] and checkpoints(t.root).committed_iterations() == [13, 10]


def test_a_snapshot_being_written_keeps_its_dense_state_pinned_after_the_writer_read_it():
    """Two nodes, no replicas: survivors of a node loss restore from memory the iteration the lost node
    restores from storage. While the agent writes iteration 5, its writer hands the dense state back once
    read (the write's own pin then names the experts left); until the write ends, and then as committed,
    the dense state of 5 stays pinned, so the trainer's next saves (6, 7, 8 into its three home slots)
    cannot overwrite it mid-write. (Found by test_node_loss_survivor_..._whatever_the_intervals: about one
    run in eight restored 5 from storage.)"""
    from types import SimpleNamespace

    from megatron_pec.agent.pins import pins

    records = {2: SimpleNamespace(iteration=5, run="r"), 0: SimpleNamespace(iteration=6, run="r"),
               1: SimpleNamespace(iteration=7, run="r")}

    class Memory:
        def newest(self, rank, accept):
            live = [(rec.iteration, slot) for slot, rec in records.items() if accept(rec)]
            return (max(live)[1], records[max(live)[1]]) if live else None

    job = SimpleNamespace(replicas=0, num_nodes=2)
    nothing_committed = SimpleNamespace(is_committed=lambda iteration: False)
    writing = [Pin(5, ["L1.E0", "L1.E1"], slots=[9, 10])]  # (the dense state read already)
    assert Pin(5, ["dense"], slots=[2]) in pins(0, job, Memory(), nothing_committed, [], writing, None)
    assert Pin(5, ["dense"], slots=[2]) in pins(0, job, Memory(), nothing_committed, [], [], ("r", 5))
    assert not [p for p in pins(0, job, Memory(), nothing_committed, [], [], None) if "dense" in p.items]
