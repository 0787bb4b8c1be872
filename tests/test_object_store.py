"""Checkpoints on a real S3 object store (SeaweedFS) through Megatron's storage client, the Multi-Storage
Client (``store/msc_storage.py``, paths ``msc://<profile>/<path>``): the storage protocol as
``PosixStorage`` keeps it (tests/test_storage.py), retention, the command line, and the example trainer
saving to and restoring from the store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy
import pytest

from conftest import REPO
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import open_storage, spec_for


@pytest.fixture
def s(s3_prefix):
    return open_storage(spec_for("", s3_prefix))


# ---- the storage protocol on S3 -------------------------------------------------------------------------
def test_an_msc_url_selects_the_msc_storage(s3_prefix):
    from megatron_pec.store.msc_storage import MscStorage

    assert spec_for("", s3_prefix) == "msc://pectest" and spec_for("posix", s3_prefix) == "posix"
    assert spec_for("", "/tmp/x", None) == ""
    assert isinstance(open_storage("msc://pectest"), MscStorage)
    with pytest.raises(ValueError, match="no usable profile 'nowhere'.*MSC_CONFIG"):
        open_storage("msc://nowhere/ck")


def test_a_commit_replaces_only_what_the_committer_read(s, s3_prefix):
    path = f"{s3_prefix}/d/manifest.json"
    assert s.commit(path, b"one", expected=None)             # a conditional create (If-None-Match: *)
    assert not s.commit(path, b"two", expected=None)         # it exists: another writer won
    assert not s.commit(path, b"two", expected=b"other")     # it holds something else
    assert s.read(path) == b"one"
    assert s.commit(path, b"two", expected=b"one")           # (If-Match: the ETag of what was read)
    assert s.read(path) == b"two"
    assert s.list(f"{s3_prefix}/d") == ["manifest.json"]


def test_create_writes_a_record_once(s, s3_prefix):
    path = f"{s3_prefix}/layout/rank_00000.json"
    assert s.create(path, b"first") and not s.create(path, b"second")
    assert s.read(path) == b"first"


def test_a_streamed_write_is_summed_as_sent_and_read_back_whole_or_in_ranges(s, s3_prefix, monkeypatch):
    """Several parts (a multipart upload, parts in flight together) from chunks whose bytes change as
    soon as the next is asked for: the object and its crc32 are what each chunk held when handed over."""
    from megatron_pec.store import msc_storage

    monkeypatch.setattr(msc_storage, "PART", 5 << 20)  # (S3's smallest part)
    data = numpy.random.default_rng(0).integers(0, 256, (13 << 20) + 12345, dtype=numpy.uint8).tobytes()
    buf = bytearray(3 << 20)

    def chunks():
        for start in range(0, len(data), len(buf)):
            piece = data[start:start + len(buf)]
            buf[:len(piece)] = piece
            yield memoryview(buf)[:len(piece)]
            buf[:] = b"\xff" * len(buf)  # the region is handed back and reused

    path = f"{s3_prefix}/iter/pec/rank_00000.safetensors"
    assert s.write(path, chunks()) == (len(data), zlib.crc32(data))
    got, crc = s.read_checked(path)
    assert bytes(got) == data and crc == zlib.crc32(data) and not got.readonly
    assert s.size(path) == len(data) and s.exists(path) and s.exists(f"{s3_prefix}/iter")
    assert s.read_range(path, (5 << 20) - 3, 10) == data[(5 << 20) - 3:(5 << 20) + 7]
    with pytest.raises(OSError):
        s.read_range(path, len(data) - 4, 8)
    with pytest.raises(FileNotFoundError):
        s.read(f"{s3_prefix}/nothing")
    assert not s.exists(f"{s3_prefix}/nothing")


def test_a_failed_write_leaves_nothing_under_its_name(s, s3_prefix, monkeypatch):
    from megatron_pec.store import msc_storage

    monkeypatch.setattr(msc_storage, "PART", 5 << 20)

    def chunks():
        yield bytes(6 << 20)  # one part uploaded...
        raise OSError("the node memory went away")

    path = f"{s3_prefix}/pec/rank_00001.safetensors"
    with pytest.raises(OSError, match="went away"):
        s.write(path, chunks())
    assert not s.exists(path) and s.list(f"{s3_prefix}/pec") == []
    assert s.discard_partial(f"{s3_prefix}/pec", live_too=True) == []  # (the upload was aborted)


def test_list_names_objects_and_prefixes_directly_under(s, s3_prefix):
    for name in ("a", "sub/b", "sub/deeper/c", "subway"):
        s.write(f"{s3_prefix}/{name}", [b"x"])
    assert s.list(s3_prefix) == ["a", "sub", "subway"] == s.list(s3_prefix + "/")
    assert s.list(f"{s3_prefix}/sub") == ["b", "deeper"]
    assert s.list(f"{s3_prefix}/none") == []


def test_a_prefix_goes_whole_and_a_missing_one_is_no_error(s, s3_prefix):
    s.write(f"{s3_prefix}/iter/pec/a", [b"x"])
    s.write(f"{s3_prefix}/iter/b", [b"y"])
    s.write(f"{s3_prefix}/iter2/c", [b"z"])  # (a sibling whose name the prefix begins: kept)
    s.delete_prefix(f"{s3_prefix}/iter")
    s.delete_prefix(f"{s3_prefix}/iter")
    s.delete(f"{s3_prefix}/nothing")
    assert s.list(s3_prefix) == ["iter2"] and s.list(f"{s3_prefix}/iter") == []


def test_retention_on_s3_keeps_the_configured_number_of_iterations(s, s3_prefix):
    from test_checkpoint_dir import mark

    d = CheckpointDir(s3_prefix, s)
    assert d.root == s3_prefix  # (a URL stays a URL)
    for iteration in (10, 20, 30, 40):
        mark(d, iteration, 0)
        assert d.try_commit(iteration, num_nodes=1, keep=2, generation="g")
    assert d.committed_iterations() == [40, 30] and d.read_tracker() == "40"
    assert s.list(s3_prefix) == ["iter_0000030", "iter_0000040", "latest_checkpointed_iteration.txt"]


# ---- the command line --------------------------------------------------------------------------------------
def megatron_pec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pec", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_the_commands_refuse_an_unknown_profile_plainly(s3_server):
    proc = megatron_pec("verify", "msc://nowhere/ck")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "'nowhere'" in proc.stderr and "MSC_CONFIG" in proc.stderr


# ---- the example trainer on the object store -----------------------------------------------------------------
def wait_committed(url: str, iteration: int, timeout: float = 120.0) -> CheckpointDir:
    """The checkpoint directory ``url`` once ``iteration`` is committed there (the agents persist after the
    trainers exit)."""
    import time

    d = CheckpointDir(url, open_storage(spec_for("", url)))
    deadline = time.monotonic() + timeout
    while iteration not in d.committed_iterations():
        assert time.monotonic() < deadline, f"iteration {iteration} not committed in {url}: {d.storage.list(url)}"
        time.sleep(0.2)
    return d


@pytest.mark.multiprocess
def test_the_example_trainer_saves_to_s3_and_restores_from_it_alone(s3_prefix, tmp_path):
    """examples/gpt_moe/pretrain_gpt_moe.py on 2 CPU ranks with ``--save/--load msc://...`` (no
    --pec-storage): it trains 3 iterations and persists them to the object store; with node memory gone, a
    fresh run restores iteration 3 from the store alone, equal item by item to its live state at the save;
    ``verify`` and ``inspect`` read the store."""
    from megatron_pec.testing import launch
    from test_state_parity import ITERATION, LOAD_SEED, SAVE_SEED, differences, report, run_dump

    shm = Path("/dev/shm") / f"pec-s3-{os.getpid()}-{tmp_path.name[-12:]}"
    ckpt = f"{s3_prefix}/ck"
    args = ["--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--expert-model-parallel-size", "2", "--log-interval", "100", "--eval-iters", "1", "--hidden-dropout",
            "0.1", "--train-iters", str(ITERATION), "--save", ckpt, "--load", ckpt, "--enable-msc",
            "--save-interval", str(ITERATION), "--pec-shm-dir", str(shm), "--pec-job-id", "s3ex"]
    script = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
    try:
        run_dump(script, *args, dump=tmp_path / "live", seed=SAVE_SEED, at=f"save:{ITERATION}")
        d = wait_committed(ckpt, ITERATION)
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)  # node memory gone: the store alone
        log = run_dump(script, *args, dump=tmp_path / "restored", seed=LOAD_SEED)
        assert f"restored iteration {ITERATION} from storage" in log, log[-3000:]
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    ignore = {"args/iteration": "", "args/num_floating_point_operations_so_far": ""}
    found = differences(tmp_path / "live", tmp_path / "restored", None, ignore, {})
    assert not found, report(found, "the example trainer's restore from S3 against its state at the save")
    assert d.read_tracker() == str(ITERATION)
    for command in ("verify", "inspect"):
        proc = megatron_pec(command, ckpt)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
