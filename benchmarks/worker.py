"""The benchmark worker, run under torchrun: builds the real megatron-core GPT-MoE of
``examples/gpt_moe``, trains it a few iterations, and measures every checkpoint method on it in one
run. Launched by ``python -m benchmarks.checkpoint`` (2 gloo ranks on CPU; ``--mode main`` and
``scaling``) and ``python -m benchmarks.gpu`` (one NCCL rank on a GPU; ``--mode schedule``, every method
on the one schedule: ``scheduled.py``); writes one JSON file.

    torchrun --nproc-per-node 2 -m benchmarks.worker --mode main --out part.json -- <model flags>

Model flags are the example's Megatron flag names (``--hidden-size``, ``--num-experts``, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "gpt_moe"))
sys.path.insert(0, str(REPO))

import torch  # noqa: E402 (after the set-up above)

from benchmarks import floors  # noqa: E402 (after the set-up above)
from benchmarks.collective import gather_objects, reduce_max  # noqa: E402 (after the set-up above)
from benchmarks.common import SHM_ROOT, STORAGE_ROOT, loadavg, median, p90  # noqa: E402 (after the set-up above)
from benchmarks.restores import measure_restores, median_phases, slowest_phases  # noqa: E402,F401 (after sys.path is set; imported for the workers)

MEMORY_RESTORES = 7  # per method, the median reported (a restore is ~20 ms: scheduling noise matters)
STORAGE_RESTORES = 5  # per method; each reads its newest checkpoint cold


def log(msg: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Ctx:
    """The training job every method checkpoints."""

    def __init__(self, bench, model_argv):
        import pretrain_gpt_moe as ex
        from byte_data import default_data_prefix, ensure_stdlib_dataset

        import megatron_pec

        self.ex, self.bench = ex, bench
        self.args = ex.parse_args(model_argv)
        ex.initialize(self.args)
        megatron_pec.use_args(self.args)
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.run_id = bench.run_id
        self.shm_dir = os.path.join(SHM_ROOT, self.run_id)
        self.storage_dir = os.path.join(STORAGE_ROOT, self.run_id)
        self.args.data_path = default_data_prefix()
        if self.rank == 0:
            ensure_stdlib_dataset(self.args.data_path)
        torch.distributed.barrier()
        self.iteration = 0
        self._live = None
        self.build()

    def build(self):
        from byte_data import batches, build_datasets
        from megatron.core import parallel_state

        a = self.args
        self.model, self.optimizer, self.scheduler = self.ex.setup_model_and_optimizer(a)
        a.consumed_train_samples = a.skipped_train_samples = a.consumed_valid_samples = 0
        a.iteration, a.num_floating_point_operations_so_far = 0, 0
        train_ds, _ = build_datasets(a.data_path, a.seq_length, a.seed, a.train_iters * a.global_batch_size,
                                     a.eval_iters * a.global_batch_size * 2, a.split)
        self.data = batches(train_ds, 0, a.micro_batch_size, parallel_state.get_data_parallel_rank(),
                            a.data_parallel_size)
        self._live = None

    def free(self):
        self.model = self.optimizer = self.scheduler = self.data = self._live = None
        gc.collect()

    def next_iteration(self) -> int:
        self.iteration += 1
        return self.iteration

    def train(self, n: int = 1) -> None:
        for _ in range(n):
            self.ex.train_step(self.args, self.model, self.optimizer, self.scheduler, self.data)
            self.args.consumed_train_samples += self.args.global_batch_size
        # Restores may replace the optimizer's state tensors; views are re-bound lazily.

    def timed_train(self, n: int) -> float:
        """Seconds the slowest rank takes to train ``n`` iterations without checkpoints."""
        torch.distributed.barrier()
        t0 = time.perf_counter()
        self.train(n)
        return reduce_max(time.perf_counter() - t0)

    def live_views(self):
        """This rank's optimizer shard tensors by slice name (the state every method saves)."""
        from megatron_pec.megatron import collect

        if self._live is None:
            self._live = collect.live_views(collect.build_slices(self.model, self.optimizer), self.optimizer)
        return self._live

    def invalidate(self):
        self._live = None

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.live_views().values())

    def param_count(self) -> int:
        local = sum(p.numel() for p in self.model[0].parameters())
        return local


# ---- measuring one method ------------------------------------------------------------------------

def measure(ctx: Ctx, method, saves: int, intervals: list[int], iters: int, baseline_s: float,
            memcpy_Bps: float) -> dict:
    out = {"family": method.family, "load_1min_at_start": loadavg()}
    t_setup = time.perf_counter()
    method.setup()
    out["setup_s"] = reduce_max(time.perf_counter() - t_setup)
    out.update(measure_saves(ctx, method, saves, memcpy_Bps))
    out.update(measure_throughput(ctx, method, intervals, iters))
    # restores (last: they change the training state)
    out.update(measure_restores(ctx, method, MEMORY_RESTORES, STORAGE_RESTORES))
    method.close()
    method.cleanup()
    return out


def measure_saves(ctx: Ctx, method, saves: int, memcpy_Bps: float) -> dict:
    """``saves`` checkpoints, one per iteration, each waited for: blocking, persist, bytes, the agent's CPU."""
    blocking, persist, node_bytes, rank_bytes, save_phases = [], [], [], [], []
    ledger_before = method.background_cpu_phases()
    cpu_before = method.background_cpu_s()
    for _ in range(saves):
        ctx.train(1)
        it = ctx.next_iteration()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        ok = method.save(it)
        tb = time.perf_counter() - t0
        phases_here = method.phases("save")
        method.wait_persisted(it)
        tp = time.perf_counter() - t0
        phases = slowest_phases(phases_here)
        tb, tp = reduce_max(tb), reduce_max(tp)
        mine = method.written_bytes(it) if ok else 0
        everyone = gather_objects(mine)
        if ok:
            save_phases.append(phases)
            blocking.append(tb)
            persist.append(tp)
            node_bytes.append(sum(everyone))
            rank_bytes.append(everyone)
    ledger_after = method.background_cpu_phases()  # (first: it waits for the agent's last carries)
    cpu_after = method.background_cpu_s()
    snap = method.snapshot_bytes()
    snap_all = gather_objects(snap)
    out = {
        "blocking_s_median": median(blocking), "blocking_s_p90": p90(blocking), "blocking_s_all": blocking,
        "persist_s_median": median(persist), "persist_s_all": persist,
        "bytes_per_rank": max(rank_bytes[-1]) if rank_bytes else None,
        "bytes_each_rank": rank_bytes[-1] if rank_bytes else None,
        "persist_MBps": median([b / t / 1e6 for b, t in zip(node_bytes, persist)]) if persist else None,
        # the background part alone (after the save call returned): what the persisting process achieves
        "persist_after_save_MBps": median([b / (t - s) / 1e6 for b, t, s in zip(node_bytes, persist, blocking)
                                           if t > s]) if persist and method.persists_async else None,
        "snapshot_bytes_per_rank": max(snap_all) if snap is not None else None,
        "fsync": method.family in ("pec", "torch_dist"),
        # one node: its agent's CPU time over the bytes every rank persisted in those saves
        "agent_cpu_s_per_GB": (cpu_after - cpu_before) / (sum(node_bytes) / 1e9)
        if cpu_before is not None and cpu_after is not None and sum(node_bytes) else None,
    }
    out["save_phases_s"] = median_phases(save_phases)
    out["agent_cpu_by_phase_s_per_save"] = ledger_per_save(ledger_before, ledger_after, len(blocking))
    if out["snapshot_bytes_per_rank"]:
        out["memcpy_floor_s"] = out["snapshot_bytes_per_rank"] / memcpy_Bps
    return out


def measure_throughput(ctx: Ctx, method, intervals: list[int], iters: int) -> dict:
    """Training throughput with a checkpoint every ``interval`` iterations (same iterations, same data),
    against training without, timed right before and right after."""
    skipped_before = method.skipped
    baseline_s = ctx.timed_train(iters)  # right before, so slow drifts of the machine's load cancel out
    elapsed_by_interval = {}
    for interval in intervals:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        last = None
        for k in range(1, iters + 1):
            ctx.train(1)
            if hasattr(method, "poll"):
                method.poll()
            if k % interval == 0:
                last = ctx.next_iteration()
                method.save(last)
        elapsed = reduce_max(time.perf_counter() - t0)
        if last is not None:
            method.wait_persisted(last)
        elapsed_by_interval[interval] = elapsed
    # ... and right after: a baseline slowed by something else (the previous method's agent still
    # deleting its files) would flatter the ratios; the faster of the two never does.
    baselines = [baseline_s, ctx.timed_train(iters)]
    baseline_s = min(baselines)
    out = {"baseline_s_per_iteration": baseline_s / iters, "baselines_s_per_iteration": [b / iters for b in baselines]}
    tput = {}
    for interval, elapsed in elapsed_by_interval.items():
        tput[str(interval)] = baseline_s / elapsed
        log(f"  {method.name}: checkpoint every {interval} it: {elapsed / iters * 1000:.0f} ms/it "
            f"(ratio {baseline_s / elapsed:.3f}; without checkpoints {baselines[0] / iters * 1000:.0f} ms/it "
            f"before, {baselines[1] / iters * 1000:.0f} after)")
    out["throughput_ratio_by_interval"] = tput
    out["train_throughput_ratio"] = tput.get("1")
    out["skipped_saves_in_throughput_runs"] = method.skipped - skipped_before
    return out


def ledger_per_save(before: dict | None, after: dict | None, saves: int) -> dict | None:
    """The persisting process's CPU seconds per save by phase between two ledgers (``agent/cpu_ledger.py``),
    the rest of its CPU time as "other"."""
    if not before or not after or not saves:
        return None
    phases = {name: (s - before["phases"].get(name, 0.0)) / saves for name, s in after["phases"].items()}
    phases["other"] = (after["process_s"] - before["process_s"]) / saves - sum(phases.values())
    return phases


def build_methods(ctx: Ctx, names: list[str], wait_for_slot: bool = True):
    """(key, factory) of each named method; ``wait_for_slot=False``: megatron-pec skips (and counts) a
    snapshot that finds no free region instead of waiting for one."""
    from benchmarks import methods as M

    root = lambda tag: os.path.join(ctx.storage_dir, tag)
    table = {
        "pec_all": lambda: M.Pec(ctx, root("pec_all"), None, None, "all", wait_for_slot=wait_for_slot),
        "pec_4": lambda: M.Pec(ctx, root("pec_4"), 4, 4, "k4"),
        "pec_2": lambda: M.Pec(ctx, root("pec_2"), 2, 2, "k2"),
        "pec_1": lambda: M.Pec(ctx, root("pec_1"), 1, 1, "k1"),
        "pec_4_1": lambda: M.Pec(ctx, root("pec_4_1"), 4, 1, "k4p1"),
        "torch_dist_sync": lambda: M.TorchDist(ctx, root("td_sync"), async_save=False),
        "torch_dist_async": lambda: M.TorchDist(ctx, root("td_async"), async_save=True),
        "legacy": lambda: M.Legacy(ctx, root("legacy")),
        "dlrover": lambda: M.DLRover(ctx, root("dlrover")),
        "megatron_local": lambda: M.MegatronLocal(ctx, root("megatron_local"),
                                                  os.path.join(ctx.shm_dir, "megatron_local")),
    }
    for n in names:
        if n not in table:
            raise SystemExit(f"unknown method {n!r}; known: {', '.join(table)}")
    return [(n, table[n]) for n in names]


def run_main(ctx: Ctx, b) -> dict:
    a = ctx.args
    ctx.train(b.warmup)  # Adam state exists from here on
    base1 = ctx.timed_train(b.iters)
    state_bytes = gather_objects(ctx.state_bytes())
    model = {"num_layers": a.num_layers, "hidden_size": a.hidden_size, "num_experts": a.num_experts,
             "moe_router_topk": a.moe_router_topk, "moe_ffn_hidden_size": a.moe_ffn_hidden_size or 4 * a.hidden_size,
             "seq_length": a.seq_length, "micro_batch_size": a.micro_batch_size,
             "global_batch_size": a.global_batch_size, "ep": a.expert_model_parallel_size,
             "dp": a.data_parallel_size, "world_size": ctx.world,
             "params_per_rank": gather_objects(ctx.param_count()),
             "optimizer_state_bytes_per_rank": max(state_bytes), "optimizer_state_bytes_each_rank": state_bytes}
    log(f"model: {json.dumps(model)}; baseline {base1 / b.iters * 1000:.0f} ms/it")
    mc = floors.memcpy_floor(os.path.join(ctx.shm_dir, "floor"), ctx.rank, max(state_bytes))
    mc["slices_memcpy_s"] = floors.slices_memcpy(mc["_map"], list(ctx.live_views().values()))
    mc["slices_count_per_rank"] = len(ctx.live_views())
    paths = [os.path.join(ctx.shm_dir, "floor", f"floor_rank{r}") for r in range(ctx.world)]
    wf = floors.storage_floors(os.path.join(ctx.storage_dir, "floor"), ctx.rank, ctx.world, paths)
    mc["_map"].close()
    os.unlink(mc.pop("_path"))
    mc.pop("_map")
    fl = {**mc, **wf}
    log(f"floors: memcpy {fl['memcpy_s'] * 1000:.1f} ms for {fl['memcpy_bytes_per_rank'] / 1e6:.0f} MB/rank "
        f"({fl['slices_memcpy_s'] * 1000:.1f} ms as {fl['slices_count_per_rank']} slices), "
        f"write+fsync {fl['write_MBps']:.0f} MB/s (one writer), {fl['write_MBps_parallel']:.0f} MB/s (per rank), "
        f"cold read {fl['read_MBps']:.0f} MB/s")
    memcpy_Bps = fl["memcpy_bytes_per_rank"] / fl["memcpy_s"]
    results, errors = {}, {}
    for key, make in build_methods(ctx, b.methods):
        method = make()
        log(f"method {method.name} (load {loadavg():.2f})")
        try:
            results[method.name] = {"key": key, **measure(ctx, method, b.saves, b.intervals, b.iters, base1,
                                                           memcpy_Bps)}
            r = results[method.name]
            log(f"  blocking {r['blocking_s_median'] * 1000:.1f} ms (p90 {r['blocking_s_p90'] * 1000:.1f}), "
                f"{(r['bytes_per_rank'] or 0) / 1e6:.1f} MB/rank, persist {r['persist_MBps'] or 0:.0f} MB/s, "
                f"restore mem {r['restore_memory_s']} s, storage {r['restore_storage_s']:.3f} s")
        except Exception as exc:  # a method that cannot run here is reported, the others still run
            traceback.print_exc()
            errors[method.name] = f"{type(exc).__name__}: {exc}"
            try:
                method.close()
                method.cleanup()
            except Exception:
                pass
    base2 = ctx.timed_train(b.iters)
    return {"model": model, "floors": fl, "methods": results, "errors": errors,
            "baseline_s_per_iteration": [base1 / b.iters, base2 / b.iters],
            "iterations_per_throughput_run": b.iters, "saves_measured": b.saves}


def run_scaling(ctx: Ctx, b) -> dict:
    """Blocking time and bytes per rank versus the number of experts at fixed compute (top-k and
    expert size fixed), for megatron-pec K=1 and full."""
    from benchmarks import methods as M

    points = []
    experts_list = [int(x) for x in b.experts.split(",")]
    for i, e in enumerate(experts_list):
        if i:
            ctx.free()
        ctx.args.num_experts = e
        ctx.build()
        ctx.train(b.warmup)
        base = ctx.timed_train(2) / 2
        state = max(gather_objects(ctx.state_bytes()))
        point = {"num_experts": e, "optimizer_state_bytes_per_rank": state, "step_s": base}
        for label, k in (("full", None), ("K=1", 1)):
            name = f"e{e}{'f' if k is None else 'k1'}"
            m = M.Pec(ctx, os.path.join(ctx.storage_dir, f"scal_e{e}_{label}"), k, k, name)
            m.setup()
            blocking, persist, nb = [], [], []
            for _ in range(b.saves):
                ctx.train(1)
                it = ctx.next_iteration()
                torch.distributed.barrier()
                t0 = time.perf_counter()
                m.save(it)
                tb = reduce_max(time.perf_counter() - t0)
                m.wait_persisted(it)
                tp = reduce_max(time.perf_counter() - t0)
                blocking.append(tb)
                persist.append(tp)
                nb.append(max(gather_objects(m.written_bytes(it))))
            snap = max(gather_objects(m.snapshot_bytes() or 0))
            m.close()
            m.cleanup()
            point[label] = {"blocking_s_median": median(blocking), "blocking_s_p90": p90(blocking),
                            "persist_s_median": median(persist), "bytes_per_rank": nb[-1],
                            "snapshot_bytes_per_rank": snap}
            log(f"scaling E={e} {label}: blocking {median(blocking) * 1000:.1f} ms, {nb[-1] / 1e6:.1f} MB/rank")
        points.append(point)
    return {"points": points, "hidden_size": ctx.args.hidden_size, "num_layers": ctx.args.num_layers,
            "moe_router_topk": ctx.args.moe_router_topk}


def parse(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if "--" in argv:
        i = argv.index("--")
        argv, model_argv = argv[:i], argv[i + 1:]
    else:
        model_argv = []
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=("main", "scaling", "schedule"), default="main",
                   help="schedule: every method on benchmarks/schedule.py's one schedule (benchmarks.gpu)")
    p.add_argument("--out", required=True)
    p.add_argument("--run-id", default=f"bench{os.getpid()}")
    p.add_argument("--methods", default="pec_all,pec_4,pec_2,pec_1,torch_dist_sync,torch_dist_async,legacy,dlrover")
    p.add_argument("--saves", type=int, default=5, help="measured saves per method (after one warm-up save)")
    p.add_argument("--iters", type=int, default=4, help="iterations per throughput run")
    p.add_argument("--intervals", default="1,4")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--experts", default="4,8,16,32")
    p.add_argument("--iters-persist-every-iteration", type=int, default=None,
                   help="schedule mode: iterations of the run that persists every iteration (default --iters)")
    p.add_argument("--memory-restores", type=int, default=MEMORY_RESTORES, help="schedule mode")
    p.add_argument("--storage-restores", type=int, default=STORAGE_RESTORES, help="schedule mode")
    p.add_argument("--floor-reps", type=int, default=3, help="schedule mode: repetitions of the storage floors")
    b = p.parse_args(argv)
    b.methods = [m for m in b.methods.split(",") if m]
    b.intervals = [int(x) for x in b.intervals.split(",")]
    return b, model_argv


def main(argv=None) -> int:
    import shutil

    b, model_argv = parse(argv)
    ctx = Ctx(b, model_argv)
    t0 = time.time()
    try:
        if b.mode == "schedule":
            from benchmarks.scheduled import run_schedule

            result = run_schedule(ctx, b, build_methods, log)
        else:
            result = run_main(ctx, b) if b.mode == "main" else run_scaling(ctx, b)
    finally:
        torch.distributed.barrier()
        if ctx.rank == 0:
            shutil.rmtree(ctx.shm_dir, ignore_errors=True)
            shutil.rmtree(ctx.storage_dir, ignore_errors=True)
    result["wall_s"] = time.time() - t0
    result["model_argv"] = model_argv
    if ctx.rank == 0:
        with open(b.out, "w") as f:
            json.dump(result, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
