"""Upgrading megatron-pec keeps every checkpoint: one written by an earlier release (slot-header v2,
before the per-expert columns were packed) restores exactly as that release restored it."""

import json
import shutil
import struct
from pathlib import Path

import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiprocess

FIXTURE = Path(__file__).parent / "fixtures" / "previous_format"


def header_version(path: Path) -> str:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size))["__metadata__"]["v"]


def test_a_checkpoint_of_the_previous_release_restores_as_it_did(tmp_path, shm_dir):
    """The fixture: 8 iterations of the small model, K = 1 of 8 experts, persisted every 2 iterations
    by megatron-pec a6c8957, then restored by it from storage (``expected.json``: each item's bytes,
    the PEC state, PLT, the next two losses). This release must restore the same from the same files."""
    files = sorted(FIXTURE.glob("checkpoint/iter_*/pec/rank_*.safetensors"))
    assert len(files) == 8 and {header_version(f) for f in files} == {"2"}, "the fixture is no longer v2"
    save = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "checkpoint", save)
    proc = torchrun("previous_format.py", "restore", str(save), shm_dir, env={"PEC_TEST_OUT": str(tmp_path)})
    expected = json.loads((FIXTURE / "expected.json").read_text())["ranks"]
    for rank in (0, 1):
        restored = json.loads((tmp_path / f"previous_format.rank{rank}.json").read_text())
        assert restored["iteration"] == 8 and restored["plt"] > 0.5, "the restore is not the fixture's"
        differing = {k: (restored[k], v) for k, v in expected[str(rank)].items() if restored.get(k) != v}
        assert not differing, f"rank {rank} restored differently from the release that wrote it: {differing}"
        assert f"megatron-pec: rank {rank}: restored iteration 8 from storage" in proc.stdout
