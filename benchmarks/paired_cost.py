"""A snapshot's cost on the training step, measured within one run (benchmarks.gpu).

Comparing a run with snapshots against a run without them cannot resolve a few percent where the step
itself drifts between runs: on an H200 the example's step is bound by the training thread's CPU time, and
that moved by ±10% from one run to the next (``benchmarks/results/gpu_session_h200.log``). Here one run
snapshots every ``EVERY`` iterations: a snapshot's cost is its save's blocking plus the step after it (which
its copy overlaps) over the mean of the steps on either side of that one (the snapshot's own step, before its
save, and the next), so a drift over the run cancels (a linear one exactly). Its cost over the clean step is
the overhead a snapshot every iteration would add if each snapshot costs the same (its copy fits within a
step: ``EVERY`` leaves the step after the next one clean too). Work a snapshot spreads over several later
steps (the node agent's, on the node's cores) slows the clean steps as well: where the host's cores are
short (a 2-core CPU stand-in) this is a lower bound, and the run with a snapshot every iteration is not."""

from __future__ import annotations

import statistics

EVERY = 4  # a snapshot every 4th iteration: between two, the step its copy overlaps and clean ones
FLAGS = ["--non-persistent-save-interval", str(EVERY), "--save-interval", "1000000"]  # (memory only)


def paired_cost(rows: list[dict], warmup: int) -> dict | None:
    """From the example's metrics rows (``iteration``, ``step_s``, ``save_blocking_s`` on the iterations that
    saved): per snapshot after ``warmup`` whose own step and the two after it were recorded, its cost in
    seconds; the medians of the costs and of the clean steps beside them, and their ratio. None without such
    a snapshot."""
    steps = {r["iteration"]: r["step_s"] for r in rows if r.get("step_s") is not None}
    costs, clean = [], []
    for r in rows:
        i, blocking = r.get("iteration"), r.get("save_blocking_s")
        if blocking is None or i is None or i <= warmup or any(i + k not in steps for k in range(3)):
            continue
        clean_step = (steps[i] + steps[i + 2]) / 2  # (either side of the step the copy overlaps)
        costs.append(blocking + steps[i + 1] - clean_step)
        clean.append(clean_step)
    if not costs:
        return None
    cost, step = statistics.median(costs), statistics.median(clean)
    return {"every": EVERY, "snapshots": len(costs), "cost_s_median": cost, "clean_step_s_median": step,
            "overhead": cost / step, "costs_s": costs}


def markdown(paired: dict | None, label: str) -> list[str]:
    if not paired:
        return []
    return [f"* {label}, paired within one run (a snapshot every {paired['every']}th iteration, node memory only: its "
            "blocking plus the step after it, against the steps on either side of that one): "
            f"{paired['cost_s_median'] * 1e3:.1f} ms a snapshot, {paired['overhead'] * 100:+.1f}% of the clean step "
            f"({paired['clean_step_s_median'] * 1e3:.1f} ms; median of {paired['snapshots']} snapshots): "
            "the overhead a snapshot every iteration adds, without the drift between runs "
            "(work spread over later steps, the node agent's, "
            "is in the clean steps too: a lower bound where the host's cores are short)."]
