"""Smoke test of the benchmark plumbing (no model, a few seconds): the floors on a one-process gloo
group, and the JSON schema / target evaluation / markdown of benchmarks.checkpoint on a result
assembled from those floors; every collective on the backend's device; every method on the one schedule."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks import collective, floors, gpu, methods, report, scheduled, targets
from benchmarks.common import REPO
from benchmarks.schedule import MEMORY, PERSIST, PERSIST_EVERY, Schedule, schedules
from megatron_pec.testing import launch


@pytest.fixture()
def one_rank_group():
    port = launch.free_port()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_floors_and_report(one_rank_group, tmp_path):
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    shm_dir = os.path.join(shm, f"bench_smoke_{os.getpid()}")
    mc = floors.memcpy_floor(shm_dir, 0, 4 << 20, reps=3)
    try:
        assert mc["memcpy_s"] > 0 and mc["memcpy_from_tmpfs_s"] > 0 and mc["memcpy_bytes_per_rank"] == 4 << 20
        wf = floors.storage_floors(str(tmp_path / "storage"), 0, 1, [mc["_path"]], reps=1)
    finally:
        mc["_map"].close()
        os.unlink(mc.pop("_path"))
        mc.pop("_map")
        os.rmdir(shm_dir)
    assert wf["write_MBps"] > 0 and wf["read_MBps"] > 0 and wf["write_bytes"] == 4 << 20
    restored = tmp_path / "rank_0.bin"
    restored.write_bytes(os.urandom(1 << 20))
    assert floors.cold_read_floor([str(restored)], 0) > 0
    assert floors.cold_read_floor(None, 0) is None  # (a method that does not say what it reads)
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
    result["targets"] = targets.evaluate(result)
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


def test_issue_41s_targets_in_one_line():
    ours = {"save_phases_s": {"copy": 0.008, "metadata": 0.0003, "slot": 0.0001}, "restore_memory_s": 0.020,
            "restore_storage_s": 0.090, "restore_storage_floor_s": 0.060,
            "restore_storage_s_all": [0.090, 0.080], "restore_storage_floor_s_all": [0.060, 0.080]}
    dlrover = {"restore_memory_s": 0.025, "restore_storage_s": 0.100}
    line, = targets.host_path_and_restore_targets({"megatron-pec K=all": ours, "DLRover flash ckpt": dlrover})
    assert line.startswith("megatron-pec K=all, the CPU targets: 3 of 4 met in this run: "), line
    assert "the save besides its copy 0.40 ms (≤ 0.5 ms): met" in line
    assert "restore from memory 20.0 ms, DLRover 25.0 ms (no slower): met" in line
    assert "restore from storage 1.50× the cold read of its files" in line
    assert "60.0 ms median (≤ 1.3×; each restore against the read before it: 1.50, 1.00): NOT met" in line
    assert targets.host_path_and_restore_targets({}) == []


def test_phases_of_several_saves_and_the_agents_ledger():
    from benchmarks.worker import ledger_per_save, median_phases

    saves = [{"copy": 0.004, "agreement": 0.001}, {"copy": 0.006}, {"copy": 0.005, "agreement": 0.003}, None]
    assert median_phases(saves) == {"copy": 0.005, "agreement": 0.001}  # (a phase a save lacks: 0)
    assert median_phases([None]) is None
    before = {"phases": {"carrying": 1.0}, "process_s": 10.0}
    after = {"phases": {"carrying": 1.5, "committing": 0.5}, "process_s": 12.0}
    assert ledger_per_save(before, after, 10) == pytest.approx({"carrying": 0.05, "committing": 0.05, "other": 0.1})
    assert ledger_per_save(None, after, 10) is None


# ---- collectives: every tensor on the backend's device ---------------------------------------------

COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "batch_isend_irecv"}
DISTRIBUTED = {"torch.distributed", "dist", "torch.distributed.distributed_c10d", "c10d"}


def direct_collectives(path) -> list[str]:
    """Collective calls on torch.distributed in ``path`` (and collectives imported from it by name)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES \
                and ast.unparse(node.func.value) in DISTRIBUTED:
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names if a.name in COLLECTIVES]
    return found


def test_no_benchmark_module_calls_a_collective_outside_the_helper():
    offenders = [hit for path in sorted((REPO / "benchmarks").glob("*.py")) if path.name != "collective.py"
                 for hit in direct_collectives(path)]
    assert not offenders, f"collectives outside benchmarks/collective.py (NCCL refuses CPU tensors): {offenders}"


def test_the_collective_scan_sees_direct_calls(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nimport torch.distributed as dist\nfrom torch.distributed import broadcast\n"
                      "torch.distributed.broadcast(t, 0)\ndist.all_reduce(t)\ntorch.distributed.barrier()\n")
    assert direct_collectives(sample) == ["sample.py:3 import broadcast", "sample.py:4 torch.distributed.broadcast",
                                          "sample.py:5 dist.all_reduce"]


def test_collective_tensors_go_to_the_gpu_on_nccl(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective.backend_device() == torch.device("cuda", 3)
    made, called = [], []
    monkeypatch.setattr(collective, "_tensor", lambda values, device: made.append(device) or torch.tensor(values))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: called.append("all_reduce"))
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src: called.append("broadcast"))
    collective.reduce_max(1.0)
    collective.broadcast_value(2.0)
    assert made == [torch.device("cuda", 3)] * 2 and called == ["all_reduce", "broadcast"]


def test_collective_tensors_stay_on_the_cpu_on_gloo(one_rank_group):
    assert collective.backend_device() == torch.device("cpu")
    assert collective.reduce_max(1.5) == 1.5 and collective.broadcast_value(2.5) == 2.5
    assert collective.gather_objects({"a": 1}) == [{"a": 1}]


# ---- the one schedule ------------------------------------------------------------------------------

def test_memory_tiers_checkpoint_every_iteration_and_persist_every_20():
    memory_tier, = schedules(has_memory=True)
    plan = dict(memory_tier.plan(40))
    assert sorted(plan) == list(range(1, 41))
    assert [i for i, a in plan.items() if a == PERSIST] == [20, 40] and PERSIST_EVERY == 20
    assert all(a == MEMORY for i, a in plan.items() if i not in (20, 40))


def test_storage_alone_checkpoints_every_iteration_and_every_20_each_a_persist():
    every, every_20 = schedules(has_memory=False)
    assert every.plan(40) == [(i, PERSIST) for i in range(1, 41)]
    assert every_20.plan(40) == [(20, PERSIST), (40, PERSIST)]
    assert (every.label, every_20.label) == ("every iteration", "every 20")


def test_every_method_of_the_gpu_benchmark_gets_its_tiers_schedules():
    assert methods.Pec.has_memory and methods.DLRover.has_memory and not methods.TorchDist.has_memory
    assert methods.MegatronLocal.has_memory  # (its snapshots are local, its persists torch_dist)
    assert gpu.SCHEDULE == schedules(has_memory=True)[0]
    assert set(gpu.PEERS.split(",")) == {"pec_all", "dlrover", "torch_dist_async", "megatron_local"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the method runs")
def test_megatron_local_checkpoints_say_they_need_cuda_on_cpu(one_rank_group, tmp_path):
    class Ctx:
        rank, world = 0, 1

    method = methods.MegatronLocal(Ctx(), str(tmp_path / "global"), str(tmp_path / "local"))
    with pytest.raises(RuntimeError, match="^needs CUDA: nvidia-resiliency-ext's local checkpoints assert CUDA"):
        method.setup()
    out = {"device": "cpu", "wall_s": 1.0, "model": [], "schedule": {"label": "x", "persist_every": 20},
           "rows": {}, "errors": {method.name: "RuntimeError: " + methods.NEEDS_CUDA}, "seconds_by_part": {}}
    assert f"| {method.name} | - | not run: {methods.NEEDS_CUDA} |" in gpu.markdown(out, "test")


def test_copy_enqueue_counts_runs_as_the_stager_and_times_them():
    from benchmarks import copy_enqueue
    from megatron_pec.megatron.collect import Slice

    buffer, moments = torch.zeros(40), torch.zeros(40)
    live, slices = {}, []
    for item, start in (("dense", 0), ("L1.E0", 10), ("L1.E1", 20)):  # two params per item, adjacent
        for kind, tensor in (("param", buffer), ("exp_avg", moments)):
            for half in (0, 5):
                name = f"{item}/p{half}.{kind}"
                live[name] = tensor[start + half:start + half + 5]
                slices.append(Slice(name, item, None, "w", 0, 5, torch.float32, (0, 0, None, 0, half, kind, 0)))
    runs = copy_enqueue.item_runs(slices, live)
    assert {item: len(r) for item, r in runs.items()} == {"dense": 2, "L1.E0": 2, "L1.E1": 2}
    assert copy_enqueue.deepseek_v3_runs(runs, "dense") == {"runs": 58 * 256 // 64 * 2 + 2, "experts_per_rank": 232,
                                                            "runs_per_expert": 2, "dense_runs": 2}
    srcs = copy_enqueue.equal_runs(4000, 7, "cpu")
    row = copy_enqueue.time_enqueue(srcs, cuda=False, reps=2)
    assert row["runs"] == 7 and row["bytes"] == 7 * 142 * 4 and len(row["enqueue_s_all"]) == 2
    text = "\n".join(gpu.enqueue_markdown({"device": "cpu", "timed": "memcpys", "reps": 2, "budget_s": 5e-4,
                                           "rows": [{**row, "what": "x"}], "enqueue_us_per_run": None}))
    assert "| 7 | x | 0.0 | 0.6 |" in text and "over 0.5 ms |" in text


def test_the_example_trainer_saves_on_the_schedule(monkeypatch):
    """The example's own loop (Megatron's intervals) with the flags benchmarks.gpu passes: the same plan."""
    import argparse
    import sys

    sys.path.insert(0, str(REPO / "examples" / "gpt_moe"))
    import pretrain_gpt_moe as example

    done = []
    monkeypatch.setattr(example, "_timed_save", lambda args, it, *rest, non_persistent: done.append(
        (it, MEMORY if non_persistent else PERSIST)) or 0.0)
    flags = gpu.SCHEDULE.megatron_flags()
    value = lambda flag: int(flags[flags.index(flag) + 1])
    args = argparse.Namespace(save="x", save_interval=value("--save-interval"),
                              non_persistent_save_interval=value("--non-persistent-save-interval"))
    for iteration in range(1, 41):
        example.checkpoint_if_due(args, iteration, None, None, None)
    assert done == gpu.SCHEDULE.plan(40)


class FakeCtx:
    def __init__(self):
        self.iteration = 0

    def train(self, n=1):
        pass

    def timed_train(self, n):
        return 0.01 * n

    def next_iteration(self):
        self.iteration += 1
        return self.iteration


class FakeMethod:
    """Records what the worker asks for; its snapshots of iterations in ``busy`` are skipped."""

    family, name, has_memory, node_memory_why = "fake", "fake", True, "nothing"

    def __init__(self, busy=()):
        self.calls, self.busy, self.skipped, self.waited = [], set(busy), 0, []

    def snapshot(self, it):
        self.calls.append((it, MEMORY))
        self.skipped += it in self.busy
        return it not in self.busy

    def save(self, it):
        self.calls.append((it, PERSIST))
        return True

    def wait_persisted(self, it):
        self.waited.append(it)

    def node_memory_bytes(self):
        return 123


def test_the_worker_follows_the_schedule_and_counts_skipped_checkpoints(one_rank_group):
    method = FakeMethod(busy={3, 4})
    row = scheduled.run_on_schedule(FakeCtx(), method, Schedule(1, PERSIST_EVERY), 40)
    assert method.calls == Schedule(1, PERSIST_EVERY).plan(40) and method.waited == [40]
    assert row["skipped"] == 2 and row["checkpoints"] == 40 and len(row["blocking_s_all"]) == 38
    assert row["node_memory_bytes"] == 123 and row["schedule"] == "every iteration, persist every 20"
    assert len(row["step_s_without_checkpoints"]) == 2 and {"step_overhead", "step_overhead_mean"} <= set(row)
    assert scheduled.slowest_steps([[0.1, 0.3], [0.2, 0.1]]) == [0.2, 0.3]  # (per iteration, the slowest rank)
    storage_only = FakeMethod()
    storage_only.has_memory = False
    scheduled.run_on_schedule(FakeCtx(), storage_only, Schedule(20, 20), 40)
    assert storage_only.calls == [(20, PERSIST), (40, PERSIST)]


def test_the_gpu_rows_say_where_a_longer_step_goes():
    """benchmarks.gpu: the example's median step as wall time, training-thread CPU and GPU-stream time, so a
    GPU run tells a host-side slowdown from a device-side one (the H200's K=all step was 25-30 ms longer)."""
    rows = [{"iteration": i, "step_s": 0.1 + i / 1000, "step_cpu_s": 0.05, "device_step_s": 0.08 + i / 1000}
            for i in range(1, 12)]
    row = gpu.example_row({"rows": rows, "log": "", "code": 0}, None, None)
    assert row["step_cpu_s"] == 0.05 and abs(row["device_step_s"] - 0.0885) < 1e-12  # (after the warm-up)
    cpu_only = gpu.example_row({"rows": [dict(r, device_step_s=None) for r in rows], "log": "", "code": 0},
                               None, None)
    assert cpu_only["device_step_s"] is None
    out = {"rows": {"example: megatron-pec K=all": row}, "example_base": cpu_only}
    line = gpu.step_parts_markdown(out)[0]
    assert "no checkpoints 108.5 / 50.0 / -" in line and "megatron-pec K=all 108.5 / 50.0 / 88.5" in line


def test_a_snapshots_cost_is_paired_with_the_steps_beside_it_so_drift_cancels():
    """benchmarks.gpu's paired estimate: a run whose step drifts by 50% over its iterations, each snapshot (every
    4th iteration) blocking 1 ms and slowing the step after it by 4 ms: its cost is 5 ms whatever the drift,
    where comparing medians with another run would see the drift."""
    from benchmarks import paired_cost

    def step(i):
        return 0.100 + 0.050 * i / 40  # (the drift)

    rows = [{"iteration": i, "step_s": step(i) + (0.004 if i % 4 == 1 and i > 1 else 0.0),
             "save_blocking_s": 0.001 if i % 4 == 0 else None} for i in range(1, 41)]
    paired = paired_cost.paired_cost(rows, warmup=5)
    assert paired["snapshots"] == 8  # (8, 12, ..., 36: each with the two steps after it recorded; 40 has none)
    assert all(abs(c - 0.005) < 1e-12 for c in paired["costs_s"])  # (the drift cancels)
    assert abs(paired["overhead"] - paired["cost_s_median"] / paired["clean_step_s_median"]) < 1e-12
    assert "+3.9% of the clean step" in paired_cost.markdown(paired, "K=all")[0]
    assert paired_cost.paired_cost([r for r in rows if r["iteration"] < 8], warmup=5) is None
