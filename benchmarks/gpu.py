"""Every method on one GPU, on one schedule: ``benchmarks/results/gpu.json`` and ``gpu.md``.

    python -m benchmarks.gpu                  # a CUDA machine: the model of ../shared/gpu/README.md, < 8 min
    python -m benchmarks.gpu --cpu-standin    # the same runs on CPU ranks with a small model (checks the script)

The schedule (``benchmarks/schedule.py``): a method with a node-memory tier (megatron-pec, DLRover)
checkpoints every iteration and persists every 20th checkpoint; ``torch_dist`` async, whose only tier is
storage, runs twice, checkpointing every iteration and every 20. Nothing waits for a free slot: a
checkpoint a method cannot take is skipped and counted (megatron-pec: no free node-memory region; DLRover:
its saver still persisting).

Rows, each from a torchrun of one rank:

* the example trainer (``examples/gpt_moe``): ``base`` (no checkpoints), ``all`` (every expert) and
  ``pec2`` (snapshot-K 2 / persist-K 1) on the schedule, ``paired`` (every expert, a snapshot every 4th
  iteration: a snapshot's cost against the steps beside it, ``paired_cost.py``), ``killed`` (as ``all``,
  SIGKILLed in optimizer step ``KILL_AT``) and its restart from node memory, timed against the
  host-to-device floor;
* the benchmark worker (``benchmarks.worker --mode schedule``, the same model): megatron-pec (every
  expert), DLRover's flash checkpoint, Megatron's ``torch_dist`` async (``async_strategy`` "mcore"
  without nvidia-resiliency-ext, "nvrx" with it; the row says which) and Megatron's own local
  non-persistent checkpoints (nvidia-resiliency-ext's ``LocalCheckpointManager``, synchronous, persisting
  with ``torch_dist``; CUDA only: on CPU ranks its row says it needs CUDA), each driven the way its
  framework drives it, with restores from node memory and from storage, beside the storage's write and read
  floors; and before them the host time of enqueueing a snapshot's copies against their number
  (``copy_enqueue.py``: the example's runs and a DeepSeek-V3 EP 64 rank's).

Per row: step overhead over training without checkpoints (the median iteration, its checkpoint included,
over the median iteration without; the worker's rows also give the run's mean, persists included), save
blocking (median, p90), skipped checkpoints, restore from memory and from storage, node memory used
(megatron-pec: its home slots and expert pool; DLRover: its shared-memory buffer; ``torch_dist`` async: its
host staging, the trainer's resident-memory growth over a save; Megatron local: its file in /dev/shm).
``--peers ""`` leaves the worker out; DLRover must be installed (``pip install -e .[bench]``, on a GPU
machine without an index the wheels of ``scripts/gpu_wheels.sh``) or its row is an error; so must
nvidia-resiliency-ext for the Megatron local row (the same wheels).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import paired_cost
from benchmarks.common import REPO, RESULTS, SHM_ROOT, allocated_bytes, files_under, loadavg, machine, p90
from benchmarks.schedule import schedules
from megatron_pec.testing import launch

GPU_MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--num-experts", "8",
             "--moe-ffn-hidden-size", "2048", "--moe-router-topk", "2", "--seq-length", "1024", "--micro-batch-size",
             "4", "--global-batch-size", "8", "--disable-bias-linear"]
CPU_MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-experts", "8",
             "--moe-router-topk", "2", "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--disable-bias-linear"]
COMMON = ["--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "5", "--log-interval", "5",
          "--eval-iters", "1"]
EXAMPLE = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
SCHEDULE = schedules(has_memory=True)[0]  # the example trainer's runs have the memory tier
EXAMPLE_RUNS = {"all": [], "pec2": ["--pec-snapshot-k", "2", "--pec-persist-k", "1"]}  # beside "base"
PEERS = "pec_all,dlrover,torch_dist_async,megatron_local"
KILL_AT = 25  # the killed run dies in this optimizer step (after a persist at 20); its restart restores 24
WARMUP = 5  # iterations left out of the example's step times
RESTORE = re.compile(r"rank 0: restore took ([0-9.]+) s(?: \((.*)\))?$", re.MULTILINE)  # (the total, its phases)
RESTORED = re.compile(r"rank 0: restored iteration (\d+) from (\w+)")
SKIPPED = re.compile(r"skipped the snapshot of iteration (\d+)")


@dataclass(frozen=True)
class Sizes:
    """How much each part runs, per device: sized so that the GPU run ends within 8 minutes."""

    iters: int  # the example's runs and the worker's runs on the schedule
    persist_every_iteration_iters: int  # the worker's run that persists every iteration (torch_dist async)
    memory_restores: int
    storage_restores: int
    floor_reps: int


SIZES = {"cuda": Sizes(iters=40, persist_every_iteration_iters=10, memory_restores=3, storage_restores=2,
                       floor_reps=2),
         "cpu": Sizes(iters=40, persist_every_iteration_iters=20, memory_restores=3, storage_restores=2,
                      floor_reps=2)}


class Clock:
    """Progress lines with the time since the start, and each part's seconds for the result."""

    def __init__(self):
        self.start = self.mark = time.monotonic()
        self.parts: dict[str, float] = {}

    def say(self, message: str) -> None:
        print(f"[gpu +{time.monotonic() - self.start:5.0f}s] {message}", flush=True)

    def done(self, part: str, message: str) -> None:
        now = time.monotonic()
        self.parts[part] = round(now - self.mark, 1)
        self.mark = now
        self.say(f"{part} ({self.parts[part]:.0f} s): {message}")


def floors(nbytes: int, cuda: bool) -> dict:
    """Seconds to copy ``nbytes`` device -> a page-locked /dev/shm mapping and back (CPU ranks: memcpy)."""
    import torch

    device = "cuda" if cuda else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    path = f"/dev/shm/pec_floor_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            host = torch.frombuffer(m, dtype=torch.uint8)
            host.fill_(1)
            if cuda:
                torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)

            def timed(copy) -> float:
                runs = []
                for _ in range(5):
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    copy()
                    if cuda:
                        torch.cuda.synchronize()
                    runs.append(time.perf_counter() - t)
                return statistics.median(runs)

            out = {"bytes": nbytes, "d2h_s": timed(lambda h=host: h.copy_(src, non_blocking=cuda)),
                   "h2d_s": timed(lambda h=host: src.copy_(h, non_blocking=cuda))}
            if cuda:
                torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
            del host
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def run_logged(job: launch.Launch, log: Path, env: dict, timeout: float, echo: str | None = None) -> int:
    """Run ``job`` with its output in ``log``; lines starting with ``echo`` are printed as they come (progress).
    Killed after ``timeout`` seconds."""
    with open(log, "w") as out:
        proc = launch.start(job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            for line in proc.stdout:
                out.write(line)
                if echo and line.startswith(echo):
                    print("    " + line.rstrip(), flush=True)
            return proc.wait()
        finally:
            watchdog.cancel()


def example(name: str, workdir: Path, model: list[str], iters: int, extra: list[str], env: dict) -> dict:
    """One torchrun of the example trainer; its metrics, log and exit code."""
    metrics, log = workdir / f"{name}.jsonl", workdir / f"{name}.log"
    job = launch.Launch(EXAMPLE, (*model, *COMMON, "--train-iters", str(iters), "--metrics-file", str(metrics),
                                  *extra))
    code = run_logged(job, log, dict(os.environ, **env), timeout=900)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {"code": code, "rows": rows, "log": log.read_text(), "log_path": str(log)}


def example_row(r: dict, base_step: float | None, node_dir: Path | None) -> dict:
    """An example run's row: its checkpoints on the schedule, skipped ones apart."""
    skipped = {int(i) for i in SKIPPED.findall(r["log"])}
    steps = [x for x in r["rows"] if "step_s" in x and x["iteration"] > WARMUP]
    saves = [x for x in r["rows"] if x.get("save_blocking_s") is not None]
    taken = [x["save_blocking_s"] for x in saves if x["iteration"] not in skipped]
    step = statistics.median(x["step_s"] + (x.get("save_blocking_s") or 0) for x in steps) if steps else None
    # (where a longer step goes: the training thread's CPU time, the GPU stream's time; None where not recorded)
    parts = {key: statistics.median(x[key] for x in steps) if steps and all(x.get(key) is not None for x in steps)
             else None for key in ("step_cpu_s", "device_step_s")}
    later = taken[1:]
    return {"harness": "example trainer", "schedule": SCHEDULE.label, "iterations": len(steps) + WARMUP,
            "checkpoints": len(saves), "skipped": len(skipped), "step_s": step, **parts,
            "step_overhead": (step / base_step - 1) if step and base_step else None,
            "blocking_s_median": statistics.median(later) if later else None,
            "blocking_s_p90": p90(later) if later else None,
            "first_save_s": taken[0] if taken else None,
            "first_over_later": taken[0] / statistics.median(later) if later else None,
            "restore_memory_s": None, "restore_storage_s": None,
            "node_memory_bytes": allocated_bytes(files_under(str(node_dir))) if node_dir else None,
            "node_memory_what": "its home slots and expert pool", "exit_code": r["code"]}


def agent_cpu_per_snapshot(node_dir: Path, snapshots: int) -> float | None:
    """The agent's CPU per snapshot for recording it (header check, node-memory index), from its ledger."""
    try:
        ledger = json.loads((node_dir / "agent_cpu.json").read_text())
    except (OSError, ValueError):
        return None
    phases = ledger.get("phases", {})
    spent = phases.get("checking", 0.0) + phases.get("node-memory index", 0.0)
    return spent / snapshots if snapshots else None


def worker_rows(workdir: Path, model: list[str], sizes: Sizes, env: dict, methods: str, floor: dict,
                run_id: str) -> dict:
    """Every method in ``methods`` on the schedule, measured by the benchmark worker on one rank."""
    result, log = workdir / "peers.json", workdir / "peers.log"
    job = launch.Launch("benchmarks.worker", (
        "--mode", "schedule", "--run-id", run_id, "--out", str(result), "--methods", methods,
        "--iters", str(sizes.iters), "--iters-persist-every-iteration", str(sizes.persist_every_iteration_iters),
        "--memory-restores", str(sizes.memory_restores), "--storage-restores", str(sizes.storage_restores),
        "--floor-reps", str(sizes.floor_reps), "--", *model, *COMMON, "--train-iters", "5000"), module=True,
        options=("--rdzv-id", run_id))  # (names DLRover's socket folder: another job's cannot collide)
    env = dict(os.environ, **env, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = run_logged(job, log, env, timeout=900, echo="[bench")
    if code or not result.exists():
        return {"rows": {}, "errors": {"worker": f"exit code {code}, see {log}"}}
    measured = json.loads(result.read_text())
    for row in measured["rows"].values():
        nbytes = measured.get("optimizer_state_bytes_per_rank")
        row.update(harness="benchmarks.worker",
                   h2d_floor_s=floor["h2d_s"] * nbytes / floor["bytes"] if nbytes and row["restore_memory_s"] else None)
    return measured


def example_rows(out: dict, workdir: Path, shm: Path, model: list[str], sizes: Sizes, env: dict,
                 clock: Clock) -> None:
    """The example trainer without checkpoints, then with each of ``EXAMPLE_RUNS`` on the schedule."""
    base = example("base", workdir, model, sizes.iters, [], env)
    out["example_base"] = example_row(base, None, None)
    base_step = out["example_base"]["step_s"]
    clock.done("base", f"exit {base['code']}, step {base_step}")
    for name, extra in EXAMPLE_RUNS.items():
        ckpt = ["--save", str(workdir / f"ck_{name}"), "--pec-shm-dir", str(shm), "--pec-job-id", name,
                "--pec-keep-shm", *SCHEDULE.megatron_flags(), *extra]
        r = example(name, workdir, model, sizes.iters, ckpt, env)
        row = example_row(r, base_step, shm / name / "node0")
        snapshots = row["checkpoints"] - row["skipped"]
        row["agent_cpu_s_per_snapshot"] = agent_cpu_per_snapshot(shm / name / "node0", snapshots)
        out["rows"][f"example: megatron-pec {'K=all' if name == 'all' else 'snapshot-K 2 / persist-K 1'}"] = row
        clock.done(name, f"exit {r['code']}, skipped {row['skipped']}, step overhead {row['step_overhead']}")
    r, out["paired_all"] = paired_run("paired", workdir, shm, model, sizes.iters, env)
    shown = out["paired_all"] and f"{out['paired_all']['overhead'] * 100:+.1f}%"
    clock.done("paired", f"exit {r['code']}, a K=all snapshot's cost paired within the run: {shown}")


def paired_run(name: str, workdir: Path, shm: Path, model: list[str], iters: int, env: dict,
               extra: tuple = ()) -> tuple[dict, dict | None]:
    """The example with a K=all snapshot every ``paired_cost.EVERY`` iterations, in node memory only (``extra``:
    more flags, e.g. a copy path): its run and a snapshot's cost paired within it (``paired_cost``)."""
    ckpt = ["--save", str(workdir / f"ck_{name}"), "--pec-shm-dir", str(shm), "--pec-job-id", name,
            *paired_cost.FLAGS, *extra]
    r = example(name, workdir, model, iters, ckpt, env)
    launch.stop_agents(shm / name)  # (memory only, nothing to persist: the runs after it start on a quiet machine)
    return r, paired_cost.paired_cost(r["rows"], WARMUP)


def restart_flags(workdir: Path, shm: Path, job: str) -> list[str]:
    """A job of the example that saves on ``SCHEDULE`` and loads what it saved (the kill-and-restart runs)."""
    return ["--save", str(workdir / f"ck_{job}"), "--load", str(workdir / f"ck_{job}"), "--pec-shm-dir", str(shm),
            "--pec-job-id", job, *SCHEDULE.megatron_flags()]


def kill_in_step(n: int) -> dict:
    """The environment that SIGKILLs rank 0 in the n-th optimizer step of its process."""
    return {"MEGATRON_PEC_FAULT": f"optimizer_step=kill@{n}:0"}


def state_bytes(shm: Path, job: str) -> int | None:
    """Rank 0's state as its node-memory plan records it: what a restore reads (None: no plan)."""
    plan = shm / job / "node0" / "rank0.memory.json"
    return json.loads(plan.read_text())["state_bytes"] if plan.exists() else None


def restore_in(log: str) -> dict | None:
    """Rank 0's restore as its log says it: what it restored (iteration and source), its seconds and phases."""
    restore, line = RESTORE.search(log), RESTORED.search(log)
    if restore is None or line is None:
        return None
    return {"restored": f"{line.group(1)} from {line.group(2)}", "seconds": float(restore.group(1)),
            "phases": restore.group(2)}


def restart_row(out: dict, workdir: Path, shm: Path, model: list[str], sizes: Sizes, env: dict, cuda: bool,
                clock: Clock) -> None:
    """A trainer SIGKILLed in optimizer step ``KILL_AT``, relaunched: its restore from node memory, with its
    phases, against the host-to-device floor of the bytes restored."""
    ck = restart_flags(workdir, shm, "killed")
    example("killed", workdir, model, sizes.iters, ck, dict(env, **kill_in_step(KILL_AT)))
    restored_bytes = state_bytes(shm, "killed")
    clock.done("killed", f"killed in optimizer step {KILL_AT}")
    restore = restore_in(example("resumed", workdir, model, sizes.iters, ck, env)["log"]) or {}
    out["floors"] = floors(restored_bytes or 2**26, cuda)
    seconds = restore.get("seconds")
    out["restore"] = {"restored": restore.get("restored"), "restore_memory_s": seconds, "bytes": restored_bytes,
                      "phases": restore.get("phases"),
                      "over_h2d_floor": seconds / out["floors"]["h2d_s"] if seconds else None}
    out["rows"]["example: megatron-pec K=all"].update(restore_memory_s=seconds, h2d_floor_s=out["floors"]["h2d_s"])
    clock.done("resumed", f"restored {out['restore']['restored']} in {seconds} s ({out['restore']['phases']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-standin", action="store_true", help="CPU ranks and a small model (no GPU needed)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/gpu.json (gpu_cpu_standin.json)")
    p.add_argument("--peers", default=PEERS, help=f"methods of benchmarks.worker to run on the schedule (default "
                   f"{PEERS}; empty: none)")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu_standin
    if not cuda and not args.cpu_standin:
        p.error("no CUDA device: pass --cpu-standin to run the same measurements on CPU ranks")
    model, sizes = (GPU_MODEL, SIZES["cuda"]) if cuda else (CPU_MODEL, SIZES["cpu"])
    clock = Clock()
    workdir = Path(tempfile.mkdtemp(prefix="pec_gpu_"))
    shm = Path("/dev/shm") / workdir.name
    run_id = f"gpu{os.getpid()}"
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4"), "PYTHONUNBUFFERED": "1"}
    out = {"machine": machine(), "device": torch.cuda.get_device_name() if cuda else "cpu (stand-in)",
           "model": model, "schedule": {"label": SCHEDULE.label, "persist_every": SCHEDULE.persist_every},
           "sizes": vars(sizes), "rows": {}, "errors": {}, "load_1min": [loadavg()]}  # (at the start, the end)
    clock.say(f"{out['device']}: {sizes.iters} iterations per run, a checkpoint {SCHEDULE.label}; logs in {workdir}")
    try:
        example_rows(out, workdir, shm, model, sizes, env, clock)
        restart_row(out, workdir, shm, model, sizes, env, cuda, clock)
        if args.peers:
            measured = worker_rows(workdir, model, sizes, env, args.peers, out["floors"], run_id)
            out["rows"].update(measured["rows"])
            out["errors"].update(measured.get("errors", {}))
            out["storage_floors"] = measured.get("floors")
            out["copy_enqueue"] = measured.get("copy_enqueue")
            clock.done("worker", f"{len(measured['rows'])} rows, errors: {measured.get('errors') or 'none'}")
    except KeyboardInterrupt:  # a lent GPU's time limit (timeout -s INT): keep the rows measured so far
        out["errors"]["interrupted"] = "stopped by SIGINT before every row was measured"
    finally:
        for root in (shm, Path(SHM_ROOT) / run_id):
            launch.stop_agents(root)
            shutil.rmtree(root, ignore_errors=True)
    out["seconds_by_part"] = clock.parts
    out["load_1min"].append(loadavg())  # (other work on the machine inflates every timing)
    out["wall_s"] = round(time.monotonic() - clock.start, 1)
    path = Path(args.json or RESULTS / ("gpu.json" if cuda else "gpu_cpu_standin.json"))
    path.write_text(json.dumps(out, indent=1))
    text = markdown(out, "python -m benchmarks.gpu" + ("" if cuda else " --cpu-standin"))
    path.with_suffix(".md").write_text(text)
    print(text + f"\nwritten: {path} and {path.with_suffix('.md')} (logs: {workdir}) in {out['wall_s']:.0f} s")
    return 0


def markdown(out: dict, command: str) -> str:
    mb = lambda v: f"{v / 1e6:.0f}" if v is not None else "-"
    lines = [f"# Every method on {out['device']}, one schedule", "",
             f"`{command}` ({out['wall_s']:.0f} s); model `{' '.join(out['model'])}`. Methods with a node-memory "
             f"tier checkpoint {out['schedule']['label']}; `torch_dist` async (storage only) every iteration and "
             f"every {out['schedule']['persist_every']} (Megatron's local checkpoints persist with `torch_dist`). "
             "Nothing waits for a free slot: skipped checkpoints are counted. Step overhead: the median iteration, "
             "its checkpoint included, over the median iteration without checkpoints.", "",
             "| row | schedule | step overhead (median iteration) | blocking median (ms) | blocking p90 (ms) | skipped "
             "| restore from memory (ms) | restore from storage (ms) | node memory used (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in out["rows"].items():
        overhead = f"{r['step_overhead'] * 100:+.1f}%" if r.get("step_overhead") is not None else "-"
        lines.append(f"| {name} | {r['schedule']} | {overhead} | {ms(r['blocking_s_median'])} | "
                     f"{ms(r['blocking_s_p90'])} | {r['skipped']} of {r['checkpoints']} | "
                     f"{ms(r.get('restore_memory_s'))} | {ms(r.get('restore_storage_s'))} | "
                     f"{mb(r.get('node_memory_bytes'))} |")
    for name, error in out.get("errors", {}).items():
        if name in METHOD_ERRORS_ELSEWHERE:
            continue
        lines.append(f"| {name} | - | not run: {error.removeprefix('RuntimeError: ')} | - | - | - | - | - | - |")
    lines += ["", "Node memory used: " + "; ".join(
        f"{name}: {r['node_memory_what']}" + ("" if r.get("node_memory_bytes") is not None else " (not measured)")
        for name, r in out["rows"].items()) + "."]
    for name, r in out["rows"].items():
        lines += row_notes(name, r)
    lines += step_parts_markdown(out)
    lines += paired_cost.markdown(out.get("paired_all"), "A K=all snapshot's cost on the example's step")
    fl, sf = out.get("floors"), out.get("storage_floors")
    if fl:
        lines.append(f"* Copy floors for {fl['bytes'] / 1e6:.0f} MB: device -> page-locked host {ms(fl['d2h_s'])} ms, "
                     f"host -> device {ms(fl['h2d_s'])} ms.")
    if sf:
        lines.append(f"* Storage floors (one writer / reader, {sf['write_bytes'] / 1e6:.0f} MB): write+fsync "
                     f"{sf['write_MBps']:.0f} MB/s, cold read {sf['read_MBps']:.0f} MB/s.")
    if out.get("restore"):
        phases = out["restore"].get("phases")
        lines.append(f"* Restart after a kill in optimizer step {KILL_AT}: restored {out['restore']['restored']} in "
                     f"{ms(out['restore']['restore_memory_s'])} ms" + (f" ({phases})." if phases else "."))
    lines.append(f"* Seconds by part: {out['seconds_by_part']}.")
    if out.get("load_1min"):
        lines.append(f"* The machine's 1-minute load at the start and at the end: "
                     f"{', '.join(f'{v:.2f}' for v in out['load_1min'])}.")
    lines += [f"* {name}: {error}" for name, error in out.get("errors", {}).items() if name in METHOD_ERRORS_ELSEWHERE]
    lines += enqueue_markdown(out.get("copy_enqueue"))
    return "\n".join(lines) + "\n"


def row_notes(name: str, r: dict) -> list[str]:
    """The line below the table for one row: what its columns do not say."""
    extra = []
    if r.get("first_over_later") is not None:
        extra.append(f"first save {ms(r['first_save_s'])} ms = {r['first_over_later']:.1f}x the later ones")
    if r.get("agent_cpu_s_per_snapshot") is not None:
        extra.append(f"node agent's CPU per snapshot {ms(r['agent_cpu_s_per_snapshot'])} ms")
    if r.get("step_overhead_mean") is not None:
        extra.append(f"step overhead {r['step_overhead_mean'] * 100:+.1f}% as the run's mean (persists "
                     "included)")
    if r.get("persist_blocking_s_median") is not None:
        extra.append(f"a persist blocks {ms(r['persist_blocking_s_median'])} ms (median)")
    if r.get("async_strategy") is not None or (r.get("family") == "torch_dist"):
        extra.append(f"async_strategy {r.get('async_strategy') or 'mcore (this megatron-core has only its own)'}")
    if r.get("h2d_floor_s") and r.get("restore_memory_s"):
        extra.append(f"restore from memory = {r['restore_memory_s'] / r['h2d_floor_s']:.2f}x the H2D floor")
    return [f"* {name}: " + "; ".join(extra) + "."] if extra else []


METHOD_ERRORS_ELSEWHERE = {"worker", "copy enqueue"}  # (errors that are no method's: listed below the table)


def ms(seconds: float | None) -> str:
    return f"{seconds * 1e3:.1f}" if seconds is not None else "-"


def step_parts_markdown(out: dict) -> list[str]:
    """The example's median step as wall time, its training thread's CPU time and its GPU stream's time: a
    longer step with more CPU is a host-side slowdown, with a longer stream a device-side one."""
    runs = {"no checkpoints": out.get("example_base") or {}}
    runs.update({name.removeprefix("example: "): r for name, r in out["rows"].items() if name.startswith("example")})
    shown = [f"{name} {ms(r.get('step_s'))} / {ms(r.get('step_cpu_s'))} / {ms(r.get('device_step_s'))}"
             for name, r in runs.items() if r.get("step_s") is not None]
    return [f"* The example's step (median ms: wall / training thread's CPU / GPU stream): {'; '.join(shown)}."] \
        if shown else []


def enqueue_markdown(measured: dict | None) -> list[str]:
    """The copy enqueue's table (``copy_enqueue.py``), or nothing where it was not measured."""
    if not measured:
        return []
    us = lambda v: f"{v * 1e6:.0f}" if v is not None else "-"
    budget = measured["budget_s"] * 1e3
    lines = ["", f"## Enqueueing a snapshot's copies against their number ({measured['device']})", "",
             f"Timed: {measured['timed']}; `torch._foreach_copy_(dst, src, non_blocking=True)`, one pair per run, "
             f"median of {measured['reps']}. Budget {budget:.1f} ms (beyond it: coalesce or batch the copies).", "",
             "| runs | of what | bytes (MB) | per run (KB, median) | enqueue median (µs) | enqueue p90 (µs) | landed "
             f"(µs) | over {budget:.1f} ms |", "|---|---|---|---|---|---|---|---|"]
    for r in measured["rows"]:
        lines.append(f"| {r['runs']} | {r['what']} | {r['bytes'] / 1e6:.1f} | {r['bytes_per_run_median'] / 1e3:.1f} | "
                     f"{us(r['enqueue_s_median'])} | {us(r['enqueue_s_p90'])} | {us(r['landed_s_median'])} | "
                     f"{'yes' if r['over_budget'] else 'no'} |")
    if measured.get("enqueue_us_per_run") is not None:
        lines += ["", f"The same bytes in more runs: {measured['enqueue_us_per_run']:.2f} µs of enqueue per run."]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
