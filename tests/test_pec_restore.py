"""Issue 4: partial-experts restore is exact per version, PLT is exact, Dynamic-K doubles K,
and persisting 1 of 8 experts cuts persisted bytes per rank by at least 70%."""

import json

import pytest

from conftest import torchrun

pytestmark = pytest.mark.multiprocess


def test_pec_restore_versions_plt_and_dynamic_k(tmp_path, shm_dir):
    proc = torchrun("pec_restore.py", str(tmp_path / "ckpt"), shm_dir, env={"PEC_TEST_OUT": str(tmp_path)})
    for rank in (0, 1):
        r = json.loads((tmp_path / f"pec.rank{rank}.json").read_text())
        for leg in ("memory_1", "memory_2", "storage"):
            assert r[leg]["mismatched"] == [], f"{leg}: slices differ from their versions"
            assert r[leg]["plt"] == pytest.approx(r[leg]["expected_plt"], rel=1e-12, abs=0), leg
        # K=2 of 8 per layer: some experts are necessarily restored from older versions.
        assert r["memory_1"]["stale"] and r["storage"]["stale"]
        assert r["memory_1"]["plt"] > 0.001
        # Node memory holds every expert at its latest snapshot version (carried forward by the agent),
        # not only the experts of the last three snapshots.
        assert r["memory_1"]["latest_versions"] and r["memory_2"]["latest_versions"]
        # Dynamic-K: doubled after the first recovery, kept in checkpoints, doubled again.
        assert (r["memory_1"]["k"], r["memory_1"]["persist_k"]) == (4, 2)
        assert (r["memory_2"]["k"], r["memory_2"]["persist_k"]) == (8, 4)
        # Restoring iteration 14 rolls the bookkeeping back to what iteration 14 recorded (K=4), then doubles.
        assert r["storage"]["k"] == 8
        # 10 and 14 were memory snapshots only: restored from memory, they were persisted after the restart.
        assert {10, 14} <= set(r["committed"]), r["committed"]
        sizes = r["persisted_bytes"]
        assert sizes["8"] <= 0.3 * sizes["4"], f"persist-K 1 vs all experts: {sizes}"
    assert "restored iteration 10 from memory" in proc.stdout
    assert "restored iteration 14 from storage" in proc.stdout
    assert "Dynamic-K raises snapshot K 2 -> 4" in proc.stdout
