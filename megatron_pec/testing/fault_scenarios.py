"""The fault scenarios, one function per fault type (``TYPES``), and the checks they share: what each
injects into a simulated 2-node job (``testing/cluster.py``) and what the architecture's invariants promise
after it. Written once for both drivers: ``Campaign`` (``testing/campaign.py``) draws a type and its
parameters and runs its scenario, ``SCENARIOS[type](bench, cluster, spec, result)``; the pytest fault tests
(``tests/test_faults.py``) run a scenario with a chosen spec, or use its checks and helpers in their own
fixed sequences. A scenario fills ``result`` and raises ``Failure`` (an ``AssertionError``) where a promise
is broken. ``bench`` is what a scenario runs against (``Bench``): the uninterrupted ``Reference`` run, the
training script, the random numbers damage is drawn from.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_pec.format.checkpoint_paths import storage_spec_for
from megatron_pec.store.checkpoint_dir import TRACKER, CheckpointDir
from megatron_pec.store.storage import open_storage
from megatron_pec.testing import object_store_fault
from megatron_pec.testing.cluster import Cluster, agent_logs, parse_plt, persist_only_plt, run_megatron_pec

# Every expert saved: a memory snapshot every iteration, a persisted checkpoint every 2; nothing deleted.
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


def committed(root) -> list[int]:
    """The committed iterations of checkpoint directory ``root``, oldest first."""
    return sorted(_checkpoints(root).committed_iterations())


def tracker(root) -> str | None:
    """What ``root``'s tracker file says (None when there is none)."""
    return _checkpoints(root).read_tracker()


class Failure(AssertionError):
    """A broken promise; the message says which."""


def check(condition, message: str) -> None:
    if not condition:
        raise Failure(message)


def check_sound(root) -> None:
    """Invariant 1: every committed iteration of ``root`` verifies (``python -m megatron_pec verify``) and the
    tracker, if any, names a committed iteration."""
    verify = run_megatron_pec("verify", root)
    check(verify.returncode == 0, f"verify failed: {(verify.stdout + verify.stderr).strip()[-2000:]}")
    names, done = tracker(root), committed(root)
    check(names is None or (names.isdigit() and int(names) in done), f"tracker names {names}, committed: {done}")


@dataclass
class Reference:
    """The uninterrupted run (``FULL``) every faulted run is compared with: its losses by iteration, its
    checkpoint directory (moved to ``archive``; ``save_path``, where it was written, is free for a run that
    needs that exact --load path) and, when kept, its node memory as the job left it (``memory``:
    ``node<k>/``, the slots of iterations 10-12)."""

    losses: dict[int, float]
    archive: Path
    save_path: Path
    memory: Path | None = None

    @classmethod
    def run(cls, workdir, shm_dir, job_id: str, script, keep_memory: bool = False) -> "Reference":
        """Train ``FULL`` once as job ``job_id`` and check it: both nodes exit 0, every persist commits,
        a loss is logged for every iteration."""
        c = Cluster(workdir, shm_dir, job_id, script=script)
        try:
            c.launch(FULL + (["--pec-keep-shm"] if keep_memory else []))
            codes = c.wait_exit(TIMEOUT)
            check(codes == {0: 0, 1: 0}, f"the reference run failed: exit codes {codes}\n{c.logs()[-4000:]}")
            check(committed(c.save) == list(range(2, FULL_ITERS + 1, 2)),
                  f"the reference run committed {committed(c.save)}")
            c.wait_agents_exited()
            losses = {r["iteration"]: r["lm loss"] for r in c.metrics(1) if "lm loss" in r}
            check(sorted(losses) == list(range(1, FULL_ITERS + 1)), f"reference losses of {sorted(losses)}")
            archive = c.workdir / "checkpoints_archive"
            shutil.move(str(c.save), archive)
        finally:
            c.close(keep_memory=True)
        memory = c.workdir / "memory_archive" if keep_memory else None
        for node in range(c.nnodes) if keep_memory else ():
            shutil.copytree(c.node_dir(node), memory / f"node{node}")
        shutil.rmtree(c.shm_dir / job_id, ignore_errors=True)
        return cls(losses, archive, c.save, memory)

    def check_losses(self, c: Cluster, launches=None) -> int:
        """Every loss a launch of ``c`` logged (every launch, or those in ``launches``) equals the reference's
        at that iteration exactly (floats compared with ==: the resumed state is the saved one); returns
        how many were compared."""
        compared = 0
        for launch in launches or range(1, c.launches + 1):
            for r in c.metrics(launch):
                if "lm loss" in r:
                    expected = self.losses.get(r["iteration"])
                    check(r["lm loss"] == expected, f"launch {launch} iteration {r['iteration']}: loss "
                          f"{r['lm loss']!r} != reference {expected!r}: the resumed state differs from the saved one")
                    compared += 1
        return compared


@dataclass
class Bench:
    """What a scenario runs against (``Campaign`` builds one after its reference run; a test builds its own)."""

    reference: Reference
    script: Path
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # damage offsets


def can_mount() -> bool:
    """Whether this process may mount (a tmpfs, a read-only bind mount): root and mount(8)."""
    return os.geteuid() == 0 and shutil.which("mount") is not None


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced by ``value``."""
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


def held(node: int, after: int, restored_at: int = 0, faults: dict[int, str] | None = None,
         node_env: dict[int, dict[str, str]] | None = None, stall_s: float = 120.0) -> dict:
    """``Cluster.launch`` arguments that hold ``node``'s rank (one rank a node) in its optimizer step after
    iteration ``after`` until the node is lost (a stall of ``stall_s``), so that a loss comes after ``after``
    however fast the machine is. ``restored_at``: the iteration the launch resumes from (its steps are
    counted from there); ``faults`` and ``node_env``: the launch's others, none on ``node``. Wait for it
    with ``wait_held``."""
    faults, node_env = dict(faults or {}), {n: dict(e) for n, e in (node_env or {}).items()}
    check(node not in faults, "a held node carries no other fault")
    faults[node] = f"optimizer_step=stall@{after + 1 - restored_at}:{node}"
    # (the node's one trainer is the only process reaching the point: it stalls whatever earlier launches
    # of the cluster fired)
    node_env.setdefault(node, {}).update(MEGATRON_PEC_FAULT_STALL_S=f"{stall_s:g}", MEGATRON_PEC_FAULT_ONCE="")
    return {"faults": faults, "node_env": node_env}


def wait_held(c: Cluster, node: int, timeout: float = TIMEOUT) -> None:
    c.wait_log("fault injection: stall at optimizer_step", node=node, timeout=timeout)


def flip_bits(path, offset: int, mask: int) -> int:
    """XOR the byte at ``offset`` of file ``path`` (counted from the end when negative) with ``mask``;
    returns its offset from the start."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        at = f.tell()
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ mask]))
    return at


def replica_path(c: Cluster, holder: int, node: int, rank: int) -> Path | None:
    """The file in node ``holder``'s memory holding its replica of node ``node``'s rank ``rank``; None while
    its replica index lists none."""
    from megatron_pec.agent.replica_transport import INDEX
    from megatron_pec.format.protocol import ReplicaIndex
    from megatron_pec.memory.node_files import REPLICAS

    directory = c.node_dir(holder) / REPLICAS
    try:
        entries = ReplicaIndex.loads((directory / INDEX).read_bytes()).entries
    except OSError:
        return None  # no replica landed yet
    return directory / f"node{node}.rank{rank}.replica" if f"{node}.{rank}" in entries else None


def train_args(config: str) -> list[str]:
    return list(FULL if config == "full" else PEC)


def restart_and_finish(bench, c: Cluster, spec: dict, result: dict, config: str) -> None:
    """After a launch that died: relaunch, finish, and check the restore (invariants 5, 7)."""
    reached = c.iteration()
    before = set(committed(c.save))
    result["newest_committed_before"] = max(before, default=0)
    c.launch(train_args(config))
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


def common_end_checks(bench, c: Cluster, result: dict, config: str) -> None:
    """Nothing partial is latest, everything committed is sound; bit-exact losses with every expert (how
    many were compared: ``result["losses_compared"]``)."""
    if committed(c.save) or config != "storage":
        check_sound(c.save)
    else:  # (nothing committed: there is nothing to verify, and the tracker must not name anything)
        check(tracker(c.save) is None, f"tracker names {tracker(c.save)}, nothing committed")
    if config in ("full", "storage"):
        result["losses_compared"] = bench.reference.check_losses(c)


def check_trainer_kill(bench, c: Cluster, result: dict, config: str) -> None:
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


def trainer_kill_point(bench, c: Cluster, spec: dict, result: dict) -> None:
    node, config = spec["node"], spec["config"]
    c.launch(train_args(config), faults={node: f"{spec['point']}=kill@{spec['nth']}:{node}"})
    codes = c.wait_stopped(TIMEOUT)
    result["fired"] = f"fault injection: kill at {spec['point']}" in c.log(node)
    check(result["fired"] and codes[node] != 0, f"the fault did not fire (exit codes {codes})")
    restart_and_finish(bench, c, spec, result, config)
    check_trainer_kill(bench, c, result, config)
    common_end_checks(bench, c, result, config)


def trainer_kill_random(bench, c: Cluster, spec: dict, result: dict) -> None:
    node, config = spec["node"], spec["config"]
    c.launch(train_args(config))
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    time.sleep(spec["delay_s"])  # the random instant itself
    c.kill_trainers([node])
    result["fired"] = True
    c.wait_stopped(TIMEOUT)  # the other node notices by itself
    restart_and_finish(bench, c, spec, result, config)
    check_trainer_kill(bench, c, result, config)
    common_end_checks(bench, c, result, config)


def agent_kill_point(bench, c: Cluster, spec: dict, result: dict) -> None:
    node, point = spec["node"], spec["point"]
    scoped = ("agent_recorded", "persist_write", "before_rename", "before_node_marker")
    scope = f":{node}" if point in scoped else ""
    c.launch(FULL, faults=f"{point}=kill@{spec['nth']}{scope}")
    codes = c.wait_exit(TIMEOUT)
    agent_outcome(bench, c, result, codes, f"fault injection: kill at {point}")


def agent_kill_random(bench, c: Cluster, spec: dict, result: dict) -> None:
    c.launch(FULL)
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    time.sleep(spec["delay_s"])
    result["fired"] = c.kill_agent(spec["node"]) is not None
    codes = c.wait_exit(TIMEOUT)
    agent_outcome(bench, c, result, codes, None)


def agent_outcome(bench, c: Cluster, result: dict, codes: dict, fired_line: str | None) -> None:
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
    common_end_checks(bench, c, result, "full")


def node_loss(bench, c: Cluster, spec: dict, result: dict) -> None:
    node = spec["node"]
    c.launch(PEC)
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    c.lose_node(node)
    result["fired"] = True
    c.wait_stopped(TIMEOUT)  # the survivor notices by itself
    # The survivor's agent may still commit an iteration both nodes had saved: at least this one.
    committed_at_loss = max(committed(c.save), default=0)
    # What storage alone would cost, now: retention may retire that iteration before the run ends.
    storage_only = round(persist_only_plt(c.save, committed_at_loss), 6) if committed_at_loss else None
    restart_and_finish(bench, c, spec, result, "pec")
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
    common_end_checks(bench, c, result, "pec")


# ---- replication (every expert saved, so every loss after a restore is checked bit-exactly) -------
def replica_holder_kill(bench, c: Cluster, spec: dict, result: dict) -> None:
    """The holder's agent is SIGKILLed mid-way through receiving a replica; later the node is lost."""
    replica_fault(bench, c, spec, result, "kill")


def replica_link_drop(bench, c: Cluster, spec: dict, result: dict) -> None:
    """The link between the agents breaks mid-transfer (an I/O error on the holder's side of the
    socket); later the node is lost."""
    replica_fault(bench, c, spec, result, "eio")


def replica_fault(bench, c: Cluster, spec: dict, result: dict, action: str) -> None:
    node, holder = spec["node"], 1 - spec["node"]
    c.launch(FULL, faults={holder: f"replica_receive={action}@{spec['nth']}:{holder}"})
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)

    def fired() -> None:  # (after the loss: a transfer under way at the iteration may still hit it)
        result["fired"] = f"fault injection: {action} at replica_receive" in agent_logs(c)

    lose(bench, c, [node], spec, result, before_restart=fired)
    lost_from = result["sources"].get(node) if result.get("sources") else None
    check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
    common_end_checks(bench, c, result, "full")


def replica_corrupt(bench, c: Cluster, spec: dict, result: dict) -> None:
    """The node is lost and the one replica of it has a flipped byte: it must not be restored."""
    node, holder = spec["node"], 1 - spec["node"]
    # The node is held in its next optimizer step until it is lost: training must not end (and free
    # node memory, the replica included) while the replica is awaited on a loaded machine.
    c.launch(FULL, **held(node, after=spec["iteration"], stall_s=TIMEOUT))
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    c.wait_for(lambda: replica_path(c, holder, node, node), TIMEOUT, f"a replica of node {node} on node {holder}")

    def damage() -> None:
        path = replica_path(c, holder, node, node)
        check(path is not None, f"node {holder} holds no replica of node {node}")
        flip_bits(path, int(spec["offset_fraction"] * (path.stat().st_size - 1)), 0x10)
        result["fired"] = True

    lose(bench, c, [node], spec, result, before_restart=damage)
    if result["restored_iteration"]:
        check(result["sources"][node] == "storage", f"node {node} restored from a damaged replica")
    common_end_checks(bench, c, result, "full")


def two_nodes_lost(bench, c: Cluster, spec: dict, result: dict) -> None:
    """Both nodes lost (the lost node and its only replica holder): storage, the newest commit."""
    c.launch(FULL)
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    result["fired"] = True
    lose(bench, c, [0, 1], spec, result)
    if result["restored_iteration"]:
        check(set(result["sources"].values()) == {"storage"}, f"restored from {result['sources']}")
        check(result["restored_iteration"] == result["newest_committed_before"],
              f"restored {result['restored_iteration']}, not the newest commit {result['newest_committed_before']}")
    common_end_checks(bench, c, result, "full")


def lose(bench, c: Cluster, nodes: list[int], spec: dict, result: dict, before_restart=None) -> None:
    for node in nodes:
        c.lose_node(node)
    c.wait_stopped(TIMEOUT)  # a survivor notices by itself
    if before_restart is not None:
        before_restart()
    restart_and_finish(bench, c, spec, result, "full")


def object_store_crash(bench, c: Cluster, spec: dict, result: dict) -> None:
    object_store_fault.run(c, spec, result, script=bench.script, train_args=FULL, timeout=TIMEOUT,
                           outcome=functools.partial(storage_outcome, bench, must_commit_last=True))


def storage_error(bench, c: Cluster, spec: dict, result: dict) -> None:
    node = spec["node"]
    c.launch(FULL, faults={node: f"{spec['point']}={spec['action']}@{spec['nth']}:{node}"})
    codes = c.wait_exit(TIMEOUT)
    result["fired"] = f"fault injection: {spec['action']} at {spec['point']}" in (
        c.node_dir(node) / "agent.log").read_text()
    storage_outcome(bench, c, result, codes, "injected " + spec["action"].upper())


def storage_full(bench, c: Cluster, spec: dict, result: dict) -> None:
    c.save.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size_mib']}m", "tmpfs", str(c.save)], check=True)
    result["_mounts"] = [c.save]
    c.launch(FULL)
    codes = c.wait_exit(TIMEOUT)
    result["fired"] = "No space left on device" in c.logs()
    storage_outcome(bench, c, result, codes, "No space left on device" if result["fired"] else None)


def storage_outcome(bench, c: Cluster, result: dict, codes: dict, error: str | None,
                     must_commit_last: bool = False) -> None:
    """Invariant 8: training continues, the error is reported, nothing that failed is committed (with
    ``must_commit_last``: the storage came back before the end, the last iteration is committed)."""
    check(codes == {0: 0, 1: 0}, f"training stopped: exit codes {codes}: {c.logs()[-1500:]}")
    check(c.iteration() == FULL_ITERS, "training did not reach the last iteration")
    logs = c.logs()
    failed = {int(i) for i in re.findall(r"snapshot of iteration (\d+) was not persisted", logs)}
    if error is not None:
        check(error in logs and failed, f"the error ({error}) was not reported to the trainer")
    done = set(committed(c.save))
    for i in failed & done:
        # Only a failure at the commit itself leaves the iteration committed: writing the tracker
        # (a hint), or this node's manifest write when every node's files were durable and
        # another node's agent wrote the same manifest (``verify`` below checks every file).
        said = re.findall(rf"snapshot of iteration {i} was not persisted: (.*)", logs)
        check(said and all(TRACKER in line or "manifest.json" in line for line in said),
              f"iteration {i} failed ({said}) yet is committed")
    check(not must_commit_last or FULL_ITERS in done, f"the persists after the fault did not commit: {sorted(done)}")
    result.update(resumed_from="continued", iterations_lost=0, failed_iterations=sorted(failed))
    common_end_checks(bench, c, result, "storage")


# ---- planned exits and relaunches (nothing lost, nothing committed rewritten) --------------------
def pec_args(k: int) -> list[str]:
    return ["--pec-snapshot-k", str(k), "--pec-persist-k", "1"]


def planned_exit(bench, c: Cluster, spec: dict, result: dict) -> None:
    """--exit-interval between persists (every ``spec["save_interval"]``, default 2) with partial snapshots:
    the exit saves its iteration with every expert, committed after the persists before it; the restart
    restores it from storage with PLT 0 and resumes bit-exactly."""
    exit_at, interval = spec["exit"], spec.get("save_interval", 2)
    args = with_flag(FULL, "--save-interval", str(interval)) + pec_args(spec["k"])
    c.launch(args + ["--exit-interval", str(exit_at)])
    codes = c.wait_exit(TIMEOUT)
    check(codes == {0: 0, 1: 0}, f"the planned exit failed: exit codes {codes}: {c.logs()[-1500:]}")
    result["fired"] = f"planned exit: iteration {exit_at} saved once more with every expert" in c.logs()
    c.wait_agents_exited()
    expected = [*range(interval, exit_at, interval), exit_at]
    check(committed(c.save) == expected, f"committed {committed(c.save)} after the planned exit, not {expected}")
    m = _checkpoints(c.save).read_manifest(exit_at)
    check(set(m.experts.values()) == {exit_at}, f"iteration {exit_at} committed without every expert at it")
    relaunch(c, args, exit_at, result)
    check(c.iteration() == FULL_ITERS, "the restart did not finish training")
    common_end_checks(bench, c, result, "full")


def relaunch_finished(bench, c: Cluster, spec: dict, result: dict) -> None:
    """A finished job launched again (another PEC K the second time): it restores the last iteration whole
    from storage, trains nothing and writes none of its files again."""
    c.launch(FULL + pec_args(spec["k"]))
    codes = c.wait_exit(TIMEOUT)
    check(codes == {0: 0, 1: 0}, f"training failed: exit codes {codes}: {c.logs()[-1500:]}")
    c.wait_agents_exited()
    result["fired"] = True
    files = iteration_files(c.save, FULL_ITERS)
    relaunch(c, FULL + pec_args(spec["relaunch_k"]), FULL_ITERS, result)
    check_nothing_redone(c, FULL_ITERS, files)
    common_end_checks(bench, c, result, "full")


def relaunch(c: Cluster, args: list[str], expected: int, result: dict) -> None:
    """Launch again after a clean end: every rank restores ``expected`` whole from storage, PLT 0 on every
    node that logs one (rank 0's node at least)."""
    c.launch(args)
    codes = c.wait_exit(TIMEOUT)
    check(codes == {0: 0, 1: 0}, f"the relaunch failed: exit codes {codes}: {c.logs()[-1500:]}")
    restores = c.restores()
    found = {r: (x.iteration, x.source, bool(x.older)) for r, x in restores.items()}
    check(found == {0: (expected, "storage", False), 1: (expected, "storage", False)},
          f"restored {found}, expected iteration {expected} whole from storage")
    plts = [parse_plt(c.log(n)) for n in range(c.nnodes)]
    result.update(restored_iteration=expected, reached_iteration=expected, iterations_lost=0,
                  resumed_from="storage", plt=plts[0])
    check(plts[0] == 0.0 and all(p in (None, 0.0) for p in plts), f"PLT {plts} (by node) after a planned exit")


def iteration_files(root: Path, iteration: int) -> dict[Path, int]:
    """Every file of ``iteration``'s generation directory under ``root``: path -> mtime (ns)."""
    return {p: p.stat().st_mtime_ns for p in (Path(root) / f"iter_{iteration:07d}" / "pec").iterdir()}


def check_nothing_redone(c: Cluster, iteration: int, files: dict[Path, int]) -> None:
    """After a relaunch of a finished job (once its agents are gone): it trained nothing, and the files of
    the last ``iteration`` are those ``iteration_files`` listed before, unwritten."""
    c.wait_agents_exited()
    check(not [r for r in c.metrics() if "lm loss" in r], "the relaunch trained again")
    now = iteration_files(c.save, iteration)
    check(now == files, f"the committed iteration's files changed: {sorted(set(now.items()) ^ set(files.items()))}")


def restart_during_persist(bench, c: Cluster, spec: dict, result: dict) -> None:
    """The node's trainers die while its agent writes a rank file (the rename stalls 3 s): the write and
    the commit still end, and the restart restores from node memory."""
    node = spec["node"]
    c.launch(FULL, faults={node: f"before_rename=stall@{spec['nth']}:{node}"})
    c.wait_for(lambda: "fault injection: stall at before_rename" in agent_logs(c), TIMEOUT,
               "the stalled rename")
    c.kill_trainers([node])
    result["fired"] = True
    c.wait_stopped(TIMEOUT)
    restart_and_finish(bench, c, spec, result, "full")
    check_trainer_kill(bench, c, result, "full")
    common_end_checks(bench, c, result, "full")


def slow_replica_node_loss(bench, c: Cluster, spec: dict, result: dict) -> None:
    """The replica holder stalls mid-transfer and the node is lost meanwhile: its ranks restore from the
    replica in the holder's memory (at most --pec-replica-lag snapshots behind: the trainers waited
    rather than run further ahead) or, if none landed, from storage."""
    node, holder = spec["node"], 1 - spec["node"]
    c.launch(FULL, faults={holder: f"replica_receive=stall@{spec['nth']}:{holder}"})
    c.wait_for(lambda: "fault injection: stall at replica_receive" in agent_logs(c), TIMEOUT,
               "the stalled transfer")
    result["fired"] = True
    lose(bench, c, [node], spec, result)
    lost_from = result["sources"].get(node) if result.get("sources") else None
    check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
    if lost_from == f"peer memory (node {holder})":
        # the newest snapshot, one iteration past it trained, the replica up to the bound behind
        check(result["iterations_lost"] <= (REPLICA_LAG + 1) * FULL_SNAPSHOT_INTERVAL,
              f"lost {result['iterations_lost']} iterations with --pec-replica-lag {REPLICA_LAG}")
    common_end_checks(bench, c, result, "full")


def corruption(bench, c: Cluster, spec: dict, result: dict) -> None:
    """Invariant 4: damage the newest one or two iterations (and maybe the tracker); the restart
    must fall back past them with a message, never accept them, and resume bit-exactly."""
    shutil.copytree(bench.reference.archive, c.save)
    root = str(c.save)
    for iteration, kind in spec["damage"]:
        damage(bench, c.save, iteration, kind, spec["node"], result)
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
    check(committed(root)[-1] == FULL_ITERS, "the redone iterations were not committed")
    common_end_checks(bench, c, result, "full")


def damage(bench, root: Path, iteration: int, kind: str, rank: int, result: dict) -> None:
    victim = root / _checkpoints(root).read_manifest(iteration).ranks[str(rank)].file
    if kind == "flip_byte":
        offset = flip_bits(victim, bench.rng.randrange(os.path.getsize(victim)), 1 << bench.rng.randrange(8))
        result.setdefault("offsets", []).append(offset)
    elif kind == "truncate":
        os.truncate(victim, bench.rng.randrange(os.path.getsize(victim)))
    elif kind == "delete_rank_file":
        os.unlink(victim)
    elif kind == "manifest_missing_file":
        path = Path(_checkpoints(root).manifest_path(iteration))
        m = json.loads(path.read_text())
        m["ranks"][str(rank)]["file"] = f"iter_{iteration:07d}/pec/rank_09999.safetensors"
        path.write_text(json.dumps(m))


SCENARIOS = {name: globals()[name] for name in TYPES}  # fault type -> its scenario

__all__ = ["SCENARIOS", "TYPES", "Failure", "check", "check_sound", "committed", "tracker", "Reference", "Bench",
           "FULL", "FULL_ITERS", "PEC", "TIMEOUT", "held", "wait_held", "with_flag", "flip_bits", "replica_path",
           "can_mount", "relaunch", "iteration_files", "check_nothing_redone"]
