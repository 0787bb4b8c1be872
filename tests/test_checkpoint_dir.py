"""The checkpoint directory on its own, behind the storage seam: commit, validity and retirement with
a storage that fails where a test says (no agent, no torch)."""

import errno

import pytest

from megatron_pec.format.protocol import NodeMarker, RankFile
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import PosixStorage

pytestmark = pytest.mark.megatron_free


class FullStorage(PosixStorage):
    """POSIX storage on which a write of an object named ``*<failing>`` runs out of space."""

    def __init__(self, failing: str):
        self.failing = failing

    def write(self, path, chunks):
        if path.endswith(self.failing):
            raise OSError(errno.ENOSPC, "no space left (injected)", path)
        return super().write(path, chunks)


def mark(checkpoints: CheckpointDir, iteration: int, node: int, generation: str = "g") -> None:
    rank = RankFile(file=checkpoints.relative(checkpoints.rank_file(iteration, node)), size=8, crc32=0,
                    items=["dense", f"L1.E{node}"], header_crc32=0)
    checkpoints.write_node_marker(NodeMarker(iteration=iteration, node=node, job_id="j", fingerprint="f",
                                             topology={"dp": 2}, ranks={str(node): rank}, generation=generation))


def test_an_iteration_commits_once_every_node_marked_it(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), PosixStorage())
    mark(checkpoints, 10, 0)
    assert not checkpoints.try_commit(10, num_nodes=2, keep=0, generation="g")
    mark(checkpoints, 10, 1)
    assert checkpoints.try_commit(10, num_nodes=2, keep=0, generation="g")
    assert checkpoints.committed_iterations() == [10] and checkpoints.read_tracker() == "10"
    assert checkpoints.read_manifest(10).experts == {"L1.E0": 10, "L1.E1": 10}


def test_a_manifest_that_cannot_be_written_commits_nothing(tmp_path):
    full = CheckpointDir(str(tmp_path), FullStorage("manifest.json"))
    mark(full, 10, 0)
    with pytest.raises(OSError, match="no space left"):
        full.try_commit(10, num_nodes=1, keep=0, generation="g")
    assert full.committed_iterations() == [] and full.read_tracker() is None
    assert not list(tmp_path.rglob("*.tmp*"))  # nothing partial left behind either


def test_retiring_removes_what_an_abandoned_run_committed_after_the_restored_iteration(tmp_path):
    checkpoints = CheckpointDir(str(tmp_path), PosixStorage())
    for iteration in (10, 20):
        mark(checkpoints, iteration, 0)
        assert checkpoints.try_commit(iteration, num_nodes=1, keep=0, generation="g")
    mark(checkpoints, 30, 0)  # a marker of a save that never committed
    assert checkpoints.retire_after(10) == [20, 30]
    assert checkpoints.committed_iterations() == [10] and checkpoints.read_tracker() == "10"
    assert checkpoints.node_markers(20) == checkpoints.node_markers(30) == []


def test_an_atomic_write_sums_each_chunk_before_the_next_is_asked_for(tmp_path, monkeypatch):
    """A persist hands each item's node-memory region back once written: a region overwritten right
    after (as a snapshot would) must not change the file's recorded crc32, however far the summing
    thread lags behind the writes (here: slowed down)."""
    import time
    import zlib

    from megatron_pec.store import storage

    def slow_crc32(data, value=0):
        time.sleep(0.05)
        return zlib.crc32(data, value)

    monkeypatch.setattr(storage, "crc32", slow_crc32)
    regions = [bytearray(range(256)) * (32 << 10) for _ in range(6)]  # 8 MiB each

    def chunks():
        for region in regions:
            yield memoryview(region)
            region[:] = bytes(len(region))  # handed back: the trainer writes over it at once

    size, crc = PosixStorage().write(str(tmp_path / "rank.safetensors"), chunks())
    written = (tmp_path / "rank.safetensors").read_bytes()
    assert size == len(written) and crc == zlib.crc32(written)
