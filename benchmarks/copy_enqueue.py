"""How long a snapshot's host is busy starting its device-to-host copies, against their number.

The stager (``megatron_pec/save/stager.py``) copies a snapshot with one ``torch._foreach_copy_(dst, src,
non_blocking=True)`` per copy call, one pair per run of slices contiguous on both sides; on a GPU every pair is
one asynchronous copy the host enqueues, so the host's time grows with the runs. Measured in the benchmark
worker on every rank before the methods run (each row is the slowest rank's; collective only in gathering):

* the example's runs: this rank's live optimizer state coalesced as the stager coalesces it (per item, slot
  order), copied run by run into page-locked host memory laid out like a slot;
* the same bytes cut into ``SWEEP`` equal runs, and into as many as one rank of DeepSeek-V3 at EP 64 has: it
  holds 58 x 256 / 64 = 232 experts (58 MoE layers of 256), each with as many runs as one of the example's
  experts, plus the example's dense runs. (The rank's real state, ~120 GB, fits neither memory: its copies
  are larger, so a queue of them drains more slowly than these.)

Per row the host time of the ``_foreach_copy_`` call (median of ``REPS``, after one left out), the time until
the copies have landed, and whether the host time passes ``BUDGET_S``. On CPU ranks there is no copy engine:
``_foreach_copy_`` copies synchronously, and the rows time memcpys into ordinary host memory (they say so).
"""

from __future__ import annotations

import contextlib
import time

import torch

from benchmarks.collective import gather_objects
from benchmarks.common import median, p90

REPS = 7
BUDGET_S = 0.5e-3  # beyond this the copies are to be coalesced or batched further
ALIGN = 64  # bytes between the starts of the copies in host memory (a slot's regions are aligned so)
DEEPSEEK_V3 = {"moe_layers": 58, "experts": 256, "ep": 64}
SWEEP = (64, 256, 1024, 4096)  # run counts of the example's bytes cut in equal runs (beside DeepSeek-V3's)


def item_runs(slices, live: dict) -> dict[str, list[torch.Tensor]]:
    """item -> the live views of its runs: its slices in slot order (``collect.slot_order``), consecutive ones
    that continue each other in memory merged, as the stager merges them (an item is contiguous in its region,
    so a run breaks where the live memory does)."""
    from megatron_pec.common.coalesce import coalesced
    from megatron_pec.megatron.collect import slot_order

    by_item: dict[str, list[torch.Tensor]] = {}
    for s in slot_order(slices):
        by_item.setdefault(s.item, []).append(live[s.name])
    return {item: coalesced(src, src)[1] for item, src in by_item.items()}


def deepseek_v3_runs(runs_by_item: dict[str, list], dense_item: str) -> dict:
    """One DeepSeek-V3 rank's runs at EP 64, counted from the 58 x 256 layout with the example's runs per expert
    (the most any of its experts has) and its dense runs."""
    experts = [len(runs) for item, runs in runs_by_item.items() if item != dense_item]
    per_expert = max(experts) if experts else 0
    dense = len(runs_by_item.get(dense_item, ()))
    experts_per_rank = DEEPSEEK_V3["moe_layers"] * DEEPSEEK_V3["experts"] // DEEPSEEK_V3["ep"]
    return {"runs": experts_per_rank * per_expert + dense, "experts_per_rank": experts_per_rank,
            "runs_per_expert": per_expert, "dense_runs": dense}


def equal_runs(nbytes: int, n: int, device) -> list[torch.Tensor]:
    """``n`` float32 runs of equal length, consecutive in one buffer of about ``nbytes`` on ``device``."""
    numel = max(1, nbytes // 4 // n)
    buffer = torch.empty(numel * n, dtype=torch.float32, device=device)
    return list(buffer.split(numel))


def host_views(srcs: list[torch.Tensor], pinned: bool) -> list[torch.Tensor]:
    """A view per source, of its dtype and length, in one host buffer (page-locked on a GPU), each start
    aligned to ``ALIGN`` bytes."""
    offsets, at = [], 0
    for t in srcs:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    host = torch.empty(max(at, ALIGN), dtype=torch.uint8, pin_memory=pinned)
    return [host[o:o + t.numel() * t.element_size()].view(t.dtype) for o, t in zip(offsets, srcs)]


def time_enqueue(srcs: list[torch.Tensor], cuda: bool, reps: int = REPS) -> dict:
    """Host seconds of ``torch._foreach_copy_(dst, src, non_blocking=True)`` from ``srcs`` into host memory (on a
    side stream on a GPU, as the stager copies), and seconds until the copies landed; medians of ``reps``."""
    dsts = host_views(srcs, pinned=cuda)
    stream = torch.cuda.Stream() if cuda else None
    enqueue, landed = [], []
    for rep in range(reps + 1):  # (the first is left out: allocator and driver warm-up)
        if cuda:
            torch.cuda.synchronize()
        with torch.no_grad(), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            started = time.perf_counter()
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            enqueued = time.perf_counter() - started
            if cuda:
                stream.synchronize()
            done = time.perf_counter() - started
        if rep:
            enqueue.append(enqueued)
            landed.append(done)
    nbytes = sum(t.numel() * t.element_size() for t in srcs)
    del dsts
    return {"runs": len(srcs), "bytes": nbytes, "bytes_per_run_median": median([t.numel() * t.element_size()
                                                                                 for t in srcs]),
            "enqueue_s_median": median(enqueue), "enqueue_s_p90": p90(enqueue), "enqueue_s_all": enqueue,
            "landed_s_median": median(landed), "over_budget": median(enqueue) > BUDGET_S}


def measure(ctx, reps: int = REPS) -> dict:
    """The rows, each the rank with the slowest enqueue: the example's runs, then the example's bytes in
    ``SWEEP`` equal runs and in as many as a DeepSeek-V3 EP 64 rank has."""
    from megatron_pec.format.item_names import NON_EXPERT
    from megatron_pec.megatron import collect

    live = ctx.live_views()
    runs = item_runs(collect.build_slices(ctx.model, ctx.optimizer), live)
    example_runs = [t for item_list in runs.values() for t in item_list]
    device = example_runs[0].device
    cuda = device.type == "cuda"
    timed = ("host time of enqueueing asynchronous device-to-host copies into page-locked memory (side stream)"
             if cuda else "memcpys: on CPU ranks _foreach_copy_ copies synchronously (no copy engine)")
    example = time_enqueue(example_runs, cuda, reps)
    example.update(what="the example's runs (this rank's state, coalesced as the stager does)",
                   items=len(runs), expert_items=sum(item != NON_EXPERT for item in runs))
    dsv3 = deepseek_v3_runs(runs, NON_EXPERT)
    mine = [example]
    for n in sorted({*SWEEP, dsv3["runs"]}):
        synthetic = equal_runs(example["bytes"], n, device)
        row = time_enqueue(synthetic, cuda, reps)
        del synthetic
        if n == dsv3["runs"]:
            row.update(what=f"DeepSeek-V3 at EP {DEEPSEEK_V3['ep']}: {dsv3['experts_per_rank']} experts x "
                            f"{dsv3['runs_per_expert']} runs + {dsv3['dense_runs']} dense (the example's bytes in "
                            "that many equal runs)", **dsv3)
        else:
            row.update(what="the example's bytes in that many equal runs")
        mine.append(row)
    if cuda:
        torch.cuda.empty_cache()
    rows = []
    for row, every in zip(mine, zip(*gather_objects(mine))):
        slowest = max(every, key=lambda r: r["enqueue_s_median"])
        rows.append({**row, **{k: slowest[k] for k in ("enqueue_s_median", "enqueue_s_p90", "enqueue_s_all",
                                                         "landed_s_median", "over_budget")}})
    return {"device": device.type, "timed": timed, "reps": reps, "budget_s": BUDGET_S, "rows": rows,
            "deepseek_v3_runs": dsv3["runs"], "enqueue_us_per_run": per_run(rows[1:])}


def per_run(rows: list[dict]) -> float | None:
    """Microseconds of enqueue each run adds, from the fewest runs to the most (the same bytes); None: one
    count."""
    a, b = min(rows, key=lambda r: r["runs"]), max(rows, key=lambda r: r["runs"])
    if a["runs"] == b["runs"]:
        return None
    return (b["enqueue_s_median"] - a["enqueue_s_median"]) / (b["runs"] - a["runs"]) * 1e6
