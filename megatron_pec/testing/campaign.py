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
import functools
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from megatron_pec.format.checkpoint_paths import storage_spec_for
from megatron_pec.store.checkpoint_dir import TRACKER, CheckpointDir
from megatron_pec.store.storage import open_storage
from megatron_pec.testing import object_store_fault
from megatron_pec.testing.cluster import (Cluster, ClusterTimeout, agent_logs, parse_plt, persist_only_plt,
                                          run_megatron_pec)

# Every expert saved: a memory snapshot every iteration, a persisted checkpoint every 2.
FULL = ["--train-iters", "12", "--save-interval", "2", "--non-persistent-save-interval", "1", "--pec-keep", "0"]
FULL_ITERS, FULL_SNAPSHOT_INTERVAL = 12, 1
# PEC: 1 of 8 experts per layer to memory every 2 iterations and persisted every 4: most experts
# restore from versions the agent carried forward beyond the three-slot ring.
PEC = ["--train-iters", "16", "--save-interval", "4", "--non-persistent-save-interval", "2",
       "--pec-snapshot-k", "1", "--pec-persist-k", "1", "--pec-keep", "2"]
PEC_ITERS, PEC_SNAPSHOT_INTERVAL, PEC_SAVE_INTERVAL = 16, 2, 4
TIMEOUT = 180.0
DEFAULT_SCRIPT = os.path.join("examples", "gpt_moe", "pretrain_gpt_moe.py")

TRAINER_POINTS = ("snapshot_begin", "snapshot_mid", "snapshot_end", "optimizer_step")
AGENT_POINTS = ("agent_recorded", "persist_write", "before_rename", "before_node_marker", "before_manifest",
                "before_tracker")
DAMAGE = ("flip_byte", "truncate", "delete_rank_file", "manifest_missing_file")
TYPES = ("trainer_kill_point", "trainer_kill_random", "agent_kill_point", "agent_kill_random", "node_loss",
         "storage_error", "storage_full", "corruption", "replica_holder_kill", "replica_link_drop",
         "replica_corrupt", "two_nodes_lost", "planned_exit", "relaunch_finished", "restart_during_persist",
         "slow_replica_node_loss", "object_store_crash")
REPLICA_LAG = 2  # --pec-replica-lag's default: how many snapshots a node's newest replica may lag


def _checkpoints(root) -> CheckpointDir:
    return CheckpointDir(str(root), open_storage(storage_spec_for("", str(root))))


class Failure(AssertionError):
    """A broken promise; the message says which."""


def check(condition, message: str) -> None:
    if not condition:
        raise Failure(message)


class Campaign:
    def __init__(self, workdir: Path, shm: Path, seed: int, script: Path, keep_failed: bool = True):
        self.workdir, self.shm, self.rng, self.script = workdir, shm, random.Random(seed), script
        self.keep_failed = keep_failed
        self.can_mount = os.geteuid() == 0 and shutil.which("mount") is not None
        self.types = [t for t in TYPES if (t != "storage_full" or self.can_mount)  # (what this machine can run)
                      and (t != "object_store_crash" or object_store_fault.available())]
        self.reference: dict[int, float] = {}
        self.reference_ckpt: Path | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """The uninterrupted reference run (losses, and a checkpoint directory to damage)."""
        c = Cluster(self.workdir / "reference", self.shm, "fcref", script=self.script)
        try:
            c.launch(FULL)
            codes = c.wait_exit(TIMEOUT)
            if codes != {0: 0, 1: 0}:
                raise RuntimeError(f"the reference run failed: {codes}\n{c.logs()[-4000:]}")
            self.reference = {r["iteration"]: r["lm loss"] for r in c.metrics() if "lm loss" in r}
            self.reference_ckpt = c.save
        finally:
            c.close()

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
            getattr(self, "_" + spec["type"])(c, spec, result)
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

    # ---- fault types -----------------------------------------------------------------------------
    def _train_args(self, config: str) -> list[str]:
        return list(FULL if config == "full" else PEC)

    def _restart_and_finish(self, c: Cluster, spec: dict, result: dict, config: str) -> None:
        """After a launch that died: relaunch, finish, and check the restore (invariants 5, 7)."""
        reached = c.iteration()
        before = set(_checkpoints(c.save).committed_iterations())
        result["newest_committed_before"] = max(before, default=0)
        c.launch(self._train_args(config))
        codes = c.wait_exit(TIMEOUT)
        check(codes == {0: 0, 1: 0}, f"the restart failed: exit codes {codes}: {c.logs()[-1500:]}")
        restores = c.restores()
        iters = FULL_ITERS if config == "full" else PEC_ITERS
        # (the fault may have hit after the last iteration: then the restart only restores and validates)
        finished = max([c.iteration()] + [r.iteration for r in restores.values()]) == iters
        check(finished and any("validation loss" in r for r in c.metrics()), "the restart did not finish training")
        if not restores:
            check("no checkpoint found" in c.logs(), "neither a restore nor 'training from scratch' was logged")
            check(not before, f"iterations {sorted(before)} were committed, yet the restart trained from scratch")
            result.update(restored_iteration=0, reached_iteration=reached, iterations_lost=reached,
                          resumed_from="scratch")
            return
        check(set(restores) == {0, 1}, f"restore lines from ranks {sorted(restores)} only")
        target = {r.iteration for r in restores.values()}
        check(len(target) == 1, f"ranks restored different iterations: {restores}")
        target = target.pop()
        sources = {r: x.source for r, x in restores.items()}
        result.update(restored_iteration=target, reached_iteration=reached, iterations_lost=reached - target,
                      resumed_from="+".join(sorted(set(sources.values()))), sources=sources)
        result["plt"] = parse_plt(c.logs())
        if config == "pec":
            check(result["plt"] is not None and 0 <= result["plt"] < 1, f"PLT not logged: {result['plt']}")
        for x in restores.values():
            check(all(v < target for v in x.older.values()), f"expert versions after the target: {x}")

    def _common_end_checks(self, c: Cluster, result: dict, config: str) -> None:
        """Nothing partial is latest, everything committed is sound; bit-exact losses with every expert."""
        committed = _checkpoints(c.save).committed_iterations()
        if committed or config != "storage":
            verify = run_megatron_pec("verify", c.save)
            check(verify.returncode == 0, f"verify failed after recovery: {verify.stdout.strip()[-800:]}")
        tracker = _checkpoints(c.save).read_tracker()
        check(tracker is None or (tracker.isdigit() and int(tracker) in committed),
              f"tracker names {tracker}, committed: {committed}")
        if config in ("full", "storage"):
            for launch in range(1, c.launches + 1):
                for r in c.metrics(launch):
                    if "lm loss" in r:
                        check(r["lm loss"] == self.reference[r["iteration"]],
                              f"launch {launch} iteration {r['iteration']}: loss {r['lm loss']!r} != reference "
                              f"{self.reference[r['iteration']]!r}")

    def _check_trainer_kill(self, c: Cluster, result: dict, config: str) -> None:
        """Invariant 5: from node memory, at most one snapshot interval lost, counted from the newest
        snapshot taken: a snapshot skipped for want of a free slot (invariant 2, warned) adds one."""
        interval = FULL_SNAPSHOT_INTERVAL if config == "full" else PEC_SNAPSHOT_INTERVAL
        skipped = {int(i) for i in re.findall(r"skipped the snapshot of iteration (\d+)", c.logs(c.launches - 1))}
        lost_to_skips = sorted(i for i in skipped
                               if result["restored_iteration"] < i <= (result["reached_iteration"] or 0))
        result["skipped_snapshots"] = lost_to_skips
        allowed = interval * (1 + len(lost_to_skips))
        check(result["iterations_lost"] <= allowed, f"lost {result['iterations_lost']} iterations "
                                                     f"(snapshot interval {interval}, skipped {lost_to_skips})")
        if result["resumed_from"] not in ("memory", "scratch"):
            # Killed after training ended: the other node had exited cleanly and its agent cleared
            # its memory, as on every clean exit; the final persisted iteration is the newest state.
            check(result["iterations_lost"] == 0 and result["restored_iteration"] == result["newest_committed_before"],
                  f"restored from {result.get('sources')}, not memory")

    def _trainer_kill_point(self, c: Cluster, spec: dict, result: dict) -> None:
        node, config = spec["node"], spec["config"]
        c.launch(self._train_args(config), faults={node: f"{spec['point']}=kill@{spec['nth']}:{node}"})
        codes = c.wait_stopped(TIMEOUT)
        result["fired"] = f"fault injection: kill at {spec['point']}" in c.log(node)
        check(result["fired"] and codes[node] != 0, f"the fault did not fire (exit codes {codes})")
        self._restart_and_finish(c, spec, result, config)
        self._check_trainer_kill(c, result, config)
        self._common_end_checks(c, result, config)

    def _trainer_kill_random(self, c: Cluster, spec: dict, result: dict) -> None:
        node, config = spec["node"], spec["config"]
        c.launch(self._train_args(config))
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
        time.sleep(spec["delay_s"])  # the random instant itself
        c.kill_trainers([node])
        result["fired"] = True
        c.wait_stopped(TIMEOUT)  # the other node notices by itself
        self._restart_and_finish(c, spec, result, config)
        self._check_trainer_kill(c, result, config)
        self._common_end_checks(c, result, config)

    def _agent_kill_point(self, c: Cluster, spec: dict, result: dict) -> None:
        node, point = spec["node"], spec["point"]
        scoped = ("agent_recorded", "persist_write", "before_rename", "before_node_marker")
        scope = f":{node}" if point in scoped else ""
        c.launch(FULL, faults=f"{point}=kill@{spec['nth']}{scope}")
        codes = c.wait_exit(TIMEOUT)
        self._agent_outcome(c, result, codes, f"fault injection: kill at {point}")

    def _agent_kill_random(self, c: Cluster, spec: dict, result: dict) -> None:
        c.launch(FULL)
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
        time.sleep(spec["delay_s"])
        result["fired"] = c.kill_agent(spec["node"]) is not None
        codes = c.wait_exit(TIMEOUT)
        self._agent_outcome(c, result, codes, None)

    def _agent_outcome(self, c: Cluster, result: dict, codes: dict, fired_line: str | None) -> None:
        """Invariant 6: training went on to the end untouched, with a warning and a new agent."""
        if fired_line is not None:
            result["fired"] = fired_line in agent_logs(c)
        check(codes == {0: 0, 1: 0}, f"training stopped: exit codes {codes}: {c.logs()[-1500:]}")
        check(c.iteration() == FULL_ITERS, "training did not reach the last iteration")
        result.update(resumed_from="continued", iterations_lost=0, restored_iteration=None)
        if result["fired"]:
            logs = c.logs()
            check("lost the node agent" in logs or "the node agent died" in logs or "not running" in logs,
                  "no warning about the lost agent")
            result["new_agent"] = "connected to a new node agent" in logs
        self._common_end_checks(c, result, "full")

    def _node_loss(self, c: Cluster, spec: dict, result: dict) -> None:
        node = spec["node"]
        c.launch(PEC)
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
        c.lose_node(node)
        result["fired"] = True
        c.wait_stopped(TIMEOUT)  # the survivor notices by itself
        # The survivor's agent may still commit an iteration both nodes had saved: at least this one.
        committed_at_loss = max(_checkpoints(c.save).committed_iterations(), default=0)
        # What storage alone would cost, now: retention may retire that iteration before the run ends.
        storage_only = round(persist_only_plt(c.save, committed_at_loss), 6) if committed_at_loss else None
        self._restart_and_finish(c, spec, result, "pec")
        sources, target = result.get("sources", {}), result["restored_iteration"]
        lost_from, survivor = sources.get(node), 1 - node
        check(committed_at_loss <= target <= result["reached_iteration"],
              f"restored {target}: older than the newest persisted iteration {committed_at_loss} or newer than "
              f"{result['reached_iteration']}")
        if target:
            # The lost node's ranks: from their replica in the survivor's memory, else storage (a persisted
            # iteration then, which the survivor restores from its own memory or storage).
            check(lost_from in ("storage", f"peer memory (node {survivor})"),
                  f"lost node {node} restored from {lost_from}")
            if lost_from == "storage":
                check(target % PEC_SAVE_INTERVAL == 0, f"storage restore of {target}: not a persisted iteration")
            result["survivor_from"] = sources.get(survivor)
            if target == committed_at_loss:
                result["plt_storage_only"] = storage_only
                if sources.get(survivor) == "memory":  # memory versions are never older than the persisted ones
                    check(result["plt"] <= result["plt_storage_only"],
                          f"PLT {result['plt']} above storage-only {result['plt_storage_only']}")
        self._common_end_checks(c, result, "pec")

    # ---- replication (every expert saved, so every loss after a restore is checked bit-exactly) -------
    def _replica_holder_kill(self, c: Cluster, spec: dict, result: dict) -> None:
        """The holder's agent is SIGKILLed mid-way through receiving a replica; later the node is lost."""
        self._replica_fault(c, spec, result, "kill")

    def _replica_link_drop(self, c: Cluster, spec: dict, result: dict) -> None:
        """The link between the agents breaks mid-transfer (an I/O error on the holder's side of the
        socket); later the node is lost."""
        self._replica_fault(c, spec, result, "eio")

    def _replica_fault(self, c: Cluster, spec: dict, result: dict, action: str) -> None:
        node, holder = spec["node"], 1 - spec["node"]
        c.launch(FULL, faults={holder: f"replica_receive={action}@{spec['nth']}:{holder}"})
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)

        def fired() -> None:  # (after the loss: a transfer under way at the iteration may still hit it)
            result["fired"] = f"fault injection: {action} at replica_receive" in agent_logs(c)

        self._lose(c, [node], spec, result, before_restart=fired)
        lost_from = result["sources"].get(node) if result.get("sources") else None
        check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
        self._common_end_checks(c, result, "full")

    def _replica_corrupt(self, c: Cluster, spec: dict, result: dict) -> None:
        """The node is lost and the one replica of it has a flipped byte: it must not be restored."""
        from megatron_pec.agent.replica_transport import INDEX
        from megatron_pec.memory.node_files import REPLICAS
        from megatron_pec.format.protocol import ReplicaIndex

        node, holder = spec["node"], 1 - spec["node"]
        directory = c.node_dir(holder) / REPLICAS

        def replica():
            try:
                return ReplicaIndex.loads((directory / INDEX).read_bytes()).entries.get(f"{node}.{node}")
            except OSError:
                return None  # no replica landed yet

        # The node is held in its next optimizer step until it is lost: training must not end (and free
        # node memory, the replica included) while the replica is awaited on a loaded machine.
        c.launch(FULL, faults={node: f"optimizer_step=stall@{spec['iteration'] + 1}:{node}"},
                 node_env={node: {"MEGATRON_PEC_FAULT_STALL_S": str(TIMEOUT)}})
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
        c.wait_for(replica, TIMEOUT, f"a replica of node {node} on node {holder}")

        def damage() -> None:
            entry = replica()
            check(entry is not None, f"node {holder} holds no replica of node {node}")
            path = directory / f"node{node}.rank{node}.replica"
            offset = int(spec["offset_fraction"] * (path.stat().st_size - 1))
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ 0x10]))
            result["fired"] = True

        self._lose(c, [node], spec, result, before_restart=damage)
        if result["restored_iteration"]:
            check(result["sources"][node] == "storage", f"node {node} restored from a damaged replica")
        self._common_end_checks(c, result, "full")

    def _two_nodes_lost(self, c: Cluster, spec: dict, result: dict) -> None:
        """Both nodes lost (the lost node and its only replica holder): storage, the newest commit."""
        c.launch(FULL)
        c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
        result["fired"] = True
        self._lose(c, [0, 1], spec, result)
        if result["restored_iteration"]:
            check(set(result["sources"].values()) == {"storage"}, f"restored from {result['sources']}")
            check(result["restored_iteration"] == result["newest_committed_before"],
                  f"restored {result['restored_iteration']}, not the newest commit {result['newest_committed_before']}")
        self._common_end_checks(c, result, "full")

    def _lose(self, c: Cluster, nodes: list[int], spec: dict, result: dict, before_restart=None) -> None:
        for node in nodes:
            c.lose_node(node)
        c.wait_stopped(TIMEOUT)  # a survivor notices by itself
        if before_restart is not None:
            before_restart()
        self._restart_and_finish(c, spec, result, "full")

    def _object_store_crash(self, c: Cluster, spec: dict, result: dict) -> None:
        object_store_fault.run(c, spec, result, script=self.script, train_args=FULL, timeout=TIMEOUT,
                               outcome=functools.partial(self._storage_outcome, must_commit_last=True))

    def _storage_error(self, c: Cluster, spec: dict, result: dict) -> None:
        node = spec["node"]
        c.launch(FULL, faults={node: f"{spec['point']}={spec['action']}@{spec['nth']}:{node}"})
        codes = c.wait_exit(TIMEOUT)
        result["fired"] = f"fault injection: {spec['action']} at {spec['point']}" in (
            c.node_dir(node) / "agent.log").read_text()
        self._storage_outcome(c, result, codes, "injected " + spec["action"].upper())

    def _storage_full(self, c: Cluster, spec: dict, result: dict) -> None:
        c.save.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size_mib']}m", "tmpfs", str(c.save)], check=True)
        result["_mounts"] = [c.save]
        c.launch(FULL)
        codes = c.wait_exit(TIMEOUT)
        result["fired"] = "No space left on device" in c.logs()
        self._storage_outcome(c, result, codes, "No space left on device" if result["fired"] else None)

    def _storage_outcome(self, c: Cluster, result: dict, codes: dict, error: str | None,
                         must_commit_last: bool = False) -> None:
        """Invariant 8: training continues, the error is reported, nothing that failed is committed (with
        ``must_commit_last``: the storage came back before the end, the last iteration is committed)."""
        check(codes == {0: 0, 1: 0}, f"training stopped: exit codes {codes}: {c.logs()[-1500:]}")
        check(c.iteration() == FULL_ITERS, "training did not reach the last iteration")
        logs = c.logs()
        failed = {int(i) for i in re.findall(r"snapshot of iteration (\d+) was not persisted", logs)}
        if error is not None:
            check(error in logs and failed, f"the error ({error}) was not reported to the trainer")
        committed = set(_checkpoints(c.save).committed_iterations())
        for i in failed & committed:
            # Only a failure at the commit itself leaves the iteration committed: writing the tracker
            # (a hint), or this node's manifest write when every node's files were durable and
            # another node's agent wrote the same manifest (``verify`` below checks every file).
            said = re.findall(rf"snapshot of iteration {i} was not persisted: (.*)", logs)
            check(said and all(TRACKER in line or "manifest.json" in line for line in said),
                  f"iteration {i} failed ({said}) yet is committed")
        check(not must_commit_last or FULL_ITERS in committed,
              f"the persists after the fault did not commit: {committed}")
        result.update(resumed_from="continued", iterations_lost=0, failed_iterations=sorted(failed))
        self._common_end_checks(c, result, "storage")

    # ---- planned exits and relaunches (issue 29: nothing lost, nothing committed rewritten) -----------
    @staticmethod
    def _pec_args(k: int) -> list[str]:
        return ["--pec-snapshot-k", str(k), "--pec-persist-k", "1"]

    def _planned_exit(self, c: Cluster, spec: dict, result: dict) -> None:
        """--exit-interval between persists with partial snapshots: the exit saves its iteration with every
        expert; the restart restores it from storage with PLT 0 and resumes bit-exactly."""
        exit_at = spec["exit"]
        c.launch(FULL + self._pec_args(spec["k"]) + ["--exit-interval", str(exit_at)])
        codes = c.wait_exit(TIMEOUT)
        check(codes == {0: 0, 1: 0}, f"the planned exit failed: exit codes {codes}: {c.logs()[-1500:]}")
        result["fired"] = f"planned exit: iteration {exit_at} saved once more with every expert" in c.logs()
        c.wait_agents_exited()
        m = _checkpoints(c.save).read_manifest(exit_at)
        check(set(m.experts.values()) == {exit_at}, f"iteration {exit_at} committed without every expert at it")
        self._relaunch(c, FULL + self._pec_args(spec["k"]), exit_at, result)
        check(c.iteration() == FULL_ITERS, "the restart did not finish training")
        self._common_end_checks(c, result, "full")

    def _relaunch_finished(self, c: Cluster, spec: dict, result: dict) -> None:
        """A finished job launched again (another PEC K the second time): it restores the last iteration whole
        from storage, trains nothing and writes none of its files again."""
        c.launch(FULL + self._pec_args(spec["k"]))
        codes = c.wait_exit(TIMEOUT)
        check(codes == {0: 0, 1: 0}, f"training failed: exit codes {codes}: {c.logs()[-1500:]}")
        c.wait_agents_exited()
        result["fired"] = True
        files = {p: p.stat().st_mtime_ns for p in (c.save / f"iter_{FULL_ITERS:07d}" / "pec").iterdir()}
        self._relaunch(c, FULL + self._pec_args(spec["relaunch_k"]), FULL_ITERS, result)
        c.wait_agents_exited()
        check(not [r for r in c.metrics() if "lm loss" in r], "the relaunch trained again")
        now = {p: p.stat().st_mtime_ns for p in (c.save / f"iter_{FULL_ITERS:07d}" / "pec").iterdir()}
        check(now == files, f"the committed iteration's files changed: {sorted(set(now.items()) ^ set(files.items()))}")
        self._common_end_checks(c, result, "full")

    def _relaunch(self, c: Cluster, args: list[str], expected: int, result: dict) -> None:
        """Launch again after a clean end: every rank restores ``expected`` from storage, PLT 0."""
        c.launch(args)
        codes = c.wait_exit(TIMEOUT)
        check(codes == {0: 0, 1: 0}, f"the relaunch failed: exit codes {codes}: {c.logs()[-1500:]}")
        restores = c.restores()
        found = {r: (x.iteration, x.source, bool(x.older)) for r, x in restores.items()}
        check(found == {0: (expected, "storage", False), 1: (expected, "storage", False)},
              f"restored {found}, expected iteration {expected} whole from storage")
        result.update(restored_iteration=expected, reached_iteration=expected, iterations_lost=0,
                      resumed_from="storage", plt=parse_plt(c.logs()))
        check(result["plt"] == 0.0, f"PLT {result['plt']} after a planned exit")

    def _restart_during_persist(self, c: Cluster, spec: dict, result: dict) -> None:
        """The node's trainers die while its agent writes a rank file (the rename stalls 3 s): the write and
        the commit still end, and the restart restores from node memory."""
        node = spec["node"]
        c.launch(FULL, faults={node: f"before_rename=stall@{spec['nth']}:{node}"})
        c.wait_for(lambda: "fault injection: stall at before_rename" in agent_logs(c), TIMEOUT,
                   "the stalled rename")
        c.kill_trainers([node])
        result["fired"] = True
        c.wait_stopped(TIMEOUT)
        self._restart_and_finish(c, spec, result, "full")
        self._check_trainer_kill(c, result, "full")
        self._common_end_checks(c, result, "full")

    def _slow_replica_node_loss(self, c: Cluster, spec: dict, result: dict) -> None:
        """The replica holder stalls mid-transfer and the node is lost meanwhile: its ranks restore from the
        replica in the holder's memory (at most --pec-replica-lag snapshots behind: the trainers waited
        rather than run further ahead) or, if none landed, from storage."""
        node, holder = spec["node"], 1 - spec["node"]
        c.launch(FULL, faults={holder: f"replica_receive=stall@{spec['nth']}:{holder}"})
        c.wait_for(lambda: "fault injection: stall at replica_receive" in agent_logs(c), TIMEOUT,
                   "the stalled transfer")
        result["fired"] = True
        self._lose(c, [node], spec, result)
        lost_from = result["sources"].get(node) if result.get("sources") else None
        check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
        if lost_from == f"peer memory (node {holder})":
            # the newest snapshot, one iteration past it trained, the replica up to the bound behind
            check(result["iterations_lost"] <= (REPLICA_LAG + 1) * FULL_SNAPSHOT_INTERVAL,
                  f"lost {result['iterations_lost']} iterations with --pec-replica-lag {REPLICA_LAG}")
        self._common_end_checks(c, result, "full")

    def _corruption(self, c: Cluster, spec: dict, result: dict) -> None:
        """Invariant 4: damage the newest one or two iterations (and maybe the tracker); the restart
        must fall back past them with a message, never accept them, and resume bit-exactly."""
        shutil.copytree(self.reference_ckpt, c.save)
        root = str(c.save)
        for iteration, kind in spec["damage"]:
            self._damage(c.save, iteration, kind, spec["node"], result)
        if spec["stale_tracker"]:
            (c.save / TRACKER).write_text(str(FULL_ITERS + 2))
        result["fired"] = True
        verify = run_megatron_pec("verify", c.save)
        check(verify.returncode != 0, "verify accepted the damaged checkpoint")
        expected = FULL_ITERS - 2 * len(spec["damage"])
        check(run_megatron_pec("verify", c.save, "--iteration", expected).returncode == 0,
              f"iteration {expected} is damaged too")
        c.launch(FULL)
        codes = c.wait_exit(TIMEOUT)
        check(codes == {0: 0, 1: 0}, f"the restart failed: exit codes {codes}: {c.logs()[-1500:]}")
        restores = c.restores()
        targets = {x.iteration for x in restores.values()}
        check(set(restores) == {0, 1} and targets == {expected}, f"restored {sorted(targets)}, expected {expected}")
        check(c.logs().count("falling back to an older checkpoint") >= len(spec["damage"]), "no fall-back message")
        if spec["stale_tracker"]:
            check("which has no valid manifest" in c.logs(), "the stale tracker was not reported")
        check(c.iteration() == FULL_ITERS, "training did not finish after the fall-back")
        result.update(restored_iteration=expected, reached_iteration=FULL_ITERS,
                      iterations_lost=FULL_ITERS - expected, resumed_from="storage")
        check(_checkpoints(root).committed_iterations()[0] == FULL_ITERS, "the redone iterations were not committed")
        self._common_end_checks(c, result, "full")

    def _damage(self, root: Path, iteration: int, kind: str, rank: int, result: dict) -> None:
        victim = root / _checkpoints(root).read_manifest(iteration).ranks[str(rank)].file
        if kind == "flip_byte":
            with open(victim, "r+b") as f:
                offset = self.rng.randrange(os.path.getsize(victim))
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
            result.setdefault("offsets", []).append(offset)
        elif kind == "truncate":
            os.truncate(victim, self.rng.randrange(os.path.getsize(victim)))
        elif kind == "delete_rank_file":
            os.unlink(victim)
        elif kind == "manifest_missing_file":
            path = Path(_checkpoints(root).manifest_path(iteration))
            m = json.loads(path.read_text())
            m["ranks"][str(rank)]["file"] = f"iter_{iteration:07d}/pec/rank_09999.safetensors"
            path.write_text(json.dumps(m))


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
    median = lambda rows: statistics.median(r["plt"] for r in rows) if rows else None  # noqa: E731
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
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
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
