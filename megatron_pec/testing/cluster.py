"""Simulated multi-node training on one machine, for fault-injection tests, the campaign and the CPU demo.

Runs in the test / campaign / demo driver process, never inside training. A
``Cluster`` launches a training script (the caller names it: the example's
``pretrain_gpt_moe.py`` in a checkout) as ``nnodes`` separate
``torchrun --nnodes N --node-rank k --nproc-per-node 1`` processes (``launch.py``; one
rank per "node"), each in its own session so it can be killed as a unit. Every
node gets its own node agent and node memory automatically, because node
memory lives in ``<shm dir>/<job id>/node<k>/``.

What it offers, all with bounded waits (a hang raises ``ClusterTimeout``):

* ``launch`` the job (optionally arming ``MEGATRON_PEC_FAULT`` per node),
  ``wait_for`` a condition (a log line, a file, an iteration in the metrics
  file), ``wait_exit``;
* ``kill_trainers`` (SIGKILL the node's torchrun and its workers; the agent,
  in its own session, survives), ``kill_agent`` (SIGKILL the pid in
  ``agent.pid``), ``lose_node`` (both, then delete the node's memory),
  ``pause``/``resume`` (SIGSTOP/SIGCONT the trainers, e.g. while a test
  remounts the checkpoint directory read-only);
* ``close`` kills whatever is left (trainers, agents of this cluster's node
  directories) and removes the node memory, also when a test failed.

Log helpers parse what the engine prints on restore (``restored iteration N
from memory|storage``, the PLT line) so tests and the campaign share one parser.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pec.testing import launch as launcher

# A small GPT-MoE that runs an iteration in ~0.3 s on 2 CPU cores (8 experts, EP=2, DP=2).
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "8",
               "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "64",
               "--micro-batch-size", "4", "--global-batch-size", "8", "--log-interval", "1",
               "--eval-iters", "1", "--lr-warmup-iters", "2"]

_RESTORED = re.compile(r"megatron-pec: rank (\d+): restored iteration (\d+) from "
                       r"(memory|storage|peer memory \(node \d+\))"
                       r"(?:, (\d+) iteration\(s\) behind the newest snapshot of any rank)?"
                       r"(?:; experts from older versions: (.*?))?"
                       r"(?:; \d+ item\(s\) from node memory checked where they landed)?"
                       r"(?:; \d+ item\(s\) from storage checked where they landed)?$", re.M)
_PLT = re.compile(r"megatron-pec: PLT ([0-9.]+)% \((\d+) of (\d+) expert-tokens lost", re.M)


class ClusterTimeout(AssertionError):
    """A bounded wait ran out: the job hung or never reached the awaited condition."""


@dataclass
class Restore:
    """What one rank logged about its restore."""

    rank: int
    iteration: int
    source: str                                             # "memory", "storage" or "peer memory (node K)"
    older: dict[str, int] = field(default_factory=dict)     # expert item -> restored version (< iteration)
    behind: int = 0  # a peer-memory restore: iterations behind the newest snapshot of any rank


def parse_restores(text: str) -> dict[int, Restore]:
    out = {}
    for m in _RESTORED.finditer(text):
        older = {}
        for part in filter(None, (p.strip() for p in (m.group(5) or "").split(","))):
            item, version = part.rsplit("@", 1)
            older[item] = int(version)
        out[int(m.group(1))] = Restore(int(m.group(1)), int(m.group(2)), m.group(3), older, int(m.group(4) or 0))
    return out


def parse_plt(text: str) -> float | None:
    """The PLT (as a fraction) of the last restore logged in ``text``, None if none was logged."""
    found = _PLT.findall(text)
    return float(found[-1][0]) / 100 if found else None


def _ppid_map() -> dict[int, int]:
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            parents[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def descendants(pid: int) -> list[int]:
    """``pid``'s living descendants (children first found, breadth-first)."""
    children: dict[int, list[int]] = {}
    for child, parent in _ppid_map().items():
        children.setdefault(parent, []).append(child)
    out, frontier = [], [pid]
    while frontier:
        nxt = []
        for p in frontier:
            nxt += children.get(p, [])
        out += nxt
        frontier = nxt
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, an identity that survives pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Cluster:
    """``nnodes`` simulated nodes of one training job (one rank each), sharing ``save`` storage."""

    def __init__(self, workdir: str | os.PathLike, shm_dir: str | os.PathLike, job_id: str, *, nnodes: int = 2,
                 model_args: list[str] = SMALL_MODEL, save: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, script: str | os.PathLike):
        self.workdir, self.shm_dir, self.job_id = Path(workdir), Path(shm_dir), job_id
        self.nnodes, self.model_args, self.script = nnodes, list(model_args), Path(script).resolve()
        if not self.script.is_file():
            raise FileNotFoundError(f"training script {self.script} not found")
        self.save = self.workdir / "checkpoints" if save is None else save if "://" in str(save) else Path(save)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.once_dir = self.workdir / "faults_fired"
        self.once_dir.mkdir(exist_ok=True)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.env.pop("MEGATRON_PEC_FAULT", None)
        self.launches = 0
        self.procs: dict[int, subprocess.Popen] = {}
        self._seen: dict[int, int | None] = {}  # pid -> start time of every process seen (for close)
        self._log_files: list = []
        self._paused: dict[int, int | None] = {}  # pid -> start time of the processes pause() stopped

    # ---- paths ---------------------------------------------------------------------------------
    def node_dir(self, node: int) -> Path:
        return self.shm_dir / self.job_id / f"node{node}"

    def log_path(self, node: int, launch: int | None = None) -> Path:
        return self.workdir / f"launch{launch or self.launches}.node{node}.log"

    def metrics_path(self, launch: int | None = None) -> Path:
        return self.workdir / f"launch{launch or self.launches}.metrics.jsonl"

    # ---- start ---------------------------------------------------------------------------------
    def launch(self, train_args: list[str], faults: str | dict[int, str] | None = None,
               env: dict[str, str] | None = None, node_env: dict[int, dict[str, str]] | None = None,
               checkpoint: bool = True) -> int:
        """Start every node with ``train_args`` (plus the model, --save/--load, shm dir, job id, metrics).

        ``faults``: one MEGATRON_PEC_FAULT spec for all nodes, or {node: spec}; ``node_env``: extra
        environment per node (e.g. its failure domain); ``checkpoint=False``: no --save/--load (a
        baseline without checkpoints). Agents
        started by a node inherit its spec; every point fires at most once per cluster.
        Returns the launch number (names its logs and metrics file).
        """
        if any(p.poll() is None for p in self.procs.values()):
            raise RuntimeError("launch() while the previous launch still runs; wait_exit() or kill_trainers()")
        self.launches += 1
        port = launcher.free_port()
        ckpt = ["--save", str(self.save), "--load", str(self.save), "--pec-shm-dir", str(self.shm_dir),
                "--pec-job-id", self.job_id, "--pec-agent-idle-timeout", "120"] if checkpoint else []
        args = [*self.model_args, *ckpt, "--metrics-file", str(self.metrics_path()), *train_args]
        self.procs = {}
        for node in range(self.nnodes):
            this_env = {**self.env, "MEGATRON_PEC_FAULT_ONCE": str(self.once_dir), **(env or {}),
                        **(node_env or {}).get(node, {})}
            spec = faults.get(node) if isinstance(faults, dict) else faults
            if spec:
                this_env["MEGATRON_PEC_FAULT"] = spec
            log = open(self.log_path(node), "w")
            self._log_files.append(log)
            job = launcher.Launch(self.script, tuple(args), nnodes=self.nnodes, node_rank=node,
                                  options=("--max-restarts", "0"))
            self.procs[node] = launcher.start(job, port=port, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, env=this_env, cwd=str(self.workdir),
                                              start_new_session=True)
            self._remember([self.procs[node].pid])
        return self.launches

    # ---- observe -------------------------------------------------------------------------------
    def log(self, node: int, launch: int | None = None) -> str:
        try:
            return self.log_path(node, launch).read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def logs(self, launch: int | None = None) -> str:
        return "\n".join(self.log(n, launch) for n in range(self.nnodes))

    def metrics(self, launch: int | None = None) -> list[dict]:
        try:
            lines = self.metrics_path(launch).read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # the trainer died mid-line
        return out

    def iteration(self, launch: int | None = None) -> int:
        """Newest iteration rank 0 finished (trained and saved) in this launch; 0 if none."""
        return max((r["iteration"] for r in self.metrics(launch) if "lm loss" in r), default=0)

    def restores(self, launch: int | None = None) -> dict[int, Restore]:
        return parse_restores(self.logs(launch))

    def agent_pid(self, node: int) -> int | None:
        """The pid of node ``node``'s living agent (checked: a stale agent.pid may name a reused pid)."""
        return launcher.agent_pid(self.node_dir(node))

    def wait_for(self, condition, timeout: float, what: str, poll: float = 0.05):
        """Poll ``condition()`` until it returns something truthy; raises ClusterTimeout after ``timeout`` s.

        Also fails early when every node has exited and the condition still does not hold.
        """
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if self.procs and all(p.poll() is not None for p in self.procs.values()):
                value = condition()
                if value:
                    return value
                raise ClusterTimeout(f"every node exited before {what}; logs in {self.workdir}:\n{self._tails()}")
            if time.monotonic() > deadline:
                raise ClusterTimeout(f"not {what} within {timeout:.0f}s; logs in {self.workdir}:\n{self._tails()}")
            time.sleep(poll)

    def wait_iteration(self, iteration: int, timeout: float = 120.0) -> int:
        return self.wait_for(lambda: self.iteration() >= iteration and self.iteration(), timeout,
                             f"at iteration {iteration}")

    def wait_log(self, pattern: str, node: int | None = None, timeout: float = 120.0) -> re.Match:
        regex = re.compile(pattern, re.M)
        text = (lambda: self.log(node)) if node is not None else self.logs
        return self.wait_for(lambda: regex.search(text()), timeout, f"logged /{pattern}/")

    def wait_file(self, path: str | os.PathLike, timeout: float = 120.0) -> Path:
        return self.wait_for(lambda: os.path.exists(path) and Path(path), timeout, f"file {path} present")

    def wait_exit(self, timeout: float = 180.0, nodes=None) -> dict[int, int]:
        """Return codes of the nodes; a node still running after ``timeout`` s is killed and fails the wait."""
        nodes = list(self.procs) if nodes is None else list(nodes)
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                self.procs[node].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_trainers()
                raise ClusterTimeout(f"node {node} did not exit within {timeout:.0f}s (hung); logs in "
                                     f"{self.workdir}:\n{self._tails()}") from None
        return {n: self.procs[n].returncode for n in nodes}

    def wait_stopped(self, timeout: float = 180.0, nodes=None) -> dict[int, int | None]:
        """After a fault: wait until no node runs training processes any more; returns exit codes.

        A node whose workers all finished but whose torchrun still waits in its exit barrier for a
        lost peer (torchrun waits up to 300 s there) is stopped as a scheduler would; its code is None.
        """
        nodes = list(self.procs) if nodes is None else list(nodes)
        had_workers: set[int] = set()

        def stopped() -> bool:
            done = True
            for n in nodes:
                if self.procs[n].poll() is not None:
                    continue
                if self._trainer_pids([n]):
                    had_workers.add(n)
                    done = False
                elif n not in had_workers:  # still starting its workers
                    done = False
            return done

        self.wait_for(stopped, timeout, "no node running training processes")
        codes = {}
        for n in nodes:
            codes[n] = self.procs[n].poll()
            if codes[n] is None:
                self.kill_trainers([n])
        return codes

    def _tails(self, lines: int = 15) -> str:
        out = []
        for n in range(self.nnodes):
            tail = self.log(n).splitlines()[-lines:]
            out.append(f"--- node {n} ---\n" + "\n".join(tail))
        return "\n".join(out)

    # ---- faults --------------------------------------------------------------------------------
    def _agent_pids(self) -> set[int]:
        return {p for n in range(self.nnodes) if (p := self.agent_pid(n)) is not None}

    def _remember(self, pids) -> None:
        for pid in pids:
            self._seen.setdefault(pid, _start_time(pid))

    def kill_trainers(self, nodes=None) -> None:
        """SIGKILL each node's torchrun and all its worker processes; node agents survive."""
        for node in (list(self.procs) if nodes is None else nodes):
            proc = self.procs[node]
            if proc.poll() is not None:
                continue  # exited (and reaped): its pid may belong to someone else now
            tree = [proc.pid] + self._trainer_pids([node])
            self._remember(tree)
            for pid in tree:          # the launcher first, so it cannot react to its workers dying
                _kill(pid)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                raise ClusterTimeout(f"node {node}'s torchrun survived SIGKILL") from None

    def _trainer_pids(self, nodes=None) -> list[int]:
        """Living worker processes of the nodes' launchers, agents excluded."""
        agents = self._agent_pids() | set(self._agents_by_cmdline())
        return [p for n in (list(self.procs) if nodes is None else nodes) if self.procs[n].poll() is None
                for p in descendants(self.procs[n].pid) if p not in agents]

    def pause(self, nodes=None) -> None:
        """SIGSTOP the training processes (not the agents), so a test can change the world between
        two of their steps without racing them; ``resume`` continues them."""
        self._paused = {pid: _start_time(pid) for pid in self._trainer_pids(nodes)}
        for pid in self._paused:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass  # a short-lived child that has just exited

    def resume(self, nodes=None) -> None:
        # Every process paused (still the same process) and everything under the launchers now:
        # SIGCONT is harmless to a process that is not stopped.
        paused = [p for p, start in self._paused.items() if _start_time(p) == start]
        launchers = [self.procs[n].pid for n in (list(self.procs) if nodes is None else nodes)
                     if self.procs[n].poll() is None]
        for pid in set(paused) | {d for p in launchers for d in descendants(p)}:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._paused = {}

    def kill_agent(self, node: int, timeout: float = 30.0) -> int | None:
        """SIGKILL node ``node``'s agent; returns its pid (None if none ran)."""
        pid = self.agent_pid(node)
        if pid is not None:
            launcher.stop_agents(self.node_dir(node), timeout_s=0)
            self._wait_alone(lambda: not _alive(pid), timeout, f"agent {pid} dead")
        return pid

    def wait_agents_exited(self, timeout: float = 60.0) -> None:
        """Wait until no node has a living agent (they finish a planned exit after their trainers)."""
        self._wait_alone(lambda: all(self.agent_pid(n) is None for n in range(self.nnodes)), timeout,
                         "every node agent exited")

    def _wait_alone(self, condition, timeout: float, what: str) -> None:
        """Like ``wait_for``, for conditions that do not need the trainers to be running."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise ClusterTimeout(f"not {what} within {timeout:.0f}s; logs in {self.workdir}:\n{self._tails()}")
            time.sleep(0.05)

    def lose_node(self, node: int) -> None:
        """Node loss: the node's trainer processes and agent are SIGKILLed and its memory is gone."""
        self.kill_trainers([node])
        self.kill_agent(node)
        launcher.stop_agents(self.node_dir(node))  # (also one whose agent.pid is gone)
        shutil.rmtree(self.node_dir(node), ignore_errors=True)

    def _agents_by_cmdline(self) -> list[int]:
        """Agents serving this cluster's node directories (found even if agent.pid is gone)."""
        return launcher.agents(self.shm_dir / self.job_id)

    # ---- cleanup -------------------------------------------------------------------------------
    def close(self, keep_memory: bool = False) -> None:
        """Kill every process this cluster started (trainers and agents) and, unless asked, its node memory."""
        for proc in self.procs.values():
            if proc.poll() is None:
                self._remember(descendants(proc.pid))
        same = [pid for pid, start in self._seen.items() if start is not None and _start_time(pid) == start]
        for pid in same:  # orphaned workers (their launcher was killed) and their children
            self._remember(descendants(pid))
        same = [pid for pid, start in self._seen.items() if start is not None and _start_time(pid) == start]
        for pid in same:
            _kill(pid)
        launcher.stop_agents(self.shm_dir / self.job_id, timeout_s=0)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for f in self._log_files:
            f.close()
        self._log_files = []
        for node in range(self.nnodes):  # (the agents' logs outlive their node memory: a failure's evidence)
            log = self.node_dir(node) / "agent.log"
            if log.exists():
                shutil.copyfile(log, self.workdir / f"agent.node{node}.log")
        if not keep_memory:
            shutil.rmtree(self.shm_dir / self.job_id, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def persist_only_plt(root: str | os.PathLike, iteration: int) -> float:
    """The PLT a restore of committed ``iteration`` from storage alone costs: every expert at the
    version its manifest records. Computed from the files' recorded cumulative token counts."""
    from megatron_pec.format.item_names import parse_item
    from megatron_pec.format.protocol import SlotHeader
    from megatron_pec.format.stformat import read_header
    from megatron_pec.pec import lost_tokens
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import open_storage

    root, storage = str(root), open_storage("posix")
    m = CheckpointDir(root, storage).read_manifest(iteration)
    tokens_at: dict[int, dict] = {}

    def tokens(version: int) -> dict:  # each rank's file has the counts of the experts it holds
        if version not in tokens_at:
            tokens_at[version] = {}
            for entry in (m.ranks if version == iteration else m.sources[str(version)]).values():
                path = os.path.join(root, entry.file)
                _, layout = read_header(lambda offset, n, path=path: storage.read_range(path, offset, n),
                                        storage.size(path))
                tokens_at[version].update({parse_item(k): v for k, v in
                                           SlotHeader.from_metadata(layout.metadata).tokens.items()})
        return tokens_at[version]

    at_target = tokens(iteration)
    at_version, version_of = {}, {}
    for item, version in m.experts.items():
        expert = parse_item(item)
        at_version[expert], version_of[expert] = tokens(version)[expert], version
    return lost_tokens.lost_tokens(at_target, at_version, version_of, iteration).fraction


def agent_logs(c: Cluster) -> str:
    """Every node agent's log of cluster ``c`` (what the agents said, fault injections included)."""
    return "\n".join((c.node_dir(n) / "agent.log").read_text() for n in range(c.nnodes)
                     if (c.node_dir(n) / "agent.log").exists())


def run_megatron_pec(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """``python -m megatron_pec ARGS`` (inspect / verify), output captured."""
    return subprocess.run([sys.executable, "-m", "megatron_pec", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


__all__ = ["Cluster", "ClusterTimeout", "agent_logs", "Restore", "parse_restores", "parse_plt", "SMALL_MODEL",
           "run_megatron_pec", "descendants", "persist_only_plt"]
