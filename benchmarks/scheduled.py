"""Every method on the one schedule (``benchmarks/schedule.py``): the benchmark worker's rows of
``python -m benchmarks.gpu``. Runs in the worker (``--mode schedule``) on every rank; every function is
collective.

Per method and schedule: the step overhead against training without checkpoints, as the example trainer's
rows count it: the median iteration (training and the checkpoint it takes) over the median iteration without
checkpoints (the faster of a run right before and one right after, same iterations); beside it the mean over
the run, persists included. The blocking time of every checkpoint taken (median, p90; persists
apart), the checkpoints the method skipped, the node memory it holds afterwards. Per method: restores from node
memory (where it has that tier) and from storage (``restores.py``). Before the methods, how long enqueueing the
device-to-host copies of a snapshot takes against their number (``copy_enqueue.py``).
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from benchmarks import copy_enqueue, floors
from benchmarks.collective import gather_objects, reduce_max
from benchmarks.common import median, p90
from benchmarks.restores import measure_restores
from benchmarks.schedule import PERSIST, PERSIST_EVERY, Schedule, schedules


def run_schedule(ctx, b, build_methods, log) -> dict:
    """Storage floors, then every method of ``b.methods`` on its schedules: {"rows": {row name: row}, ...}."""
    ctx.train(b.warmup)  # Adam state exists from here on
    state = max(gather_objects(ctx.state_bytes()))
    fl = storage_floors(ctx, state, b.floor_reps)
    log(f"optimizer state {state / 1e6:.0f} MB/rank; storage: write+fsync {fl['write_MBps']:.0f} MB/s, "
        f"cold read {fl['read_MBps']:.0f} MB/s (one writer/reader)")
    rows, errors = {}, {}
    try:
        enqueue = copy_enqueue.measure(ctx)
        for row in enqueue["rows"]:
            log(f"copy enqueue: {row['runs']} runs ({row['what']}): {_ms(row['enqueue_s_median'])} ms")
    except Exception as exc:  # (the methods' rows still come)
        traceback.print_exc()
        enqueue, errors["copy enqueue"] = None, f"{type(exc).__name__}: {exc}"
    for _, make in build_methods(ctx, b.methods, wait_for_slot=False):
        method = make()
        log(f"method {method.name}")
        try:
            rows.update(measure_method(ctx, method, b, log))
        except Exception as exc:  # a method that cannot run here is reported, the others still run
            traceback.print_exc()
            errors[method.name] = f"{type(exc).__name__}: {exc}"
            try:
                method.close()
                method.cleanup()
            except Exception:
                pass
    return {"floors": fl, "optimizer_state_bytes_per_rank": state, "persist_every": PERSIST_EVERY,
            "copy_enqueue": enqueue, "rows": rows, "errors": errors}


def storage_floors(ctx, nbytes: int, reps: int) -> dict:
    """The write and cold-read floors of the storage for a node's bytes (``floors.storage_floors``)."""
    shm = os.path.join(ctx.shm_dir, "floor")
    mc = floors.memcpy_floor(shm, ctx.rank, nbytes, reps=1)  # (its tmpfs file is what the writer streams)
    paths = [os.path.join(shm, f"floor_rank{r}") for r in range(ctx.world)]
    try:
        return floors.storage_floors(os.path.join(ctx.storage_dir, "floor"), ctx.rank, ctx.world, paths, reps)
    finally:
        mc["_map"].close()
        os.unlink(mc["_path"])


def row_name(method, schedule: Schedule) -> str:
    strategy = getattr(method, "async_strategy", None)
    name = method.name + (f" ({strategy or 'mcore'})" if getattr(method, "async_save", False) else "")
    return name if method.has_memory else f"{name}, {schedule.label}"


def run_length(schedule: Schedule, b) -> int:
    """Iterations of one run: ``b.iters``, or fewer where every iteration persists (a slow storage-only
    method would take most of the time budget)."""
    if schedule.persist_every == 1 and b.iters_persist_every_iteration:
        return b.iters_persist_every_iteration
    return b.iters


def measure_method(ctx, method, b, log) -> dict[str, dict]:
    t = time.perf_counter()
    method.setup()
    setup_s = reduce_max(time.perf_counter() - t)
    rows = {}
    for schedule in schedules(method.has_memory):
        row = run_on_schedule(ctx, method, schedule, run_length(schedule, b))
        row["setup_s"] = setup_s
        rows[row_name(method, schedule)] = row
        log(f"  {row_name(method, schedule)}: step overhead {row['step_overhead'] * 100:+.1f}% (median; mean "
            f"{row['step_overhead_mean'] * 100:+.1f}%), blocking "
            f"{_ms(row['blocking_s_median'])} ms (p90 {_ms(row['blocking_s_p90'])}), skipped {row['skipped']} of "
            f"{row['checkpoints']}, node memory {_mb(row['node_memory_bytes'])} MB")
    restores = measure_restores(ctx, method, b.memory_restores, b.storage_restores)
    log(f"  restores: from memory {restores['restore_memory_s']} s, from storage {restores['restore_storage_s']} s")
    for row in rows.values():
        row.update(restores)
    method.close()
    method.cleanup()
    return rows


def run_on_schedule(ctx, method, schedule: Schedule, iters: int) -> dict:
    skipped_before = method.skipped
    before = timed_steps(ctx, iters)
    saves, persisted = [], None  # saves: (action, seconds blocked, taken) of every checkpoint, this rank's
    steps = []  # this rank's seconds of each iteration: training and the checkpoint it takes
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for k in range(1, iters + 1):
        started = time.perf_counter()
        ctx.train(1)
        it = ctx.next_iteration()  # (the job's iteration number, what a checkpoint is saved as)
        if hasattr(method, "poll"):
            method.poll()
        action = schedule.action(k)
        if action is not None:
            saving = time.perf_counter()
            taken = method.save(it) if action == PERSIST else method.snapshot(it)
            saves.append((action, time.perf_counter() - saving, taken))
            persisted = it if taken and action == PERSIST else persisted
        steps.append(time.perf_counter() - started)
    elapsed = reduce_max(time.perf_counter() - t0)
    if persisted is not None:
        method.wait_persisted(persisted)
    after = timed_steps(ctx, iters)
    steps = slowest_steps(gather_objects(steps))
    blocked, persists = slowest_saves(gather_objects(saves))
    node_memory = gather_objects(method.node_memory_bytes())
    without = min(median(before), median(after))
    return {
        "family": method.family, "schedule": schedule.label, "checkpoint_every": schedule.checkpoint_every,
        "persist_every": schedule.persist_every, "iterations": iters, "checkpoints": len(saves),
        "skipped": max(gather_objects(method.skipped - skipped_before)),
        "step_s_without_checkpoints": [median(before), median(after)], "step_s": median(steps),
        "step_overhead": median(steps) / without - 1,
        # (the run's mean, persists included, against the faster run without checkpoints)
        "step_s_mean": elapsed / iters, "step_overhead_mean": elapsed / min(sum(before), sum(after)) - 1,
        "blocking_s_median": median(blocked), "blocking_s_p90": p90(blocked), "blocking_s_all": blocked,
        "persist_blocking_s_median": median(persists),
        "node_memory_bytes": None if None in node_memory else sum(node_memory),
        "node_memory_what": method.node_memory_why,
        "async_strategy": getattr(method, "async_strategy", None) if getattr(method, "async_save", False) else None,
    }


def timed_steps(ctx, n: int) -> list[float]:
    """Seconds of each of ``n`` iterations without checkpoints (per iteration, the slowest rank's)."""
    torch.distributed.barrier()
    mine = []
    for _ in range(n):
        started = time.perf_counter()
        ctx.train(1)
        mine.append(time.perf_counter() - started)
    return slowest_steps(gather_objects(mine))


def slowest_steps(every_rank: list[list[float]]) -> list[float]:
    """Per iteration, the slowest rank's seconds (the one the others wait for in the next collective)."""
    return [max(per_rank) for per_rank in zip(*every_rank)]


def slowest_saves(every_rank: list[list[tuple]]) -> tuple[list[float], list[float]]:
    """Per checkpoint every rank took, the slowest rank's blocking seconds: (all of them, the persists')."""
    blocked, persists = [], []
    for per_rank in zip(*every_rank):
        if all(taken for _, _, taken in per_rank):
            seconds = max(s for _, s, _ in per_rank)
            blocked.append(seconds)
            if per_rank[0][0] == PERSIST:
                persists.append(seconds)
    return blocked, persists


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.1f}" if seconds is not None else "-"


def _mb(nbytes) -> str:
    return f"{nbytes / 1e6:.0f}" if nbytes is not None else "-"
