"""Partial-experts restore is exact per version, PLT is exact, Dynamic-K doubles K,
and persisting 1 of 8 experts cuts persisted bytes per rank by at least 70%."""

import json

import pytest
from conftest import torchrun

from megatron_pec.testing.cluster import run_megatron_pec

pytestmark = [pytest.mark.multiprocess, pytest.mark.newest_only]


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


def test_a_planned_exit_right_after_a_skipped_snapshot_saves_that_iteration_whole(tmp_path, shm_dir):
    """The snapshot of the last iteration was skipped (no region on one rank), then training ends
    cleanly: the trainers save that iteration once more with every expert before they detach, so the restart
    restores it from storage with PLT 0 and every slice as it was at exit."""
    proc = torchrun("planned_exit.py", str(tmp_path / "ckpt"), shm_dir, env={"PEC_TEST_OUT": str(tmp_path)})
    for rank in (0, 1):
        r = json.loads((tmp_path / f"exit.rank{rank}.json").read_text())
        assert r["skipped"] == 1 and r["iteration"] == 6, r
        assert r["committed"][0] == 6 and r["generation"].endswith(".exit") and r["experts"] == [6], r
        assert r["plt"] == 0.0 and r["differences"] == [], r
    assert "skipped the snapshot of iteration 6" in proc.stdout + proc.stderr
    assert "planned exit: iteration 6 saved once more with every expert" in proc.stdout + proc.stderr
    assert "restored iteration 6 from storage" in proc.stdout


def test_a_committed_iteration_saved_again_is_committed_under_new_names(tmp_path, shm_dir):
    """4 is committed (persist-K 1) and saved again by the same process: the first save's files are
    never written again, the second save writes every expert (its commit replaces the first's) into new files
    its manifest switches to, and the first's go once unreferenced. Restored from node memory and saved once
    more, nothing is written. ``verify`` passes, and a restore from storage reads exactly the state saved."""
    save = tmp_path / "ckpt"
    proc = torchrun("resave.py", str(save), shm_dir, env={"PEC_TEST_OUT": str(tmp_path)})
    for rank in (0, 1):
        r = json.loads((tmp_path / f"resave.rank{rank}.json").read_text())
        assert r["restored_from_memory"] == 4 and r["saved_nothing_after_the_restore"], r
        first, second = r["generations"]
        assert first != second and second, r
        assert r["at_4"][1] == 16, r  # saved again: every expert (2 layers x 8), not persist-K
        assert r["changed"] == ["manifest.json"], r  # replaced by a rename: the switch
        assert not set(r["first_files"]) & set(r["second_files"]), r
        rank_files = {f for f in r["left"] if f.endswith(".safetensors")}
        assert set(r["second_files"]) <= rank_files <= set(r["referenced"]), r
        assert r["differences"] == [], r
    assert "restored iteration 4 from memory" in proc.stdout and "restored iteration 4 from storage" in proc.stdout
    verify = run_megatron_pec("verify", save)
    assert verify.returncode == 0, verify.stdout + verify.stderr
