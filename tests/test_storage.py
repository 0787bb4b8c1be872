"""The storage seam (``store/storage.py``): what ``PosixStorage`` promises behind the object-shaped
protocol (commit as a compare-and-swap, create once, partial writes its own business, a file fetched ahead
into the page cache), how a storage is built from its description, that the job's storage reaches the
node agent, and that nothing in the package writes a checkpoint file around the seam."""

import ast
import ctypes
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, checkpoints

from megatron_pec.common.errors import StorageUnreachable
from megatron_pec.store import storage as storage_module
from megatron_pec.store.storage import PosixStorage, open_storage, register_scheme
from megatron_pec.testing.recording_storage import RecordingStorage, read_log

PACKAGE = REPO / "megatron_pec"


# ---- PosixStorage behind the protocol ----------------------------------------------------------------
def test_a_commit_replaces_only_what_the_committer_read(tmp_path):
    s, path = PosixStorage(), str(tmp_path / "d" / "manifest.json")
    assert s.commit(path, b"one", expected=None)             # a conditional create
    assert not s.commit(path, b"two", expected=None)         # it exists: another writer won
    assert not s.commit(path, b"two", expected=b"other")     # it holds something else
    assert s.read(path) == b"one"
    assert s.commit(path, b"two", expected=b"one")
    assert s.read(path) == b"two"
    assert s.list(str(tmp_path / "d")) == ["manifest.json"]  # (the lock is the storage's own: not listed)


def test_create_writes_a_record_once(tmp_path):
    s, path = PosixStorage(), str(tmp_path / "layout" / "rank_00000.json")
    assert s.create(path, b"first") and not s.create(path, b"second")
    assert s.read(path) == b"first"


def test_partial_writes_are_the_storages_question(tmp_path):
    """A dead writer's leftovers are found and removed by the storage, a live writer's only when asked;
    neither is ever listed."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    s = PosixStorage()
    (tmp_path / f"rank_00000.safetensors.tmp{dead.pid}").write_bytes(b"half")
    (tmp_path / f"rank_00001.safetensors.tmp{os.getpid()}").write_bytes(b"being written")
    (tmp_path / "rank_00002.safetensors").write_bytes(b"whole")
    assert s.list(str(tmp_path)) == ["rank_00002.safetensors"]
    assert s.discard_partial(str(tmp_path), live_too=False) == ["rank_00000.safetensors"]
    assert s.discard_partial(str(tmp_path), live_too=True) == ["rank_00001.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["rank_00002.safetensors"]


def test_a_prefix_goes_whole_and_a_missing_one_is_no_error(tmp_path):
    s = PosixStorage()
    s.write(str(tmp_path / "iter" / "pec" / "a"), [b"x"])
    s.delete_prefix(str(tmp_path / "iter"))
    s.delete_prefix(str(tmp_path / "iter"))
    s.delete(str(tmp_path / "nothing"))
    assert s.list(str(tmp_path)) == [] and s.list(str(tmp_path / "iter")) == []


# ---- a file fetched ahead (a restore reads it once the ranks agreed) -----------------------------------
def _cached_fraction(path) -> float:
    """The share of ``path``'s pages in the page cache (mincore over a private mapping of it)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    resident = (ctypes.c_ubyte * pages)()
    start = ctypes.c_char.from_buffer(mapping)
    try:
        failed = ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(ctypes.addressof(start)),
                                                          ctypes.c_size_t(size), resident)
    finally:
        del start
        mapping.close()
    assert not failed, os.strerror(ctypes.get_errno())
    return sum(page & 1 for page in resident) / pages


def test_a_file_fetched_ahead_comes_into_the_page_cache(tmp_path):
    path = tmp_path / "rank.safetensors"
    path.write_bytes(os.urandom(32 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached_fraction(path) > 0.5:
        pytest.skip(f"{tmp_path}'s file system keeps its files in memory (tmpfs?): nothing to fetch ahead")
    PosixStorage().prefetch(str(path))  # (returns at once: a thread asks the kernel)
    deadline = time.monotonic() + 20
    while _cached_fraction(path) < 0.99 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cached_fraction(path) >= 0.99


# ---- a storage from its description ------------------------------------------------------------------
def test_a_storage_is_built_from_its_description(tmp_path, monkeypatch):
    assert type(open_storage("")) is PosixStorage and open_storage("posix").spec == "posix"
    spec = f"megatron_pec.testing.recording_storage:RecordingStorage?{tmp_path / 'log'}"
    recording = open_storage(spec)
    assert isinstance(recording, RecordingStorage) and recording.spec == spec
    monkeypatch.setattr(storage_module, "SCHEMES", {})
    register_scheme("mem", lambda spec: RecordingStorage(f"x:y?{tmp_path / 'mem.log'}"))
    assert isinstance(open_storage("mem://bucket/prefix"), RecordingStorage)
    for bad, why in (("s3://bucket", "no storage for the scheme 's3'"), ("nothing", "give 'posix'"),
                     ("megatron_pec.nowhere:X", "cannot import")):
        with pytest.raises(ValueError, match=why):
            open_storage(bad)


def test_the_checkpoint_directory_writes_only_through_its_storage(tmp_path):
    """Commit, retention and retirement of a checkpoint directory, on a recording storage: every file
    that appears was written through it."""
    from test_checkpoint_dir import mark

    from megatron_pec.store.checkpoint_dir import CheckpointDir

    log = tmp_path / "log"
    d = CheckpointDir(str(tmp_path / "ckpt"), RecordingStorage(f"x:y?{log}"))
    for iteration in (10, 20, 30):
        mark(d, iteration, 0)
        assert d.try_commit(iteration, num_nodes=1, keep=1, generation="g")
    assert d.committed_iterations() == [30] and d.read_tracker() == "30"
    assert d.retire_after(20) == [30] and d.read_tracker() is None  # (20 went by retention)
    written = {r["path"] for r in read_log(log) if r["op"] in ("write", "commit", "create")}
    on_disk = {str(p) for p in (tmp_path / "ckpt").rglob("*") if p.is_file() and p.name != ".pec.lock"}
    assert on_disk <= written


# ---- the job's storage reaches the node agent ----------------------------------------------------------
def test_the_agent_persists_and_commits_through_the_trainers_storage(shm_dir, tmp_path):
    """The trainer names its storage in the job description; the agent - another process - rebuilds it
    and writes every rank file, node marker, manifest and the tracker through it."""
    import torch

    from megatron_pec.agent.client import agent_pid
    from megatron_pec.format.protocol import Flush, Flushed
    from megatron_pec.format.stformat import layout
    from megatron_pec.memory.slots import node_dir
    from megatron_pec.testing.scripted import ScriptedTrainer

    entries = layout([("dense/w.param", torch.float32, 256)]
                     + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(2) for k in ("param", "exp_avg")])
    log = tmp_path / "storage.log"
    spec = f"megatron_pec.testing.recording_storage:RecordingStorage?{log}"
    root = str(tmp_path / "ckpt")
    t = ScriptedTrainer(node_dir(shm_dir, "t", 0), 0, root, entries, ("dense", "L1.E0", "L1.E1"), nodes=1, keep=1,
                        storage=spec)
    try:
        for iteration in (10, 20):
            assert t.snapshot(iteration)[1].error is None
        t.client.request(Flush(), Flushed, timeout=30)  # (retention runs in the agent's purge thread)
        agent = agent_pid(t.directory)
    finally:
        t.close()
    assert checkpoints(root).committed_iterations() == [20]
    by_agent = [r for r in read_log(log) if r["pid"] == agent]
    c = checkpoints(root)
    written = {r["path"] for r in by_agent if r["op"] == "write"}
    assert {c.rank_file(20, 0), c.node_marker(20, 0), c.manifest_path(20), c.tracker_path} <= written
    assert {(r["path"], r["committed"]) for r in by_agent if r["op"] == "commit"} >= {
        (c.manifest_path(20), True), (c.tracker_path, True)}
    assert any(r["op"] == "delete_prefix" and r["path"] == c.pec_dir(10) for r in by_agent)  # retention too
    assert agent != os.getpid()


@pytest.mark.multiprocess
def test_the_trainers_storage_flag_reaches_the_agent(tmp_path):
    """``--pec-storage`` on a real training job (torchrun, 2 ranks, the example's model): the trainers
    write their layout records through the storage it names, and the node agent - started by a
    trainer, a process of its own - every rank file, marker, manifest and the tracker."""
    import shutil
    import uuid

    from conftest import torchrun

    from megatron_pec.testing import launch

    log = tmp_path / "storage.log"
    save, shm = tmp_path / "ckpt", Path("/dev/shm") / f"pec-test-{uuid.uuid4().hex[:8]}"
    try:
        torchrun("export_state.py", str(save), str(shm), "--pec-storage",
                 f"megatron_pec.testing.recording_storage:RecordingStorage?{log}", env={"PEC_TEST_OUT": str(tmp_path)})
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)
    records, c = read_log(log), checkpoints(save)
    assert c.committed_iterations() == [4]
    trainers = {r["pid"] for r in records if r["op"] == "create"}  # the layout records, one per rank
    assert len(trainers) == 2
    by_agent = {r["path"] for r in records if r["pid"] not in trainers and r["op"] in ("write", "commit")}
    assert {c.rank_file(4, 0), c.rank_file(4, 1), c.node_marker(4, 0), c.manifest_path(4), c.tracker_path} <= by_agent
    on_disk = {str(p) for p in save.rglob("*") if p.is_file() and p.name != ".pec.lock"}
    assert on_disk <= {r["path"] for r in records}, "a file written around the storage"


# ---- nothing writes a checkpoint file around the seam --------------------------------------------------
# file -> why it may write files itself
AROUND_THE_SEAM = {
    "store/storage.py": "the POSIX storage: tmp, fsync, rename, directory fsync",
    "memory/node_files.py": "node memory (tmpfs): its small files, replaced whole (``replace_node_file``)",
    "testing/campaign.py": "test tooling: the campaign's results",
    "testing/cluster.py": "test tooling: the simulated nodes' logs",
    "testing/megatron_lm.py": "test tooling: installs a Megatron-LM checkout",
    "testing/state_dump.py": "test tooling: dumps of restored state to compare",
}
FILE_OPS = {"replace", "rename", "renames", "fsync"}  # os.<op>


def _writes(tree: ast.AST) -> list[int]:
    """Lines of ``open(..., "w...")`` (a mode that writes a new file: w, x) and of os.replace / rename / fsync."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            keyword = next((k.value for k in node.keywords if k.arg == "mode"), None)
            mode = node.args[1] if len(node.args) > 1 else keyword
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wx"):
                lines.append(node.lineno)
        elif (isinstance(f, ast.Attribute) and f.attr in FILE_OPS and isinstance(f.value, ast.Name)
              and f.value.id == "os"):
            lines.append(node.lineno)
    return sorted(lines)


def writers(package=PACKAGE) -> dict[str, list[int]]:
    found = {}
    for path in sorted(Path(package).rglob("*.py")):
        lines = _writes(ast.parse(path.read_text()))
        if lines:
            found[path.relative_to(package).as_posix()] = lines
    return found


def test_the_scanner_sees_writes_around_the_seam(tmp_path):
    (tmp_path / "m.py").write_text('import os\nwith open(os.path.join("a", "b"), "w") as f:\n    pass\n'
                                   'open(p, mode="xb")\nos.replace(a, b)\nos.fsync(3)\nopen(p)\nopen(p, "rb")\n')
    assert writers(tmp_path) == {"m.py": [2, 4, 5, 6]}


def test_no_module_writes_files_around_the_storage_seam():
    found = writers()
    assert set(found) <= set(AROUND_THE_SEAM), {k: v for k, v in found.items() if k not in AROUND_THE_SEAM}


# ---- a storage that cannot be reached (an object store's outage) ---------------------------------------------
class _OutageStorage(PosixStorage):
    """POSIX storage whose creates fail as an unreachable endpoint ``outages`` times, then succeed."""

    def __init__(self, outages: int, error=None):
        super().__init__()
        self.outages, self.error = outages, error

    def create(self, path, data):
        if self.outages:
            self.outages -= 1
            raise self.error or StorageUnreachable(5, f"{path}: EndpointConnectionError")
        return super().create(path, data)


def _layout():
    from megatron_pec.format.protocol import RankLayout

    return RankLayout(fingerprint="f00d", rank=1, topology={"tp": 1}, params=[], slices={}, buffers={})


def test_a_layout_record_the_storage_cannot_take_yet_is_written_once_it_answers(tmp_path):
    """A relaunch during an object store's outage must train from node memory: the rank's layout record is
    retried by a thread until the storage answers, and nothing waits for it or raises."""
    import time

    from megatron_pec.save import rank_layout
    from megatron_pec.store.checkpoint_dir import CheckpointDir

    d = CheckpointDir(str(tmp_path / "ck"), _OutageStorage(outages=3))
    assert rank_layout.record(d, _layout(), retry_s=(0.01,)) is None
    path = d.layout_path("f00d", 1)
    deadline = time.monotonic() + 10
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the layout record was never written"
        time.sleep(0.01)
    assert d.read_rank_layout("f00d", 1) == _layout()


def test_a_save_directory_that_refuses_the_layout_record_stops_training_with_its_path(tmp_path):
    from megatron_pec.save import rank_layout
    from megatron_pec.store.checkpoint_dir import CheckpointDir

    d = CheckpointDir(str(tmp_path / "ck"), _OutageStorage(1, PermissionError(13, "Permission denied")))
    assert rank_layout.record(d, _layout()) == f"cannot write under --save {tmp_path / 'ck'}: Permission denied"


@pytest.mark.parametrize("raised, unreachable", [
    (RuntimeError("Failed to PUT object(s) at b/k, error type: EndpointConnectionError, error: ..."), True),
    (type("ConnectTimeoutError", (Exception,), {})("timed out"), True),
    (RuntimeError("Failed to PUT object(s) at b/k, error type: ClientError, error: 403 AccessDenied"), False),
])
def test_an_endpoint_that_cannot_be_reached_is_told_from_a_refusal(raised, unreachable):
    pytest.importorskip("multistorageclient")
    from megatron_pec.store import msc_storage

    with pytest.raises(OSError) as caught:
        with msc_storage._io("msc://p/k"):
            raise raised
    assert isinstance(caught.value, StorageUnreachable) is unreachable
