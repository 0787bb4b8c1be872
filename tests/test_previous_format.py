"""Upgrading megatron-pec keeps every checkpoint: one written by an earlier release (slot-header v2,
before the per-expert columns were packed) restores exactly as that release restored it."""

import json
import shutil
import struct
from pathlib import Path

import pytest
from conftest import torchrun

pytestmark = [pytest.mark.multiprocess, pytest.mark.newest_only]

FIXTURE = Path(__file__).parent / "fixtures" / "previous_format"


def metadata(path: Path) -> dict:
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size))["__metadata__"]


def header_version(path: Path) -> str:
    return metadata(path)["v"]


def small_state(path: Path) -> dict:
    """The small state (optimizer param groups, scheduler, RNG, samples) a rank file records, decoded."""
    return json.loads(metadata(path)["small"])["__dict__"]


def test_a_checkpoint_of_the_previous_release_restores_as_it_did(tmp_path, shm_dir):
    """The fixture: 8 iterations of the small model, K = 1 of 8 experts, persisted every 2 iterations
    by megatron-pec a6c8957, then restored by it from storage (``expected.json``: each item's bytes,
    the PEC state, PLT). This release must restore the same from the same files, and the small state
    (scheduler, optimizer steps, RNG, samples) exactly as recorded: saved again by this release, it is
    what the fixture holds. The losses after the restore equal those after a restore of that state
    saved in this release's own format, on this machine (losses are not compared across machines:
    2.4e-7 apart between an AMD EPYC and an Intel Xeon, same bytes)."""
    files = sorted(FIXTURE.glob("checkpoint/iter_*/pec/rank_*.safetensors"))
    assert len(files) == 8 and {header_version(f) for f in files} == {"2"}, "the fixture is no longer v2"
    load, resaved = tmp_path / "ckpt", tmp_path / "resaved"
    shutil.copytree(FIXTURE / "checkpoint", load)
    out = {"PEC_TEST_OUT": str(tmp_path)}
    proc = torchrun("previous_format.py", "restore", str(load), shm_dir, str(resaved), env=out)
    torchrun("previous_format.py", "reference", str(resaved), shm_dir, env=out)
    expected = json.loads((FIXTURE / "expected.json").read_text())["ranks"]
    for rank in (0, 1):
        restored = json.loads((tmp_path / f"previous_format.restore.rank{rank}.json").read_text())
        assert restored["iteration"] == 8 and restored["plt"] > 0.5, "the restore is not the fixture's"
        differing = {k: (restored[k], v) for k, v in expected[str(rank)].items() if restored.get(k) != v}
        assert not differing, f"rank {rank} restored differently from the release that wrote it: {differing}"
        assert f"megatron-pec: rank {rank}: restored iteration 8 from storage" in proc.stdout

        recorded = small_state(FIXTURE / f"checkpoint/iter_0000008/pec/rank_{rank:05d}.safetensors")
        [again] = resaved.glob(f"iter_0000008/pec/rank_{rank:05d}*.safetensors")
        differing = {k: v for k, v in recorded.items() if small_state(again).get(k) != v}
        assert not differing, \
            f"rank {rank}: the small state restored differs from the recorded one in {sorted(differing)}"

        reference = json.loads((tmp_path / f"previous_format.reference.rank{rank}.json").read_text())
        assert reference["items"] == restored["items"] and reference["consumed"] == restored["consumed"]
        assert restored["losses"] == reference["losses"], "training after the restore differs from the reference"
