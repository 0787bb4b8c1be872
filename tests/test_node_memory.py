"""Node memory's history (``agent/memory.py``): which slots the trainer may overwrite, and which may be
restored - timelines included. Real slot files in a temporary directory; no agent, no Megatron."""

import pytest
import torch

from megatron_pec.agent.memory import JobKey, NodeMemory
from megatron_pec.protocol import SlotHeader, SlotRecord
from megatron_pec.slots import SlotFiles, SlotGrants
from megatron_pec.stformat import layout

ENTRIES = layout([("dense/w.param", torch.float32, 16), ("L1.E0/w.param", torch.float32, 8)])
JOB = JobKey("job", "cfg", "/ckpt")


@pytest.fixture
def memory(tmp_path):
    files = SlotFiles(str(tmp_path), 0, ENTRIES, 1)
    yield files, NodeMemory(str(tmp_path))
    files.close()


def fill(files, memory, slot, iteration, run, job=JOB):
    """A complete snapshot in ``slot``, recorded as the agent records it."""
    header = SlotHeader(job_id=job.job_id, fingerprint=job.fingerprint, save=job.save, rank=0, world_size=1,
                        iteration=iteration, items={"dense": iteration, "L1.E0": iteration},
                        tokens={"L1.E0": iteration}, small="{}", pec="{}", run=run)
    files.write_header(slot, header.to_metadata())
    memory.record(0, slot, SlotRecord(iteration, run, dict(header.items), {"dense": 0, "L1.E0": 0}))


def restorable_iterations(memory, job=JOB):
    found, _ = memory.restorable(0, job)
    return [record.iteration for _, record, _ in found]


def test_grants_never_the_newest_snapshot_nor_busy_slots(memory):
    files, mem = memory
    mem.begin(0, "a", None)
    assert mem.grantable(0, busy=set()) == [0, 1, 2]
    fill(files, mem, 0, 1, "a")
    assert mem.grantable(0, busy={1}) == [2]          # slot 0 holds the newest snapshot; 1 is being read
    fill(files, mem, 1, 2, "a")
    assert mem.grantable(0, busy=set()) == [2, 0]     # empty first, then the oldest snapshot
    fill(files, mem, 2, 3, "a")
    assert mem.grantable(0, busy={0}) == [1]
    assert mem.grantable(0, busy={0, 1}) == []        # nothing free: the snapshot is skipped, never torn


def test_a_snapshot_of_an_abandoned_timeline_is_never_restored_whatever_the_reuse_order(memory):
    """Run a wrote 10, 15, 20; the restart restored 10 (say another rank lacked 15 and 20) and run b
    wrote 12 into the slot of 15. Slot reuse order left 20 in place - it must still never be restored,
    nor count as the newest snapshot to keep, nor survive the agent's restart."""
    files, mem = memory
    mem.begin(0, "a", None)
    for slot, iteration in enumerate((10, 15, 20)):
        fill(files, mem, slot, iteration, "a")
    assert restorable_iterations(mem) == [20, 15, 10]
    mem.begin(0, "b", 10)
    assert restorable_iterations(mem) == [10]
    assert mem.newest(0)[0] == 0                       # slot 0 (iteration 10) is now the one to keep
    assert mem.grantable(0, busy=set()) == [1, 2]      # abandoned slots are handed out, 10's is not
    mem.forget(0, 1)
    fill(files, mem, 1, 12, "b")                       # run b reuses 15's slot, not 20's
    assert restorable_iterations(mem) == [12, 10]
    verdict = mem.is_restorable(0, 2, JOB)
    assert verdict == "holds iteration 20 of an abandoned timeline (run a)"
    mem.write()
    again = NodeMemory.read(mem.directory)             # what a restarted agent or a restore reads
    assert restorable_iterations(again) == [12, 10]
    mem.begin(0, "b", 10)                              # a reconnect repeats Begin: nothing changes
    assert restorable_iterations(mem) == [12, 10]
    mem.begin(0, "c", 11)                              # run c restored 10 again (say 12 was corrupt)
    assert restorable_iterations(mem) == [10]
    mem.begin(0, "d", None)                            # from scratch: nothing of before
    assert restorable_iterations(mem) == []


def test_restorable_checks_the_slot_itself_and_the_job(memory):
    files, mem = memory
    mem.begin(0, "a", None)
    fill(files, mem, 0, 4, "a")
    fill(files, mem, 1, 5, "a", job=JobKey("other", "cfg", "/ckpt"))
    fill(files, mem, 2, 6, "a")
    files.invalidate(2)                                # a trainer killed mid-copy of iteration 7
    found, foreign = mem.restorable(0, JOB)
    assert [r.iteration for _, r, _ in found] == [4]
    assert len(foreign) == 1 and "belongs to job 'other'" in foreign[0]
    assert "the snapshot is incomplete" in mem.is_restorable(0, 2, JOB)
    assert mem.is_restorable(0, 2, None) != mem.is_restorable(0, 0, None)
    fill(files, mem, 2, 6, "a")
    mem.record(0, 2, SlotRecord(7, "a", {}, {}))       # the record says 7, the slot holds 6
    assert "holds iteration 6 of run a, not iteration 7 of run a" in mem.is_restorable(0, 2, JOB)
    assert restorable_iterations(mem, JobKey("job", "cfg", "/elsewhere")) == []


def test_an_unreadable_index_means_nothing_is_restorable(tmp_path):
    (tmp_path / "slots.json").write_text('{"type": "memory-index", "v": 99}')
    assert NodeMemory.read(str(tmp_path)).slots == {}
    (tmp_path / "slots.json").write_text("{torn")
    assert NodeMemory.read(str(tmp_path)).slots == {}


def test_trainer_grants_are_used_in_order_and_dropped_with_the_agent():
    grants = SlotGrants()
    assert grants.take() is None
    grants.add([2, 0])
    grants.add([0, 1])
    assert [grants.take(), grants.take(), grants.take(), grants.take()] == [2, 0, 1, None]
    grants.add([1])
    grants.revoke_all()
    assert grants.take() is None
