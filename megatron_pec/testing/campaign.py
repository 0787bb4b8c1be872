"""The random fault campaign: ``python -m megatron_pec.testing.campaign --runs N [--seed S] [--out FILE]``.

Runs in a driver process on one machine, one simulated 2-node job at a time
(``megatron_pec.testing.cluster``). Each run draws a fault type, a fault point,
an iteration and a node from the seed, injects it (fault points through
``MEGATRON_PEC_FAULT``, random instants through SIGKILL from the harness, damage
by editing files), restarts the job when it died, and checks what the
architecture's invariants promise:

* the job finishes (a wait that runs out is counted as a hang);
* restarts restore the newest valid iteration, from node memory or storage as
  the invariant says, losing at most one snapshot interval after a trainer kill;
* with every expert saved, every loss logged equals the uninterrupted
  reference run's loss at that iteration (bit-exact resume); with PEC the PLT
  is logged and below what a storage-only restore would cost after a node loss;
* nothing partial or corrupt is accepted: ``verify`` passes at the end, the
  tracker names a committed iteration, a damaged iteration is never restored.

Prints a table per fault type and writes every run's record as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from megatron_pec.testing import object_store_fault
from megatron_pec.testing.cluster import Cluster, ClusterTimeout
from megatron_pec.testing.fault_scenarios import (
    AGENT_POINTS,
    DAMAGE,
    DEFAULT_SCRIPT,
    FULL_ITERS,
    PEC_ITERS,
    PEC_SNAPSHOT_INTERVAL,
    SCENARIOS,
    TRAINER_POINTS,
    TYPES,
    Bench,
    Failure,
    Reference,
    can_mount,
)


class Campaign:
    def __init__(self, workdir: Path, shm: Path, seed: int, script: Path, keep_failed: bool = True):
        self.workdir, self.shm, self.rng, self.script = workdir, shm, random.Random(seed), script
        self.keep_failed = keep_failed
        self.types = [t for t in TYPES if (t != "storage_full" or can_mount())  # (what this machine can run)
                      and (t != "object_store_crash" or object_store_fault.available())]
        self.bench: Bench | None = None  # (after ``prepare``)

    # ---- set-up ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The uninterrupted reference run (losses, and a checkpoint directory to damage): the pytest fault
        tests' reference too (``fault_scenarios.Reference``)."""
        reference = Reference.run(self.workdir / "reference", self.shm, "fcref", self.script)
        self.bench = Bench(reference, self.script, self.rng)  # (one generator: a seed replays draws and damage)

    def draw(self) -> dict:
        kind = self.rng.choice(self.types)
        node = self.rng.randrange(2)
        spec = {"type": kind, "node": node}
        if kind == "trainer_kill_point":
            spec["config"] = self.rng.choice(["full", "pec"])
            spec["point"] = self.rng.choice(TRAINER_POINTS)
            iters, interval = (FULL_ITERS, 1) if spec["config"] == "full" else (PEC_ITERS, PEC_SNAPSHOT_INTERVAL)
            if spec["point"] == "optimizer_step":
                spec["iteration"] = self.rng.randrange(2, iters)
                spec["nth"] = spec["iteration"]
            else:
                spec["nth"] = self.rng.randrange(1, (iters - 1) // interval + 1)
                spec["iteration"] = spec["nth"] * interval
        elif kind == "trainer_kill_random":
            spec["config"] = self.rng.choice(["full", "pec"])
            iters = FULL_ITERS if spec["config"] == "full" else PEC_ITERS
            spec["iteration"] = self.rng.randrange(1, iters - 1)
            spec["delay_s"] = round(self.rng.uniform(0.0, 0.25), 3)
        elif kind == "agent_kill_point":
            spec["point"] = self.rng.choice(AGENT_POINTS)
            # n-th time the point is reached in one agent process (chunks, for persist_write)
            spec["nth"] = self.rng.randrange(1, {"agent_recorded": 11, "persist_write": 9, "before_rename": 4,
                                                 "before_node_marker": 4}.get(spec["point"], 3))
        elif kind == "agent_kill_random":
            spec["iteration"] = self.rng.randrange(1, FULL_ITERS - 1)
            spec["delay_s"] = round(self.rng.uniform(0.0, 0.25), 3)
        elif kind == "node_loss":
            # drawn like a random trainer kill under PEC, so the two PLT distributions compare
            spec["iteration"] = self.rng.randrange(1, PEC_ITERS - 1)
        elif kind in ("replica_holder_kill", "replica_link_drop"):
            spec["nth"] = self.rng.randrange(1, FULL_ITERS - 3)  # the holder's n-th replica transfer
            spec["iteration"] = self.rng.randrange(spec["nth"] + 2, FULL_ITERS)
        elif kind in ("replica_corrupt", "two_nodes_lost"):
            spec["iteration"] = self.rng.randrange(2, FULL_ITERS)
            spec["offset_fraction"] = round(self.rng.random(), 4)
        elif kind == "storage_error":
            spec["action"] = self.rng.choice(["enospc", "eio"])
            spec["point"] = self.rng.choice(["persist_write", "before_rename"])
            # Each agent's first write and rename publish its replication address: start at the second.
            spec["nth"] = self.rng.randrange(2, 8 if spec["point"] == "persist_write" else 5)
        elif kind == "storage_full":
            spec["size_mib"] = self.rng.randrange(6, 40)
        elif kind == "planned_exit":
            # Megatron's --exit-interval between persists (every 2), the snapshot partial (K of 4 per rank)
            spec["exit"] = self.rng.randrange(3, FULL_ITERS, 2)
            spec["k"] = self.rng.randrange(1, 4)
        elif kind == "relaunch_finished":
            spec["k"], spec["relaunch_k"] = self.rng.randrange(1, 4), self.rng.randrange(1, 5)
        elif kind == "restart_during_persist":
            spec["nth"] = self.rng.randrange(2, 6)  # the agent's n-th rename stalls; the trainers die meanwhile
        elif kind == "slow_replica_node_loss":
            spec["nth"] = self.rng.randrange(2, FULL_ITERS - 4)  # the holder's n-th replica transfer stalls
        elif kind == "object_store_crash":
            spec.update(object_store_fault.draw(self.rng))
        elif kind == "corruption":
            newest = range(FULL_ITERS, FULL_ITERS - 2 * self.rng.randrange(1, 3), -2)
            spec["damage"] = [(i, self.rng.choice(DAMAGE)) for i in newest]
            spec["stale_tracker"] = self.rng.random() < 0.3
        return spec

    # ---- one run ---------------------------------------------------------------------------------
    def run(self, index: int, spec: dict) -> dict:
        result = dict(spec, run=index, fired=False, recovered=False, hang=False, resumed_from=None,
                      restored_iteration=None, reached_iteration=None, iterations_lost=None, plt=None,
                      failure=None)
        workdir = self.workdir / f"run{index:04d}"
        c = Cluster(workdir, self.shm, f"fc{index:04d}", save=workdir / "checkpoints", script=self.script)
        start = time.monotonic()
        try:
            SCENARIOS[spec["type"]](self.bench, c, spec, result)
            result["recovered"] = True
        except ClusterTimeout as exc:
            result["hang"], result["failure"] = True, f"hang: {str(exc).splitlines()[0]}"
        except Failure as exc:
            result["failure"] = str(exc)
        except Exception as exc:  # the harness itself broke: count it, keep going
            result["failure"] = f"harness error: {type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()
        finally:
            c.close()  # (which keeps the agents' own logs in the run's directory, for the post-mortem)
            for mount in result.pop("_mounts", []):
                subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        result["wall_s"] = round(time.monotonic() - start, 1)
        if result["recovered"] or not self.keep_failed:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            result["logs"] = str(workdir)
        return result


# ---- report ------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict[str, dict]:
    table = {}
    for kind in TYPES:
        rows = [r for r in runs if r["type"] == kind]
        if not rows:
            continue
        lost = [r["iterations_lost"] for r in rows if r["iterations_lost"] is not None]
        plts = [r["plt"] for r in rows if r.get("plt") is not None]
        sources: dict[str, int] = {}
        for r in rows:
            if r["resumed_from"]:
                sources[r["resumed_from"]] = sources.get(r["resumed_from"], 0) + 1
        table[kind] = {
            "runs": len(rows), "fired": sum(bool(r["fired"]) for r in rows),
            "recovered": sum(r["recovered"] for r in rows), "resumed_from": sources,
            "lost_median": statistics.median(lost) if lost else None, "lost_max": max(lost) if lost else None,
            "plt_median": statistics.median(plts) if plts else None, "plt_max": max(plts) if plts else None,
            "failures": sum(not r["recovered"] for r in rows), "hangs": sum(r["hang"] for r in rows),
        }
    return table


def plt_comparison(runs: list[dict]) -> dict:
    """Node-loss PLT against a trainer crash under PEC: medians, and pairs restoring the same iteration.

    A memory restore of iteration N rebuilds the same expert versions whoever died, so a node loss
    restored from peer memory should cost exactly what a trainer crash restored at N costs."""
    def pec_rows(kinds):
        return [r for r in runs if r["type"] in kinds and r["recovered"] and r.get("plt") is not None
                and r.get("config", "pec") == "pec"]
    losses, crashes = pec_rows(("node_loss",)), pec_rows(("trainer_kill_point", "trainer_kill_random"))
    crash_at = {}
    for r in crashes:
        if r["resumed_from"] == "memory":
            crash_at.setdefault(r["restored_iteration"], set()).add(round(r["plt"], 6))
    paired = [(r, crash_at[r["restored_iteration"]]) for r in losses if r["restored_iteration"] in crash_at]
    median = lambda rows: statistics.median(r["plt"] for r in rows) if rows else None
    return {"node_loss_median": median(losses), "node_loss_runs": len(losses),
            "trainer_crash_median": median(crashes), "trainer_crash_runs": len(crashes),
            "pairs": len(paired), "pairs_equal": sum(round(r["plt"], 6) in plts for r, plts in paired),
            "pairs_higher": sum(round(r["plt"], 6) > max(plts) for r, plts in paired)}


def format_plt_comparison(c: dict) -> str:
    if c["node_loss_median"] is None or c["trainer_crash_median"] is None:
        return "PLT, node loss vs trainer crash (PEC): not enough runs of both types to compare"
    return (f"PLT, node loss vs trainer crash (PEC): median {100 * c['node_loss_median']:.2f}% "
            f"({c['node_loss_runs']} runs) vs {100 * c['trainer_crash_median']:.2f}% ({c['trainer_crash_runs']} runs); "
            f"restoring the same iteration: {c['pairs_equal']} of {c['pairs']} node losses cost exactly a trainer "
            f"crash's PLT, {c['pairs_higher']} more")


def format_skips(runs: list[dict]) -> str:
    hit = [r for r in runs if r.get("skipped_snapshots")]
    return (f"Trainer kills after a skipped snapshot (no free slot, warned; iterations lost counted from the newest "
            f"snapshot taken): {len(hit)} of {sum(r['type'].startswith('trainer_kill') for r in runs)}")


def format_table(table: dict[str, dict]) -> str:
    head = ("fault type", "runs", "fired", "recovered", "resumed from", "iters lost med/max", "PLT med/max",
            "failures", "hangs")
    rows = []
    for kind, t in table.items():
        src = ", ".join(f"{k} {v}" for k, v in sorted(t["resumed_from"].items()))
        lost = "-" if t["lost_median"] is None else f"{t['lost_median']:g} / {t['lost_max']}"
        plt = "-" if t["plt_median"] is None else f"{100 * t['plt_median']:.2f}% / {100 * t['plt_max']:.2f}%"
        rows.append((kind, t["runs"], t["fired"], t["recovered"], src, lost, plt, t["failures"], t["hangs"]))
    total = [sum(t[k] for t in table.values()) for k in ("runs", "fired", "recovered", "failures", "hangs")]
    rows.append(("total", total[0], total[1], total[2], "", "", "", total[3], total[4]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def main(argv=None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    types = [t for t in a.types.split(",") if t]
    unknown = set(types) - set(TYPES)
    if unknown:
        p.error(f"unknown fault types {sorted(unknown)}")
    if not os.path.isfile(a.script):
        p.error(f"training script {a.script} not found: run from a megatron-pec checkout or pass --script PATH")
    workdir, shm = Path(a.workdir), Path(a.shm_dir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    shm.mkdir(parents=True, exist_ok=True)
    campaign = Campaign(workdir, shm, a.seed, Path(a.script))
    started = time.time()
    command = "python -m megatron_pec.testing.campaign " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    print(f"megatron-pec fault campaign: {a.runs} runs, seed {a.seed}; reference run ...", flush=True)
    runs: list[dict] = []
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.cpu_hog)]
    try:
        campaign.prepare()
        while len(runs) < a.runs:
            spec = campaign.draw()
            if spec["type"] not in types:
                continue
            r = campaign.run(len(runs) + 1, spec)
            runs.append(r)
            detail = {k: v for k, v in spec.items() if k not in ("type",)}
            status = "ok" if r["recovered"] else f"FAILED: {r['failure']}"
            print(f"[{len(runs):4d}/{a.runs}] {spec['type']:<20} {json.dumps(detail)} -> {r['resumed_from']}, "
                  f"lost {r['iterations_lost']}, PLT {r['plt']}, {r['wall_s']}s: {status}", flush=True)
            _write(a.out, command, a.seed, started, runs, a.cpu_hog)
    finally:
        for hog in hogs:
            hog.kill()
        shutil.rmtree(shm, ignore_errors=True)
    _report(a, command, started, runs)
    return 0 if all(r["recovered"] for r in runs) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_pec.testing.campaign",
                                description="Random fault injection against a simulated 2-node CPU job.")
    p.add_argument("--runs", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="fault_campaign.json", help="JSON results (default %(default)s)")
    p.add_argument("--markdown", default=None, help="also write the table as a Markdown report here")
    p.add_argument("--workdir", default="/tmp/megatron_pec_campaign",
                   help="per-run directories, wiped at start (failed runs are kept for inspection)")
    p.add_argument("--shm-dir", default="/dev/shm/fault_helper/campaign",
                   help="node memory root (each run uses <dir>/<job id>/)")
    p.add_argument("--types", default=",".join(TYPES), help="comma-separated subset of: " + ", ".join(TYPES))
    p.add_argument("--script", default=DEFAULT_SCRIPT,
                   help="the training script every run launches (default: %(default)s, from a megatron-pec checkout)")
    p.add_argument("--cpu-hog", type=int, default=0, metavar="N",
                   help="N busy-looping processes share the machine for the whole campaign (timing under load)")
    return p


def _report(a, command: str, started: float, runs: list[dict]) -> None:
    """The tables on stdout, the JSON results and, with --markdown, the report."""
    print(format_table(summarize(runs)))
    print(format_plt_comparison(plt_comparison(runs)))
    print(format_skips(runs))
    _write(a.out, command, a.seed, started, runs, a.cpu_hog)
    print(f"results: {a.out}")
    if a.markdown:
        with open(a.out) as f:
            Path(a.markdown).write_text(markdown(json.load(f)))
        print(f"report: {a.markdown}")


def markdown(data: dict) -> str:
    """The campaign results as a short Markdown report (the table plus what each column means)."""
    runs = data["runs"]
    failed = [r for r in runs if not r["recovered"]]
    lines = [
        "# Fault-injection campaign", "",
        f"Command (from the repository root, `.venv` active, `OMP_NUM_THREADS=1`): `{data['command']}`", "",
        f"Run {data['started']} on {data['machine']}, {data['duration_s'] // 60} min for {len(runs)} runs "
        f"(seed {data['seed']}{_hogs(data.get('cpu_hog', 0))}). Raw records: `fault_campaign.json` (one per run: "
        "the fault drawn, what the restart restored from where, iterations lost, PLT, and the failure if any).", "",
        data["table"], "",
        format_plt_comparison(data["plt_comparison"]) + ".", "",
        format_skips(runs) + ".", "",
        "* **fired**: the injected fault really happened (the fault point was reached, the process was killed, "
        "the file damaged). **recovered**: the job finished and every check of its fault type passed. "
        "**resumed from**: where the restart restored from (`memory`, `peer memory (node K)` for a lost node's "
        "ranks restored from their replica, `storage`, joined by `+` when ranks differ, or `continued` when "
        "training never stopped). **iters lost**: iterations completed before the fault and "
        "done again after the restart (the iteration in flight at the kill is not counted). **PLT**: portion "
        "of lost expert-token work logged by the restart (PEC runs only; 0 with every expert saved).",
        "* Every run: a simulated 2-node job (2 `torchrun` launches, one rank each, EP=2, DP=2, gloo on CPU), "
        "`full` = every expert saved, memory snapshot every iteration, persisted every 2 (12 iterations); "
        "`pec` = snapshot-K 1 of 8 experts per layer every 2 iterations, persist-K 1 every 4 (16 iterations). "
        "Every snapshot is replicated to the other node's agent (the default on more than one node). Replica "
        "faults: `replica_holder_kill` (the holder's agent SIGKILLed mid-transfer, then the node lost), "
        "`replica_link_drop` (an I/O error on the holder's side of the transfer, then the node lost), "
        "`replica_corrupt` (the node lost and a byte of its only replica flipped), `two_nodes_lost`. Planned "
        "exits and relaunches: `planned_exit` (`--exit-interval` at an odd iteration, between persists, snapshot-K "
        "1-3 of 4 per rank, persist-K 1: the exit saves that iteration with every expert, the restart restores it "
        "from storage with PLT 0 and resumes bit-exactly), `relaunch_finished` (the finished job launched again "
        "with another K: it restores the last iteration whole, trains nothing, and no committed file changes), "
        "`restart_during_persist` (the node's trainer SIGKILLed while its agent's rename stalls 3 s), "
        "`slow_replica_node_loss` (the replica holder stalls 3 s mid-transfer and the node is lost meanwhile: "
        "at most `--pec-replica-lag` + 1 snapshot intervals lost when the replica serves).",
        "* Checks per run: bounded waits (a wait that runs out is a hang); the restart restores the newest "
        "valid iteration on every rank from the expected source; a trainer kill loses at most one snapshot "
        "interval; with every expert saved each loss logged after a resume equals the uninterrupted "
        "reference run's loss at that iteration (exact float equality); after a node loss the lost node's ranks "
        "restore from their replica in the survivor's memory or, when no sound replica is left, from storage "
        "(never from a damaged replica), and when the restore is the persisted iteration its PLT is at most what "
        "a storage-only restore would cost; `python -m megatron_pec verify` passes at the end, the "
        "tracker names a committed iteration, an iteration whose persist failed is never committed, and a "
        "damaged iteration is never restored.",
    ]
    if failed:
        lines += ["", "## Failures", ""] + [f"* run {r['run']} ({r['type']}): {r['failure']}" for r in failed]
    return "\n".join(lines) + "\n"


def _hogs(n: int) -> str:
    return f"; {n} busy-looping process{'es' if n > 1 else ''} sharing the machine throughout" if n else ""


def _write(path: str, command: str, seed: int, started: float, runs: list[dict], cpu_hog: int = 0) -> None:
    data = {"command": command, "seed": seed, "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "duration_s": round(time.time() - started), "machine": f"{os.cpu_count()} CPU cores, CPU-only (gloo)",
            "cpu_hog": cpu_hog,
            "summary": summarize(runs), "plt_comparison": plt_comparison(runs),
            "table": format_table(summarize(runs)) if runs else "", "runs": runs}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
