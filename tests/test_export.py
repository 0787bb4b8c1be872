"""``python -m megatron_pec export`` - a committed iteration as consolidated safetensors."""

import json
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from conftest import checkpoints, torchrun

from megatron_pec.format.stformat import torch_dtype
from megatron_pec.testing import launch
from megatron_pec.testing.cluster import run_megatron_pec

pytestmark = [pytest.mark.multiprocess, pytest.mark.newest_only]


def read_safetensors(path) -> dict[str, torch.Tensor]:
    """An independent reader (plain JSON + bytes) for the test's comparisons."""
    data = open(path, "rb").read()
    size = int.from_bytes(data[:8], "little")
    body = json.loads(data[8:8 + size])
    body.pop("__metadata__", None)
    out = {}
    for name, spec in body.items():
        begin, end = spec["data_offsets"]
        raw = bytearray(data[8 + size + begin:8 + size + end])
        out[name] = torch.frombuffer(raw, dtype=torch_dtype(spec["dtype"])).reshape(spec["shape"])
    return out


def train_and_keep_live_state(out: Path, *flags: str, env: dict | None = None) -> None:
    shm = Path("/dev/shm") / f"pec-test-{uuid.uuid4().hex[:8]}"
    try:
        torchrun("export_state.py", str(out / "ckpt"), str(shm), *flags, env={"PEC_TEST_OUT": str(out), **(env or {})})
    finally:
        launch.stop_agents(shm)
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The small model (EP=2 over 2 ranks, every expert saved) committed at iteration 4, and each rank's
    live state dict at that iteration."""
    out = tmp_path_factory.mktemp("export")
    train_and_keep_live_state(out)
    return out


def assert_export_equals_live(trained: Path, out: Path) -> None:
    result = run_megatron_pec("export", trained / "ckpt", out)
    assert result.returncode == 0, result.stderr
    assert "exported iteration 4" in result.stdout, result.stdout
    exported = read_safetensors(out / "model.safetensors")
    live = {}
    for rank in (0, 1):
        for name, tensor in read_safetensors(trained / f"live.rank{rank}.safetensors").items():
            if name in live:  # dense state: every data-parallel rank holds all of it, identically
                assert torch.equal(live[name], tensor), name
            live[name] = tensor
    assert sorted(exported) == sorted(live)
    assert any("local_experts.7." in name for name in exported)  # global expert ids: 8 experts, 4 per EP rank
    for name, tensor in live.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name
    summary = json.loads((out / "pec_export.json").read_text())
    assert summary["iteration"] == 4 and summary["experts_older_than_iteration"] == 0
    assert summary["tensors"] == len(live) and summary["files"] == ["model.safetensors"]
    assert summary["topology"]["ep"] == 2 and summary["world_size"] == 2


def test_export_equals_the_live_model(trained, tmp_path):
    assert_export_equals_live(trained, tmp_path / "hf")


def test_export_after_training_ends_under_pec_equals_the_live_model(tmp_path):
    """Snapshot-K 2 / persist-K 1 and training ends right after a memory snapshot: the end is a
    planned exit, which saves that iteration with every expert, so the exported final checkpoint is the
    trained model, not experts from older iterations."""
    train_and_keep_live_state(tmp_path, "--pec-snapshot-k", "2", "--pec-persist-k", "1",
                              env={"PEC_TEST_END": "exit"})
    assert checkpoints(tmp_path / "ckpt").committed_iterations()[0] == 4
    assert_export_equals_live(tmp_path, tmp_path / "hf")


def test_export_shards_and_refuses_to_overwrite(trained, tmp_path):
    out = tmp_path / "sharded"
    result = run_megatron_pec("export", trained / "ckpt", out, "--max-shard-gb", str(64 / 2**30 * 1024))
    assert result.returncode == 0, result.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).exists() for f in files)
    whole = {}
    for f in files:
        whole.update(read_safetensors(out / f))
    assert sorted(whole) == sorted(index["weight_map"])
    again = run_megatron_pec("export", trained / "ckpt", out)
    assert again.returncode == 1 and "already holds" in again.stderr and "Traceback" not in again.stderr


def test_export_refuses_a_corrupt_file_and_a_missing_iteration(trained, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained / "ckpt", ckpt)
    missing = run_megatron_pec("export", ckpt, tmp_path / "a", "--iteration", "3")
    assert missing.returncode == 1 and "iteration 3 is not committed" in missing.stderr, missing.stderr
    entry = checkpoints(ckpt).read_manifest(4).ranks["1"]
    path = ckpt / entry.file
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # the last tensor's bytes
    path.write_bytes(bytes(data))
    corrupt = run_megatron_pec("export", ckpt, tmp_path / "b")
    assert corrupt.returncode == 1 and "fails its checksum" in corrupt.stderr, corrupt.stderr
    assert "Traceback" not in corrupt.stderr
    assert not (tmp_path / "b" / "model.safetensors").exists()
    shutil.rmtree(ckpt / "pec_layout")
    old = run_megatron_pec("export", ckpt, tmp_path / "c")
    assert old.returncode == 1 and "no readable layout record" in old.stderr, old.stderr
