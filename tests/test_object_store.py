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

from megatron_pec.format.checkpoint_paths import storage_spec_for as spec_for
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import open_storage

pytestmark = pytest.mark.object_store


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


def test_the_object_store_benchmark_measures_each_path_against_its_floor(s3_server):
    """``benchmarks/object_store.py`` at a small size: every method measured, the bytes read back checked
    (it asserts), the report written (its own server: the session's profile is left as it was)."""
    from benchmarks import object_store

    config = os.environ["MSC_CONFIG"]
    seconds, e2e = object_store.measure(16, 1, log=lambda *_: None)
    assert os.environ["MSC_CONFIG"] == config and e2e is None
    summary = object_store.summarize(seconds, 16 << 20)
    assert set(summary["ratios"]) == {"persist / put floor", "restore / get floor"}
    assert all(v > 0 for v in summary["mb_per_s"].values())


# ---- the command line --------------------------------------------------------------------------------------
def megatron_pec(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_pec", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), **(env or {})))


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
    from test_state_parity import ITERATION, LOAD_SEED, SAVE_SEED, differences, report, run_dump

    from megatron_pec.testing import launch

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
    # export from the store (into a local directory, and into the store): the weights an export of a local
    # copy of the checkpoint writes
    local = tmp_path / "ck_local"
    download(d.storage, ckpt, local)
    for source, out in ((ckpt, str(tmp_path / "export_s3")), (ckpt, f"{s3_prefix}/export"),
                        (str(local), str(tmp_path / "export_local"))):
        proc = megatron_pec("export", source, out)
        assert proc.returncode == 0 and f"exported iteration {ITERATION}" in proc.stdout, proc.stdout + proc.stderr
    download(d.storage, f"{s3_prefix}/export", tmp_path / "export_in_s3")
    shards = sorted(p.name for p in (tmp_path / "export_local").glob("*.safetensors"))
    assert shards
    for where in ("export_s3", "export_in_s3"):
        assert sorted(p.name for p in (tmp_path / where).glob("*.safetensors")) == shards, where
        for name in shards:
            assert (tmp_path / where / name).read_bytes() == (tmp_path / "export_local" / name).read_bytes(), name


def download(storage, url: str, to: Path) -> None:
    """Every object under ``url`` into the directory ``to``, as a POSIX checkpoint directory."""
    to.mkdir(parents=True, exist_ok=True)
    for name in storage.list(url):
        if storage.list(f"{url}/{name}"):
            download(storage, f"{url}/{name}", to / name)
        else:
            (to / name).write_bytes(storage.read(f"{url}/{name}"))


@pytest.fixture
def own_s3(tmp_path):
    """An S3 server of this test alone (it kills and restarts it), with its MSC config file."""
    from megatron_pec.testing import s3_server

    why = s3_server.missing()
    if why:
        pytest.skip(f"no S3 server for the object-store tests: {why}")
    server = s3_server.S3Server(tmp_path / "s3data").start()
    server.config = server.msc_config(tmp_path / "msc.yaml", profile="pecown")
    yield server
    server.stop()


@pytest.mark.multiprocess
def test_two_nodes_on_s3_survive_a_node_loss_and_a_store_crash(own_s3, tmp_path, monkeypatch):
    """Two simulated nodes (the example trainer) with ``--save msc://...``, persisting every 2 iterations.
    Node 1 is lost: the relaunch restores it from node 0's memory. Then the S3 server is SIGKILLed and
    restarted on the same data and ports a few seconds later: training never stops (the persists that met
    the outage fail with a warning; node memory holds the state), the persists after the restart commit,
    no committed iteration is partial. With both nodes' memory gone, a relaunch restores from the store
    alone (bit-exact restores from the store: the single-node test above)."""
    from test_faults import FULL, LAUNCH_TIMEOUT, PRETRAIN, held, wait_held, with_flag

    from megatron_pec.testing.cluster import Cluster

    env = {"MSC_CONFIG": str(own_s3.config)}
    monkeypatch.setenv("MSC_CONFIG", env["MSC_CONFIG"])
    url, last = "msc://pecown/ck", 100  # (iterations take ~0.1 s: the store must come back before the end)
    shm = Path("/dev/shm") / f"pec-s3n-{os.getpid()}-{tmp_path.name[-12:]}"
    c = Cluster(tmp_path / "run", shm, "s3nodes", script=PRETRAIN, save=url, env=env)
    try:
        c.launch([*FULL, "--enable-msc"], **held(1, after=5))
        wait_held(c, 1)
        c.lose_node(1)
        assert c.wait_exit(60, nodes=[0])[0] != 0
        c.launch([*with_flag(FULL, "--train-iters", str(last)), "--enable-msc"])
        c.wait_for(lambda: c.iteration() >= 8, LAUNCH_TIMEOUT, "iteration 8")
        own_s3.kill()
        down_at = c.iteration()
        c.wait_for(lambda: c.iteration() >= down_at + 2, LAUNCH_TIMEOUT, "training on while the store is down")
        own_s3.start()
        restarted_at = c.iteration()
        assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
        restores = c.restores(2)
        assert restores[0].source == "memory" and restores[1].source == "peer memory (node 0)", restores
        d = wait_committed(url, last, timeout=LAUNCH_TIMEOUT)  # persists after the restart commit
        for node in (0, 1):  # every node's memory gone: the object store alone serves the next relaunch
            c.lose_node(node)
        c.launch([*with_flag(FULL, "--train-iters", str(last + 2)), "--enable-msc"])
        assert c.wait_exit(LAUNCH_TIMEOUT) == {0: 0, 1: 0}, c.logs()
        assert {r: (x.iteration, x.source) for r, x in c.restores(3).items()} == {0: (last, "storage"),
                                                                                   1: (last, "storage")}
    finally:
        c.close()
        shutil.rmtree(shm, ignore_errors=True)
    assert restarted_at < last, (restarted_at, "the store came back only after training ended")
    assert "was not persisted: StorageUnreachable" in c.logs(2), c.logs(2)[-3000:]  # (the outage, survived)
    assert d.read_tracker() == str(last + 2)  # (the relaunch from the store saved on to the end)
    proc = megatron_pec("verify", url, env=env)  # every committed iteration whole
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.multiprocess
def test_a_relaunch_while_the_store_is_down_restores_from_node_memory_and_never_from_scratch(own_s3, tmp_path,
                                                                                          monkeypatch):
    """The example trainer persisting every 2 iterations to S3 is killed in step 6 (committed: 2 and 4; node
    memory: 5). With the S3 server down, a relaunch restores 5 from node memory and trains on (its persists
    fail with a warning, nothing stops). With node memory gone too, a relaunch refuses plainly - never
    training from scratch over a store it cannot read - and changes nothing: once the server is back, the
    store holds what it held."""
    from megatron_pec.testing import launch

    shm = Path("/dev/shm") / f"pec-s3d-{os.getpid()}-{tmp_path.name[-12:]}"
    url = "msc://pecdown/ck"  # (a profile of its own: MSC keeps a client per profile name in this process)
    monkeypatch.setenv("MSC_CONFIG", str(own_s3.msc_config(tmp_path / "msc_down.yaml", profile="pecdown")))
    env = dict(os.environ)
    args = ["--hidden-size", "32", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--expert-model-parallel-size", "2", "--log-interval", "1", "--eval-iters", "1", "--save", url,
            "--load", url, "--enable-msc", "--save-interval", "2", "--non-persistent-save-interval", "1",
            "--pec-shm-dir", str(shm), "--pec-job-id", "s3down"]
    script = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"

    def run(iters: int, **extra_env) -> subprocess.CompletedProcess:
        job = launch.Launch(script, (*args, "--train-iters", str(iters)), nproc=2)
        return launch.run(job, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(env, **extra_env))

    try:
        killed = run(8, MEGATRON_PEC_FAULT="optimizer_step=kill@6")
        assert killed.returncode != 0
        d = CheckpointDir(url, open_storage(spec_for("", url)))
        before = (d.committed_iterations(), d.read_tracker())
        assert before[0] == [4, 2], before
        own_s3.kill()
        relaunch = run(8)
        out = relaunch.stdout + relaunch.stderr
        assert relaunch.returncode == 0, out[-4000:]
        for rank in (0, 1):
            assert f"rank {rank}: restored iteration 5 from memory" in out, out[-4000:]
        assert "cannot be reached" in out and "was not persisted: StorageUnreachable" in out, out[-4000:]
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)  # node memory gone too: only the store could serve
        refused = run(10)
        out = refused.stdout + refused.stderr
        assert refused.returncode != 0
        assert "cannot restore: node memory holds no snapshot every rank can restore, and the storage" in out, out
        assert "training from scratch" not in out and "rank0]: Traceback" not in out, out[-4000:]
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
        own_s3.start()
    assert (d.committed_iterations(), d.read_tracker()) == before


def test_an_msc_path_without_megatrons_msc_is_refused_with_the_flag_to_pass():
    """core_v0.19.0 makes Megatron's MSC opt-in (--enable-msc); 0.16.1 has it on unless --disable-msc."""
    from types import SimpleNamespace

    from megatron_pec.config import PecConfig

    assert PecConfig.storage_spec(SimpleNamespace(save="msc://p/ck", load=None, enable_msc=True)) == "msc://p"
    assert PecConfig.storage_spec(SimpleNamespace(save="msc://p/ck", load=None)) == "msc://p"  # (no such flag)
    with pytest.raises(ValueError, match="pass --enable-msc"):
        PecConfig.storage_spec(SimpleNamespace(save="msc://p/ck", load=None, enable_msc=False))
    assert PecConfig.storage_spec(SimpleNamespace(save="/ck", load=None, enable_msc=False)) == ""
