"""PLT versus model quality: the example GPT-MoE on the real text dataset, with faults injected at
fixed iterations, restored by megatron-pec, compared with fault-free training.

    python -m benchmarks.quality            # ~15 minutes on 2 cores
    python -m benchmarks.quality --iters 300 --seeds 1234,4321,777   # longer, more seeds

Every configuration trains ``examples/gpt_moe/pretrain_gpt_moe.py`` under torchrun with the same
seed and data order. A fault is a SIGKILL of both trainers at the snapshot of iteration X
(``MEGATRON_PEC_FAULT=snapshot_end=kill@n``); the job is relaunched with the same ``--load`` and
resumes from node memory. A node-memory loss additionally kills the node agent and deletes
``<shm dir>/<job id>/node0/``, so the restart restores from storage. Compared: fault-free runs
(several seeds: the noise), a full checkpoint (K = all), PEC K=1 and K=2 with checkpoint
intervals 1 and 8, each selection policy, and Dynamic-K. Output: JSON, markdown table and plots
(loss curves with fault markers; final validation loss versus PLT) in ``benchmarks/results/``.

    python -m benchmarks.quality --node-loss --iters 300 --seeds 1234,4321,777   # ~40 minutes

``--node-loss`` runs the same model as two simulated nodes (one rank each, ``torchrun --nnodes 2``,
every snapshot replicated to the other node's agent). A fault there is a node loss: once rank 0
reports the iteration, one node's trainer and agent are SIGKILLed and its node memory deleted; the
restart restores the lost node's rank from its replica in the other node's memory. The lost node
alternates. Output: ``quality_node_loss.{json,md}`` and its plots.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

from benchmarks.common import REPO, RESULTS, SHM_ROOT, STORAGE_ROOT, loadavg, machine, wait_for_quiet
from megatron_pec.testing import launch

PRETRAIN = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "8",
         "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--log-interval", "25"]
VAL_RE = re.compile(r"validation loss at (?:iteration (\d+)|the end of training) \| lm loss: ([0-9.eE+-]+)")
RESTORE_RE = re.compile(r"restored iteration (\d+) from (memory|storage|peer memory \(node \d+\))")
KILL_RE = re.compile(r"fault injection: kill at snapshot_end \{'iteration': (\d+)\}")


def configs(several: list[int], single: list[int]) -> list[dict]:
    """(name, PEC flags, checkpoint interval, faults); a fault is (iteration, lose node memory)."""
    many = [(x, i == 1) for i, x in enumerate(several)]  # the second fault also loses node memory
    one = [(x, False) for x in single]
    c = [
        {"name": "PEC K=1 I=1, 1 fault", "k": 1, "interval": 1, "faults": one},
        {"name": "PEC K=2 I=1, 1 fault", "k": 2, "interval": 1, "faults": one},
        {"name": "PEC K=4 I=1, 1 fault", "k": 4, "interval": 1, "faults": one},
        {"name": "full checkpoint, 3 faults", "k": None, "interval": 1, "faults": many},
        {"name": "PEC K=1 I=1, 3 faults", "k": 1, "interval": 1, "faults": many},
        {"name": "PEC K=1 I=8, 3 faults", "k": 1, "interval": 8, "faults": many},
        {"name": "PEC K=2 I=1, 3 faults", "k": 2, "interval": 1, "faults": many},
        {"name": "PEC K=2 I=8, 3 faults", "k": 2, "interval": 8, "faults": many},
        {"name": "PEC K=1 I=1 load-aware, 3 faults", "k": 1, "interval": 1, "faults": many,
         "selection": "load-aware"},
        {"name": "PEC K=1 I=1 popularity, 3 faults", "k": 1, "interval": 1, "faults": many,
         "selection": "popularity"},
        {"name": "PEC K=1 I=1 Dynamic-K, 3 faults", "k": 1, "interval": 1, "faults": many, "dynamic_k": True},
    ]
    return c


def node_loss_configs(several: list[int]) -> list[dict]:
    """Two simulated nodes; every fault loses a whole node (its memory restored from the peer's replica)."""
    faults = [(x, True) for x in several]
    return [
        {"name": "full checkpoint, 3 node losses", "k": None, "interval": 1, "faults": faults},
        {"name": "PEC K=1 I=1, 3 node losses", "k": 1, "interval": 1, "faults": faults},
        {"name": "PEC K=2 I=1, 3 node losses", "k": 2, "interval": 1, "faults": faults},
        {"name": "PEC K=4 I=1, 3 node losses", "k": 4, "interval": 1, "faults": faults},
    ]


class NodeLossRunner:
    """One configuration as two simulated nodes (``megatron_pec.testing.cluster``), node losses as faults."""

    def __init__(self, a, stamp: str):
        self.a, self.stamp = a, stamp
        self.logs = os.path.join(RESULTS, "logs", "quality_node_loss")

    def run(self, cfg: dict, seed: int) -> dict:
        from megatron_pec.testing.cluster import Cluster, parse_restores

        a = self.a
        tag = re.sub(r"[^a-z0-9]+", "_", cfg["name"].lower()).strip("_") + f"_s{seed}"
        workdir = os.path.join(self.logs, tag)
        shutil.rmtree(workdir, ignore_errors=True)
        ckpt = os.path.join(STORAGE_ROOT, f"quality_nl_{self.stamp}", tag)
        job = "bench_n" + hashlib.sha1(f"{self.stamp}/{tag}".encode()).hexdigest()[:10]
        shutil.rmtree(ckpt, ignore_errors=True)
        train = ["--train-iters", str(a.iters), "--seed", str(seed), "--eval-interval", str(a.eval_interval),
                 "--eval-iters", str(a.eval_iters)]
        if cfg.get("checkpoint", True):
            train += ["--save-interval", str(a.save_interval), "--non-persistent-save-interval", str(cfg["interval"]),
                      "--pec-keep", "0", "--pec-selection", cfg.get("selection", "sequential")]
            if cfg.get("k"):
                train += ["--pec-snapshot-k", str(cfg["k"]), "--pec-persist-k", str(cfg["k"])]
        c = Cluster(workdir, os.path.join(SHM_ROOT, "qn"), job, model_args=MODEL, save=ckpt, script=PRETRAIN)
        t0, fault_log, restores = time.time(), [], []
        try:
            for n, (x, _) in enumerate(cfg.get("faults", [])):
                node = n % 2
                c.launch(train)
                c.wait_iteration(x, timeout=1800)
                c.lose_node(node)
                fault_log.append({"iteration": c.iteration(), "requested": x, "node_memory_lost": True,
                                  "node": node})
                c.wait_stopped(300)
            c.launch(train, checkpoint=cfg.get("checkpoint", True))
            codes = c.wait_exit(3600)
            if codes != {0: 0, 1: 0}:
                raise SystemExit(f"{cfg['name']}: the last launch exited with {codes}; see {workdir}")
            for attempt in range(2, c.launches + 1):
                found = parse_restores(c.logs(attempt))
                if found:
                    sources = "+".join(sorted({r.source for r in found.values()}))
                    restores.append({"iteration": found[0].iteration, "source": sources})
            train_loss, final, plt = {}, None, 0.0
            for attempt in range(1, c.launches + 1):
                for r in c.metrics(attempt):
                    if "validation loss" in r:
                        final = r["validation loss"]
                    elif "lm loss" in r:
                        train_loss[r["iteration"]] = r["lm loss"]
                        plt = r.get("plt", plt) or 0.0
            vals = {}
            for attempt in range(1, c.launches + 1):
                for i, v in VAL_RE.findall(c.log(0, attempt)):
                    vals[int(i) if i else a.iters] = float(v)
        finally:
            c.close()
            shutil.rmtree(ckpt, ignore_errors=True)
        return {"name": cfg["name"], "seed": seed, "k": cfg.get("k"), "interval": cfg.get("interval"),
                "selection": cfg.get("selection", "sequential"), "dynamic_k": False, "faults": fault_log,
                "restores": restores, "restores_per_restart": 1, "final_validation_loss": final, "plt": plt,
                "validation_curve": sorted(vals.items()), "train_loss": [train_loss[i] for i in sorted(train_loss)],
                "wall_s": round(time.time() - t0, 1)}


class Runner:
    def __init__(self, a, stamp: str):
        self.a, self.stamp = a, stamp
        self.logs = os.path.join(RESULTS, "logs", "quality")
        os.makedirs(self.logs, exist_ok=True)

    def launch(self, name: str, argv: list[str], env_extra: dict, log_path: str) -> int:
        job = launch.Launch(PRETRAIN, tuple(argv), nproc=2)
        port = launch.free_port(self.a.port)
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **env_extra)
        env.pop("MEGATRON_PEC_FAULT", None) if "MEGATRON_PEC_FAULT" not in env_extra else None
        with open(log_path, "a") as log:
            log.write(f"\n=== {' '.join(launch.command(job, port)[1:])} {env_extra}\n")
            log.flush()
            return launch.run(job, port=port, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=3600).returncode

    def run(self, cfg: dict, seed: int) -> dict:
        a = self.a
        tag = re.sub(r"[^a-z0-9]+", "_", cfg["name"].lower()).strip("_") + f"_s{seed}"
        # short: the agent's unix socket lives under <shm dir>/<job>/node0/ (AF_UNIX paths are <= 107 bytes)
        job = "bench_q" + hashlib.sha1(f"{self.stamp}/{tag}".encode()).hexdigest()[:10]
        ckpt = os.path.join(STORAGE_ROOT, f"quality_{self.stamp}", tag)
        shm = os.path.join(SHM_ROOT, "q")
        metrics = os.path.join(self.logs, f"{tag}.jsonl")
        log_path = os.path.join(self.logs, f"{tag}.log")
        shutil.rmtree(ckpt, ignore_errors=True)
        argv = [*MODEL, "--train-iters", str(a.iters), "--seed", str(seed), "--eval-interval", str(a.eval_interval),
                "--eval-iters", str(a.eval_iters), "--metrics-file", metrics]
        if cfg.get("checkpoint", True):
            argv += ["--save", ckpt, "--load", ckpt, "--save-interval", str(a.save_interval),
                     "--non-persistent-save-interval", str(cfg["interval"]), "--pec-job-id", job,
                     "--pec-shm-dir", shm, "--pec-keep", "0",
                     "--pec-selection", cfg.get("selection", "sequential")]
            if cfg.get("k"):
                argv += ["--pec-snapshot-k", str(cfg["k"]), "--pec-persist-k", str(cfg["k"])]
            if cfg.get("dynamic_k"):
                argv += ["--pec-dynamic-k"]
        t0 = time.time()
        if a.resume and self._finished(metrics):
            # an interrupted invocation already ran this configuration to the end: read its log back
            faults = [{"iteration": k, "requested": x, "node_memory_lost": lose, "expected_resume": None}
                      for k, (x, lose) in zip(self._kills(log_path)[::2], cfg.get("faults", []))]  # 2 ranks
            print(f"[quality]   reusing {log_path}", flush=True)
            return self._collect(cfg, seed, log_path, metrics, faults, None)
        for p in (metrics, log_path):
            if os.path.exists(p):
                os.unlink(p)
        resume, fault_log = 0, []
        for x, lose_memory in cfg.get("faults", []):
            saves = self._saves_until(x, resume, cfg["interval"], a.save_interval)
            before = self._kills(log_path)
            code = self.launch(cfg["name"], argv, {"MEGATRON_PEC_FAULT": f"snapshot_end=kill@{saves}"}, log_path)
            if code == 0 or len(self._kills(log_path)) == len(before):
                raise SystemExit(f"{cfg['name']}: the job exited with code {code} before the fault at iteration {x} "
                                 f"fired (a failed restore?); see {log_path}")
            node = os.path.join(shm, job, "node0")
            if lose_memory:
                self._kill_agent(node)
                shutil.rmtree(node, ignore_errors=True)
            resume = self._resume_point(ckpt, node)
            killed = self._kills(log_path)
            fault_log.append({"iteration": killed[-1] if killed else x, "requested": x,
                              "node_memory_lost": lose_memory, "expected_resume": resume})
        code = self.launch(cfg["name"], argv, {}, log_path)
        if code:
            raise SystemExit(f"{cfg['name']} failed with exit code {code}; see {log_path}")
        self._kill_agent(os.path.join(shm, job, "node0"))
        shutil.rmtree(os.path.join(shm, job), ignore_errors=True)
        shutil.rmtree(ckpt, ignore_errors=True)
        return self._collect(cfg, seed, log_path, metrics, fault_log, round(time.time() - t0, 1))

    @staticmethod
    def _finished(metrics: str) -> bool:
        if not os.path.exists(metrics):
            return False
        with open(metrics) as f:
            return any("validation loss" in json.loads(line) for line in f if line.strip())

    def _collect(self, cfg, seed, log_path, metrics, fault_log, wall_s) -> dict:
        a = self.a
        with open(log_path) as f:
            text = f.read()
        restores = [{"iteration": int(i), "source": s} for i, s in RESTORE_RE.findall(text)]
        vals = [(int(i) if i else a.iters, float(v)) for i, v in VAL_RE.findall(text)]
        train, final, plt = {}, None, 0.0
        with open(metrics) as f:
            for line in f:
                r = json.loads(line)
                if "validation loss" in r:
                    final = r["validation loss"]
                else:
                    train[r["iteration"]] = r["lm loss"]
                    plt = r.get("plt", plt) or 0.0
        return {"name": cfg["name"], "seed": seed, "k": cfg.get("k"), "interval": cfg.get("interval"),
                "selection": cfg.get("selection", "sequential"), "dynamic_k": bool(cfg.get("dynamic_k")),
                "faults": fault_log, "restores": restores, "final_validation_loss": final, "plt": plt,
                "validation_curve": vals, "train_loss": [train[i] for i in sorted(train)],
                "wall_s": wall_s}

    @staticmethod
    def _kills(log_path: str) -> list[int]:
        if not os.path.exists(log_path):
            return []
        with open(log_path) as f:
            return [int(i) for i in KILL_RE.findall(f.read())]

    @staticmethod
    def _saves_until(x: int, resume: int, interval: int, save_interval: int) -> int:
        """How many saves the relaunched job makes from ``resume`` up to and including iteration x."""
        return sum(1 for it in range(resume + 1, x + 1) if it % interval == 0 or it % save_interval == 0)

    @staticmethod
    def _kill_agent(node: str) -> None:
        launch.stop_agents(node)

    @staticmethod
    def _resume_point(ckpt: str, node: str) -> int:
        """The iteration a restart will restore: newest complete snapshot every rank has in node
        memory, else the newest committed iteration on storage (what megatron-pec's agree step picks)."""
        from megatron_pec.memory.history import NodeMemory
        from megatron_pec.store.checkpoint_dir import CheckpointDir
        from megatron_pec.store.storage import open_storage

        time.sleep(1.0)  # the agent finishes what the killed trainers announced
        best = max(CheckpointDir(ckpt, open_storage("posix")).committed_iterations(), default=0)
        memory = NodeMemory.read(node)
        newest = [memory.newest(rank) for rank in (0, 1)]
        if all(newest):
            best = max(best, min(record.iteration for _, record in newest))
        return best


def _restored(r: dict) -> str:
    """One entry per restart: iteration and source (m memory, s storage, p0/p1 peer memory of node 0/1)."""
    short = lambda source: "p" + source[-2] if source.startswith("peer") else source[0]
    step = r.get("restores_per_restart", 2)
    return ", ".join(f"{x['iteration']} ({'+'.join(short(s) for s in x['source'].split('+'))})"
                     for x in r["restores"][::step]) or "–"


def markdown(result: dict) -> str:
    noise = result["noise"]
    out = ["# PLT versus model quality", "", f"Command: `{result['command']}`", "",
           f"Machine: {result['machine'].get('cpu')}, {result['machine'].get('cores')} cores; "
           f"1-min load before the runs: {result['load_1min_before']}", "",
           f"Model: {' '.join(MODEL)}; {result['iters']} iterations, real text (byte-level Python stdlib source). "
           f"Fault-free final validation loss over seeds {result['seeds']}: "
           + ", ".join(f"{v:.4f}" for v in noise["values"])
           + f" (spread {noise['spread']:.4f}: the noise).", "",
           "| run | faults (iteration, node memory lost) | restored from | PLT | final val loss | Δ vs fault-free "
           "(same seed) | within noise |", "|---|---|---|---|---|---|---|"]
    base = result["runs"][0]["final_validation_loss"]
    for r in result["runs"]:
        d = r["final_validation_loss"] - base
        faults = ", ".join(f"{f['iteration']}" + (f" node {f['node']}" if "node" in f else
                                                  " +mem" if f["node_memory_lost"] else "")
                           for f in r["faults"]) or "–"
        restored = _restored(r)
        ok = abs(d) <= max(noise["spread"], 1e-9) if r["faults"] else None
        out.append(f"| {r['name']} (seed {r['seed']}) | {faults} | {restored} | {r['plt']:.2%} | "
                   f"{r['final_validation_loss']:.4f} | {d:+.4f} | {'–' if ok is None else ('yes' if ok else 'no')} |")
    out += ["", "Restored from: iteration (m = node memory, s = storage, pK = peer memory of node K, joined by + "
            "when ranks differ), one entry per restart. Faults: `node K` = node K lost (trainer and agent "
            "SIGKILLed, node memory deleted); `+mem` = node memory lost too. PLT = portion of "
            "lost tokens accumulated over all restarts (megatron_pec.plt_so_far()). Noise = max − min of the "
            "fault-free runs over seeds.", ""]
    return "\n".join(out)


def plots(result: dict, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in result["runs"]:
        xs = [v[0] for v in r["validation_curve"]]
        ys = [v[1] for v in r["validation_curve"]]
        line, = ax.plot(xs, ys, marker=".", linewidth=1, label=f"{r['name']} (s{r['seed']})")
        for f in r["faults"]:
            ax.axvline(f["iteration"], color=line.get_color(), alpha=0.25, linestyle=":")
    ax.set_xlabel("iteration")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss (dotted: injected faults)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(RESULTS, f"{stem}_loss_curves.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    noise = result["noise"]
    ax.axhspan(min(noise["values"]), max(noise["values"]), color="tab:green", alpha=0.15,
               label="fault-free, across seeds")
    for r in result["runs"]:
        if r["faults"]:
            ax.scatter(r["plt"] * 100, r["final_validation_loss"], s=25)
            short = r["name"].replace(", 3 node losses", " ×3 nodes").replace(", 3 faults", " ×3")
            ax.annotate(short.replace(", 1 fault", " ×1"),
                        (r["plt"] * 100, r["final_validation_loss"]), fontsize=6)
    ax.axvline(3.75, color="gray", linestyle="--", linewidth=0.8, label="PLT 3.75%")
    ax.set_xlabel("PLT (%)")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=7)
    ax.set_title("Final validation loss vs portion of lost tokens")
    fig.tight_layout()
    paths.append(os.path.join(RESULTS, f"{stem}_loss_vs_plt.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--seeds", default="1234,4321", help="fault-free seeds (the noise); faults use the first")
    p.add_argument("--several", default="40,70,100",
                   help="iterations of the three faults (a fault hits the last save at or before it)")
    p.add_argument("--single", default="70", help="iteration of the single fault")
    p.add_argument("--save-interval", type=int, default=16, help="persistent saves (storage) every N iterations")
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--only", default=None, help="';'-separated substrings: run only matching configurations")
    p.add_argument("--port", type=int, default=29650, help="first master port tried")
    p.add_argument("--json", default=None)
    p.add_argument("--node-loss", action="store_true",
                   help="two simulated nodes; every fault loses a node, restored from the peer's replica")
    p.add_argument("--resume", action="store_true",
                   help="reuse configurations an interrupted invocation finished (their logs and metrics)")
    a = p.parse_args(argv)
    stamp = "resumable" if a.resume else str(os.getpid())
    command = "python -m benchmarks.quality " + " ".join(argv if argv is not None else sys.argv[1:])
    seeds = [int(s) for s in a.seeds.split(",")]
    runner = NodeLossRunner(a, stamp) if a.node_loss else Runner(a, stamp)
    stem = "quality_node_loss" if a.node_loss else "quality"
    loads = [wait_for_quiet(max_wait_s=30)["load_1min_before"]]
    runs = []
    t0 = time.time()
    for seed in seeds:
        print(f"[quality] fault-free, seed {seed}", flush=True)
        runs.append(runner.run({"name": "fault-free", "checkpoint": False, "interval": None, "faults": []}, seed))
        print(f"[quality]   final val loss {runs[-1]['final_validation_loss']:.4f} ({runs[-1]['wall_s'] or 0:.0f}s)",
              flush=True)
    several = [int(x) for x in a.several.split(",")]
    cfgs = node_loss_configs(several) if a.node_loss else configs(several, [int(x) for x in a.single.split(",")])
    if a.only:
        cfgs = [c for c in cfgs if any(s in c["name"] for s in a.only.split(";"))]
    for cfg in cfgs:
        # Loss values do not depend on the machine's load (only wall time does): record it, do not wait.
        loads.append(loadavg())
        print(f"[quality] {cfg['name']}", flush=True)
        r = runner.run(cfg, seeds[0])
        runs.append(r)
        print(f"[quality]   final val loss {r['final_validation_loss']:.4f}, PLT {r['plt']:.2%}, restores "
              f"{_restored(r)} ({r['wall_s'] or 0:.0f}s)", flush=True)
    values = [r["final_validation_loss"] for r in runs if not r["faults"] and r["name"] == "fault-free"]
    result = {"command": command, "machine": machine(), "load_1min_before": loads, "iters": a.iters,
              "seeds": seeds, "model": MODEL, "noise": {"values": values, "spread": max(values) - min(values)},
              "runs": runs, "wall_s": round(time.time() - t0, 1)}
    base = runs[0]["final_validation_loss"]
    result["pec_below_3_75_within_noise"] = {
        r["name"]: abs(r["final_validation_loss"] - base) <= result["noise"]["spread"]
        for r in runs if r["faults"] and r["plt"] < 0.0375 and r["name"].startswith("PEC")}
    os.makedirs(RESULTS, exist_ok=True)
    for path in filter(None, (os.path.join(RESULTS, f"{stem}.json"), a.json)):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write(markdown(result))
    print("\n".join(plots(result, stem)), flush=True)
    print(markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
