"""The restart after a planned exit, from node memory and from storage, on the example (2 simulated nodes).

    python -m benchmarks.restart_after_exit            # 3 repetitions per path, about 4 minutes
    python -m benchmarks.restart_after_exit --repeat 5 --hidden 256

Each repetition trains with snapshot-K 2 / persist-K 1 (a snapshot every iteration, a persist every 4)
and leaves at ``--exit-interval 7``; the exit saves 7 with every expert and the agents commit it. Then:

* from storage: the default, the agents remove node memory when every trainer has left;
* from node memory: ``--pec-keep-shm``, node memory outlives the agents for a restart on the same nodes.

The restart's own restore line (``restore took X s``, the slower rank) and the wall time from the
relaunch to that line, median over the repetitions. Writes ``benchmarks/results/restart_after_exit.json``
and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine
from megatron_pec.testing.cluster import SMALL_MODEL, Cluster

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
TRAIN = ["--train-iters", "10", "--save-interval", "4", "--non-persistent-save-interval", "1",
         "--pec-snapshot-k", "2", "--pec-persist-k", "1"]
RESTORE = re.compile(r"rank \d+: restore took ([0-9.]+) s")


def model(hidden: int) -> list[str]:
    args = list(SMALL_MODEL)
    args[args.index("--hidden-size") + 1] = str(hidden)
    return args


def one(workdir: Path, shm: Path, hidden: int, keep: bool, index: int) -> dict:
    c = Cluster(workdir / f"{'memory' if keep else 'storage'}{index}", shm, f"rx{int(keep)}{index}",
                model_args=model(hidden), script=EXAMPLE)
    extra = ["--pec-keep-shm"] if keep else []
    try:
        c.launch(TRAIN + extra + ["--exit-interval", "7"])
        if c.wait_exit(300) != {0: 0, 1: 0}:
            raise RuntimeError(f"the run before the exit failed:\n{c.logs()[-3000:]}")
        c.wait_agents_exited()
        started = time.monotonic()
        c.launch(TRAIN + extra)
        c.wait_log(r"restore took", timeout=300)
        c.wait_for(lambda: len(RESTORE.findall(c.logs())) == 2, 60, "both ranks' restore lines")
        wall = time.monotonic() - started
        if c.wait_exit(300) != {0: 0, 1: 0}:
            raise RuntimeError(f"the restart failed:\n{c.logs()[-3000:]}")
        restores = c.restores()
        sources = {x.source for x in restores.values()}
        iterations = {x.iteration for x in restores.values()}
        if iterations != {7} or any(x.older for x in restores.values()):
            raise RuntimeError(f"the restart restored {restores}, not 7 with every expert")
        return {"source": "+".join(sorted(sources)), "restore_s": max(float(t) for t in RESTORE.findall(c.logs())),
                "relaunch_to_restored_s": wall}
    finally:
        c.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256, help="the example's hidden size (default %(default)s)")
    p.add_argument("--json", default=str(RESULTS / "restart_after_exit.json"))
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="restart_after_exit_"))
    shm = Path("/dev/shm") / workdir.name
    runs = {"storage": [], "memory": []}
    try:
        for index in range(args.repeat):
            for keep in (False, True):
                r = one(workdir, shm, args.hidden, keep, index)
                runs["memory" if keep else "storage"].append(r)
                print(f"[restart_after_exit] {'memory' if keep else 'storage'} #{index + 1}: {r}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    table = {path: {"restored_from": sorted({r["source"] for r in rows}),
                    "restore_s_median": statistics.median(r["restore_s"] for r in rows),
                    "relaunch_to_restored_s_median": statistics.median(r["relaunch_to_restored_s"] for r in rows)}
             for path, rows in runs.items()}
    lines = ["| restart after a planned exit | restored from | restore (slower rank, median) | relaunch → restored "
             "(median) |", "|---|---|---|---|"]
    for path, t in table.items():
        lines.append(f"| {'--pec-keep-shm' if path == 'memory' else 'default'} | {', '.join(t['restored_from'])} | "
                     f"{t['restore_s_median'] * 1000:.0f} ms | {t['relaunch_to_restored_s_median']:.1f} s |")
    print("\n".join(lines))
    out = Path(args.json)
    out.write_text(json.dumps({"machine": machine(), "hidden": args.hidden, "repeat": args.repeat, "train": TRAIN,
                               "runs": runs, "table": table}, indent=1))
    out.with_suffix(".md").write_text(
        f"# Restart after a planned exit\n\n`python -m benchmarks.restart_after_exit --repeat {args.repeat} "
        f"--hidden {args.hidden}` (the example, 2 simulated nodes of one CPU rank each).\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
