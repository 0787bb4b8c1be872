"""Node memory's history (``memory/history.py``): which region of which slot holds which version, and
what may be restored - timelines included. Real slot files in a temporary directory; no agent, no
Megatron."""

import pytest
import torch

from megatron_pec.format.protocol import SlotHeader
from megatron_pec.format.stformat import layout
from megatron_pec.memory.history import NO_HOME, JobKey, NodeMemory
from megatron_pec.memory.slot_map import POOL as P
from megatron_pec.memory.slot_map import SlotMap
from megatron_pec.memory.slots import SlotFiles

pytestmark = pytest.mark.megatron_free

ENTRIES = layout([("dense/w.param", torch.float32, 16), ("L1.E0/w.param", torch.float32, 8),
                  ("L1.E1/w.param", torch.float32, 8)])
JOB = JobKey("job", "cfg", "/ckpt")
ALL = ("dense", "L1.E0", "L1.E1")


@pytest.fixture
def memory(tmp_path):
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(ENTRIES, 4), 1)  # home slots 0, 1; pool slots P to P + 3
    yield files, NodeMemory(str(tmp_path))
    files.close()


def fill(files, memory, home, iteration, run, written=ALL, places=None, stale=None, job=JOB):
    """A complete snapshot with its header and dense state in ``home`` and each expert in the pool region
    ``places`` names, recorded as the agent records it."""
    header = SlotHeader(job_id=job.job_id, fingerprint=job.fingerprint, save=job.save, rank=0, world_size=1,
                        iteration=iteration, items=dict.fromkeys(written, iteration),
                        tokens={i: 10 * iteration for i in written if i != "dense"}, small="{}", pec="{}", run=run,
                        sums={i: f"s64:{iteration:032x}" for i in written})
    files.write_header(home, header.to_metadata())
    memory.record_snapshot(0, home, header, dict(header.sums), places or {}, stale or {}, job)


def restorable_homes(memory, job=JOB):
    found, _ = memory.restorable(0, job)
    return [record.iteration for _, _, record, header in found if header is not None]


def newest(memory, upto=None):
    return {i: v for i, (_, v) in memory.regions(0, upto).items()}


def test_regions_keep_each_items_newest_version_across_slots(memory):
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 1, "a", places={"L1.E0": P, "L1.E1": P + 1})
    fill(files, mem, 1, 2, "a", written=("dense", "L1.E0"), places={"L1.E0": P + 2})
    fill(files, mem, 0, 3, "a", written=("dense", "L1.E1"), places={"L1.E1": P + 3})
    assert newest(mem) == {"dense": 3, "L1.E0": 2, "L1.E1": 3}
    assert mem.regions(0)["L1.E1"] == (P + 3, 3)                  # its pool region
    assert newest(mem, upto=2) == {"dense": 2, "L1.E0": 2, "L1.E1": 1}
    view = mem.view(0, 3)
    assert view.items == {"dense": 3, "L1.E0": 2, "L1.E1": 3} and view.tokens == {"L1.E0": 20, "L1.E1": 30}
    assert mem.view_places(0, 3) == (0, {"L1.E0": P + 2, "L1.E1": P + 3})
    # a pool region holds one expert at a time: region P's E0 of 1 goes when E1 of 4 lands there
    fill(files, mem, 1, 4, "a", written=("dense", "L1.E1"), places={"L1.E1": P})
    assert mem.slots[0][P].items == {"L1.E1": 4} and newest(mem) == {"dense": 4, "L1.E0": 2, "L1.E1": 4}
    assert newest(mem, upto=1) == {"L1.E1": 1}                 # (1's dense went with its home, its E0 with region 2)
    assert restorable_homes(mem) == [4, 3]


def test_a_snapshot_of_an_abandoned_timeline_is_never_restored_whatever_the_reuse_order(memory):
    """Run a wrote 10, 15, 20; the restart restored 15 and run b wrote 16 into the home of 20. Region reuse
    left 20's E1 in place - it must never be restored, nor count as the newest, nor survive the agent's
    restart."""
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 10, "a", places={"L1.E0": P, "L1.E1": P + 1})
    fill(files, mem, 1, 15, "a", places={"L1.E0": P + 2, "L1.E1": P + 3})
    fill(files, mem, 0, 20, "a", places={"L1.E0": P, "L1.E1": P + 1})
    assert restorable_homes(mem) == [20, 15]
    mem.begin(0, "b", 15, JOB)
    assert restorable_homes(mem) == [15] and newest(mem) == dict.fromkeys(ALL, 15)
    assert mem.newest(0)[0] == 1
    fill(files, mem, 0, 16, "b", written=("dense", "L1.E0"), places={"L1.E0": P})
    assert restorable_homes(mem) == [16, 15] and newest(mem) == {"dense": 16, "L1.E0": 16, "L1.E1": 15}
    assert mem.is_restorable(0, P + 1, JOB) == "holds no complete snapshot and no recorded region"
    mem.write()
    again = NodeMemory.read(mem.directory)                     # what a restarted agent reads
    assert restorable_homes(again) == [16, 15] and newest(again) == newest(mem)
    own = NodeMemory.read(mem.directory, 0)                    # what a restore reads: its rank's part only
    assert restorable_homes(own) == [16, 15] and set(own.slots) == {0}
    mem.begin(0, "b", 15, JOB)                                 # a reconnect repeats Begin: nothing changes
    assert restorable_homes(mem) == [16, 15]
    mem.begin(0, "c", 15, JOB)                                 # run c restored 15 again (say 16 was corrupt)
    assert restorable_homes(mem) == [15]
    mem.begin(0, "d", None, JOB)                               # from scratch: nothing of before
    assert restorable_homes(mem) == [] and newest(mem) == {}


def test_the_lineage_keeps_only_runs_that_hold_something(memory):
    """Restarts that restore and die before their first snapshot leave no segment behind: the lineage
    (read by every restore) holds the runs whose regions are still recorded, and the current one."""
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 5, "a", places={"L1.E0": P, "L1.E1": P + 1})
    for run in "bcdef":
        mem.begin(0, run, 5, JOB)
    assert [s.run for s in mem.lineage[0]] == ["a", "f"] and restorable_homes(mem) == [5]
    fill(files, mem, 1, 6, "f", written=("dense",))
    mem.begin(0, "g", 6, JOB)
    assert [s.run for s in mem.lineage[0]] == ["a", "f", "g"]
    assert newest(mem) == {"dense": 6, "L1.E0": 5, "L1.E1": 5}


def test_regions_of_an_older_run_keep_their_run_when_a_newer_one_takes_the_home(memory):
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 5, "a", places={"L1.E0": P, "L1.E1": P + 1})
    mem.begin(0, "b", 5, JOB)
    fill(files, mem, 1, 6, "b", written=("dense",))           # b's snapshot: a's experts stay a's
    assert mem.slots[0][1].run == "b" and mem.slots[0][P].run_of("L1.E0") == "a"
    assert newest(mem) == {"dense": 6, "L1.E0": 5, "L1.E1": 5}
    mem.begin(0, "c", 4, JOB)                                  # back before 5: a's 5 is abandoned too
    assert newest(mem) == {}


def test_stale_regions_are_forgotten_and_the_slot_checked_itself(memory):
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 4, "a", places={"L1.E0": P, "L1.E1": P + 1})
    fill(files, mem, 1, 5, "a", places={"L1.E0": P + 2, "L1.E1": P + 3})
    files.invalidate(1)                                        # a trainer killed mid-copy of iteration 6
    assert restorable_homes(mem) == [4]
    found, _ = mem.restorable(0, JOB)
    assert [r.iteration for _, _, r, _ in found] == [4] + [NO_HOME] * 4  # (the pool regions may still serve)
    fill(files, mem, 0, 7, "a", written=("dense",), stale={"dense": [1], "L1.E0": [P + 2]})
    assert P + 2 not in mem.slots[0] and mem.slots[0][P + 3].items == {"L1.E1": 5}
    assert mem.slots[0][1].items == {}
    assert mem.is_restorable(0, 0, JobKey("job", "cfg", "/elsewhere")).startswith("belongs to job")


def test_another_job_or_configuration_starts_from_nothing(memory):
    files, mem = memory
    mem.begin(0, "a", None, JOB)
    fill(files, mem, 0, 4, "a")
    other = JobKey("job", "other-cfg", "/ckpt")
    _, foreign = mem.restorable(0, other)
    assert len(foreign) == 1 and "belongs to job 'job' with configuration cfg" in foreign[0]
    mem.begin(0, "b", None, other)
    assert mem.slots.get(0) is None and restorable_homes(mem, other) == []


def test_an_unreadable_index_means_nothing_is_restorable(tmp_path):
    (tmp_path / "slots.json").write_text('{"type": "memory-index", "v": 99}')
    assert NodeMemory.read(str(tmp_path)).slots == {}
    (tmp_path / "slots.json").write_text("{torn")
    assert NodeMemory.read(str(tmp_path)).slots == {}
