"""Smoke test of the benchmark plumbing (no model, a few seconds): the floors on a one-process gloo
group, and the JSON schema / target evaluation / markdown of benchmarks.checkpoint on a result
assembled from those floors."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from benchmarks import checkpoint, floors, report


@pytest.fixture()
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_floors_and_report(one_rank_group, tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    shm_dir = os.path.join(shm, f"bench_smoke_{os.getpid()}")
    mc = floors.memcpy_floor(shm_dir, 0, 4 << 20, reps=3)
    try:
        assert mc["memcpy_s"] > 0 and mc["memcpy_from_tmpfs_s"] > 0 and mc["memcpy_bytes_per_rank"] == 4 << 20
        wf = floors.write_floor(str(tmp_path / "storage"), 0, 1, [mc["_path"]], reps=1)
    finally:
        mc["_map"].close()
        os.unlink(mc.pop("_path"))
        mc.pop("_map")
        os.rmdir(shm_dir)
    assert wf["write_MBps"] > 0 and wf["write_bytes"] == 4 << 20
    fl = {**mc, **wf}
    method = {"family": "pec", "blocking_s_median": 0.002, "blocking_s_p90": 0.003, "bytes_per_rank": 4 << 20,
              "snapshot_bytes_per_rank": 4 << 20, "memcpy_floor_s": mc["memcpy_s"], "persist_MBps": 100.0,
              "restore_memory_s": 0.01, "restore_storage_s": 0.02, "train_throughput_ratio": 0.99,
              "throughput_ratio_by_interval": {"1": 0.99}, "fsync": True,
              "save_phases_s": {"copy": 0.0015, "agreement": 0.0004, "metadata": 0.0001},
              "restore_memory_phases_s": {"copy": 0.006, "reading and checking": 0.003, "param sync": 0.001},
              "agent_cpu_by_phase_s_per_save": {"checking and writing": 0.012, "carrying": 0.004, "other": 0.001}}
    model = {"num_layers": 2, "hidden_size": 64, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 256,
             "ep": 2, "dp": 2, "world_size": 2, "optimizer_state_bytes_per_rank": 4 << 20}
    run = {"model": model, "floors": fl, "methods": {"megatron-pec K=all": method,
                                                      "torch_dist sync": {**method, "family": "torch_dist",
                                                                          "blocking_s_median": 0.05}},
           "baseline_s_per_iteration": [0.1, 0.1]}
    result = {"mode": "quick", "command": "test", "machine": {"cpu": "x"}, "runs": [run],
              "model": model, "floors": {"memcpy_s": fl["memcpy_s"], "write_MBps": fl["write_MBps"]},
              "methods": run["methods"]}
    result["targets"] = checkpoint.targets(result)
    assert any("torch_dist sync is 25.0× slower" in t for t in result["targets"])
    for key in ("blocking_s_median", "blocking_s_p90", "bytes_per_rank", "persist_MBps", "restore_memory_s",
                "restore_storage_s", "train_throughput_ratio"):
        assert key in result["methods"]["megatron-pec K=all"]
    assert any("restore from memory 10 ms" in t and "[ms: copy 6.0, reading and checking 3.0, param sync 1.0]" in t
               for t in result["targets"]), result["targets"]
    text = report.markdown(result)
    assert "| megatron-pec K=all |" in text and "Targets" in text
    assert "| megatron-pec K=all | 2.0 | " in text and "| copy 1.5, agreement 0.4, metadata 0.1 |" in text
    assert "| megatron-pec K=all | 17.0 | checking and writing 12.0, carrying 4.0, other 1.0 |" in text


def test_phases_of_several_saves_and_the_agents_ledger():
    from benchmarks.worker import ledger_per_save, median_phases

    saves = [{"copy": 0.004, "agreement": 0.001}, {"copy": 0.006}, {"copy": 0.005, "agreement": 0.003}, None]
    assert median_phases(saves) == {"copy": 0.005, "agreement": 0.001}  # (a phase a save lacks: 0)
    assert median_phases([None]) is None
    before = {"phases": {"carrying": 1.0}, "process_s": 10.0}
    after = {"phases": {"carrying": 1.5, "committing": 0.5}, "process_s": 12.0}
    assert ledger_per_save(before, after, 10) == pytest.approx({"carrying": 0.05, "committing": 0.05, "other": 0.1})
    assert ledger_per_save(None, after, 10) is None
