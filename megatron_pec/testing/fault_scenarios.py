"""The fault campaign's scenarios, one function per fault type (``TYPES``), and the checks they share:
what each injects into a simulated 2-node job (``testing/cluster.py``) and what the architecture's
invariants promise after it. ``Campaign`` (``testing/campaign.py``) draws a type and its parameters and runs
its scenario, ``SCENARIOS[type](campaign, cluster, spec, result)``; a scenario fills ``result`` and raises
``Failure`` where a promise is broken.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from megatron_pec.format.checkpoint_paths import storage_spec_for
from megatron_pec.store.checkpoint_dir import TRACKER, CheckpointDir
from megatron_pec.store.storage import open_storage
from megatron_pec.testing import object_store_fault
from megatron_pec.testing.cluster import Cluster, agent_logs, parse_plt, persist_only_plt, run_megatron_pec

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


def train_args(config: str) -> list[str]:
    return list(FULL if config == "full" else PEC)


def restart_and_finish(campaign, c: Cluster, spec: dict, result: dict, config: str) -> None:
    """After a launch that died: relaunch, finish, and check the restore (invariants 5, 7)."""
    reached = c.iteration()
    before = set(_checkpoints(c.save).committed_iterations())
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


def common_end_checks(campaign, c: Cluster, result: dict, config: str) -> None:
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
                    check(r["lm loss"] == campaign.reference[r["iteration"]],
                          f"launch {launch} iteration {r['iteration']}: loss {r['lm loss']!r} != reference "
                          f"{campaign.reference[r['iteration']]!r}")


def check_trainer_kill(campaign, c: Cluster, result: dict, config: str) -> None:
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


def trainer_kill_point(campaign, c: Cluster, spec: dict, result: dict) -> None:
    node, config = spec["node"], spec["config"]
    c.launch(train_args(config), faults={node: f"{spec['point']}=kill@{spec['nth']}:{node}"})
    codes = c.wait_stopped(TIMEOUT)
    result["fired"] = f"fault injection: kill at {spec['point']}" in c.log(node)
    check(result["fired"] and codes[node] != 0, f"the fault did not fire (exit codes {codes})")
    restart_and_finish(campaign, c, spec, result, config)
    check_trainer_kill(campaign, c, result, config)
    common_end_checks(campaign, c, result, config)


def trainer_kill_random(campaign, c: Cluster, spec: dict, result: dict) -> None:
    node, config = spec["node"], spec["config"]
    c.launch(train_args(config))
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    time.sleep(spec["delay_s"])  # the random instant itself
    c.kill_trainers([node])
    result["fired"] = True
    c.wait_stopped(TIMEOUT)  # the other node notices by itself
    restart_and_finish(campaign, c, spec, result, config)
    check_trainer_kill(campaign, c, result, config)
    common_end_checks(campaign, c, result, config)


def agent_kill_point(campaign, c: Cluster, spec: dict, result: dict) -> None:
    node, point = spec["node"], spec["point"]
    scoped = ("agent_recorded", "persist_write", "before_rename", "before_node_marker")
    scope = f":{node}" if point in scoped else ""
    c.launch(FULL, faults=f"{point}=kill@{spec['nth']}{scope}")
    codes = c.wait_exit(TIMEOUT)
    agent_outcome(campaign, c, result, codes, f"fault injection: kill at {point}")


def agent_kill_random(campaign, c: Cluster, spec: dict, result: dict) -> None:
    c.launch(FULL)
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    time.sleep(spec["delay_s"])
    result["fired"] = c.kill_agent(spec["node"]) is not None
    codes = c.wait_exit(TIMEOUT)
    agent_outcome(campaign, c, result, codes, None)


def agent_outcome(campaign, c: Cluster, result: dict, codes: dict, fired_line: str | None) -> None:
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
    common_end_checks(campaign, c, result, "full")


def node_loss(campaign, c: Cluster, spec: dict, result: dict) -> None:
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
    restart_and_finish(campaign, c, spec, result, "pec")
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
    common_end_checks(campaign, c, result, "pec")


# ---- replication (every expert saved, so every loss after a restore is checked bit-exactly) -------
def replica_holder_kill(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """The holder's agent is SIGKILLed mid-way through receiving a replica; later the node is lost."""
    replica_fault(campaign, c, spec, result, "kill")


def replica_link_drop(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """The link between the agents breaks mid-transfer (an I/O error on the holder's side of the
    socket); later the node is lost."""
    replica_fault(campaign, c, spec, result, "eio")


def replica_fault(campaign, c: Cluster, spec: dict, result: dict, action: str) -> None:
    node, holder = spec["node"], 1 - spec["node"]
    c.launch(FULL, faults={holder: f"replica_receive={action}@{spec['nth']}:{holder}"})
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)

    def fired() -> None:  # (after the loss: a transfer under way at the iteration may still hit it)
        result["fired"] = f"fault injection: {action} at replica_receive" in agent_logs(c)

    lose(campaign, c, [node], spec, result, before_restart=fired)
    lost_from = result["sources"].get(node) if result.get("sources") else None
    check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
    common_end_checks(campaign, c, result, "full")


def replica_corrupt(campaign, c: Cluster, spec: dict, result: dict) -> None:
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

    lose(campaign, c, [node], spec, result, before_restart=damage)
    if result["restored_iteration"]:
        check(result["sources"][node] == "storage", f"node {node} restored from a damaged replica")
    common_end_checks(campaign, c, result, "full")


def two_nodes_lost(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """Both nodes lost (the lost node and its only replica holder): storage, the newest commit."""
    c.launch(FULL)
    c.wait_iteration(spec["iteration"], timeout=TIMEOUT)
    result["fired"] = True
    lose(campaign, c, [0, 1], spec, result)
    if result["restored_iteration"]:
        check(set(result["sources"].values()) == {"storage"}, f"restored from {result['sources']}")
        check(result["restored_iteration"] == result["newest_committed_before"],
              f"restored {result['restored_iteration']}, not the newest commit {result['newest_committed_before']}")
    common_end_checks(campaign, c, result, "full")


def lose(campaign, c: Cluster, nodes: list[int], spec: dict, result: dict, before_restart=None) -> None:
    for node in nodes:
        c.lose_node(node)
    c.wait_stopped(TIMEOUT)  # a survivor notices by itself
    if before_restart is not None:
        before_restart()
    restart_and_finish(campaign, c, spec, result, "full")


def object_store_crash(campaign, c: Cluster, spec: dict, result: dict) -> None:
    object_store_fault.run(c, spec, result, script=campaign.script, train_args=FULL, timeout=TIMEOUT,
                           outcome=functools.partial(storage_outcome, campaign, must_commit_last=True))


def storage_error(campaign, c: Cluster, spec: dict, result: dict) -> None:
    node = spec["node"]
    c.launch(FULL, faults={node: f"{spec['point']}={spec['action']}@{spec['nth']}:{node}"})
    codes = c.wait_exit(TIMEOUT)
    result["fired"] = f"fault injection: {spec['action']} at {spec['point']}" in (
        c.node_dir(node) / "agent.log").read_text()
    storage_outcome(campaign, c, result, codes, "injected " + spec["action"].upper())


def storage_full(campaign, c: Cluster, spec: dict, result: dict) -> None:
    c.save.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={spec['size_mib']}m", "tmpfs", str(c.save)], check=True)
    result["_mounts"] = [c.save]
    c.launch(FULL)
    codes = c.wait_exit(TIMEOUT)
    result["fired"] = "No space left on device" in c.logs()
    storage_outcome(campaign, c, result, codes, "No space left on device" if result["fired"] else None)


def storage_outcome(campaign, c: Cluster, result: dict, codes: dict, error: str | None,
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
    common_end_checks(campaign, c, result, "storage")


# ---- planned exits and relaunches (issue 29: nothing lost, nothing committed rewritten) -----------
def pec_args(k: int) -> list[str]:
    return ["--pec-snapshot-k", str(k), "--pec-persist-k", "1"]


def planned_exit(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """--exit-interval between persists with partial snapshots: the exit saves its iteration with every
    expert; the restart restores it from storage with PLT 0 and resumes bit-exactly."""
    exit_at = spec["exit"]
    c.launch(FULL + pec_args(spec["k"]) + ["--exit-interval", str(exit_at)])
    codes = c.wait_exit(TIMEOUT)
    check(codes == {0: 0, 1: 0}, f"the planned exit failed: exit codes {codes}: {c.logs()[-1500:]}")
    result["fired"] = f"planned exit: iteration {exit_at} saved once more with every expert" in c.logs()
    c.wait_agents_exited()
    m = _checkpoints(c.save).read_manifest(exit_at)
    check(set(m.experts.values()) == {exit_at}, f"iteration {exit_at} committed without every expert at it")
    relaunch(campaign, c, FULL + pec_args(spec["k"]), exit_at, result)
    check(c.iteration() == FULL_ITERS, "the restart did not finish training")
    common_end_checks(campaign, c, result, "full")


def relaunch_finished(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """A finished job launched again (another PEC K the second time): it restores the last iteration whole
    from storage, trains nothing and writes none of its files again."""
    c.launch(FULL + pec_args(spec["k"]))
    codes = c.wait_exit(TIMEOUT)
    check(codes == {0: 0, 1: 0}, f"training failed: exit codes {codes}: {c.logs()[-1500:]}")
    c.wait_agents_exited()
    result["fired"] = True
    files = {p: p.stat().st_mtime_ns for p in (c.save / f"iter_{FULL_ITERS:07d}" / "pec").iterdir()}
    relaunch(campaign, c, FULL + pec_args(spec["relaunch_k"]), FULL_ITERS, result)
    c.wait_agents_exited()
    check(not [r for r in c.metrics() if "lm loss" in r], "the relaunch trained again")
    now = {p: p.stat().st_mtime_ns for p in (c.save / f"iter_{FULL_ITERS:07d}" / "pec").iterdir()}
    check(now == files, f"the committed iteration's files changed: {sorted(set(now.items()) ^ set(files.items()))}")
    common_end_checks(campaign, c, result, "full")


def relaunch(campaign, c: Cluster, args: list[str], expected: int, result: dict) -> None:
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


def restart_during_persist(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """The node's trainers die while its agent writes a rank file (the rename stalls 3 s): the write and
    the commit still end, and the restart restores from node memory."""
    node = spec["node"]
    c.launch(FULL, faults={node: f"before_rename=stall@{spec['nth']}:{node}"})
    c.wait_for(lambda: "fault injection: stall at before_rename" in agent_logs(c), TIMEOUT,
               "the stalled rename")
    c.kill_trainers([node])
    result["fired"] = True
    c.wait_stopped(TIMEOUT)
    restart_and_finish(campaign, c, spec, result, "full")
    check_trainer_kill(campaign, c, result, "full")
    common_end_checks(campaign, c, result, "full")


def slow_replica_node_loss(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """The replica holder stalls mid-transfer and the node is lost meanwhile: its ranks restore from the
    replica in the holder's memory (at most --pec-replica-lag snapshots behind: the trainers waited
    rather than run further ahead) or, if none landed, from storage."""
    node, holder = spec["node"], 1 - spec["node"]
    c.launch(FULL, faults={holder: f"replica_receive=stall@{spec['nth']}:{holder}"})
    c.wait_for(lambda: "fault injection: stall at replica_receive" in agent_logs(c), TIMEOUT,
               "the stalled transfer")
    result["fired"] = True
    lose(campaign, c, [node], spec, result)
    lost_from = result["sources"].get(node) if result.get("sources") else None
    check(lost_from in (None, "storage", f"peer memory (node {holder})"), f"node {node} restored from {lost_from}")
    if lost_from == f"peer memory (node {holder})":
        # the newest snapshot, one iteration past it trained, the replica up to the bound behind
        check(result["iterations_lost"] <= (REPLICA_LAG + 1) * FULL_SNAPSHOT_INTERVAL,
              f"lost {result['iterations_lost']} iterations with --pec-replica-lag {REPLICA_LAG}")
    common_end_checks(campaign, c, result, "full")


def corruption(campaign, c: Cluster, spec: dict, result: dict) -> None:
    """Invariant 4: damage the newest one or two iterations (and maybe the tracker); the restart
    must fall back past them with a message, never accept them, and resume bit-exactly."""
    shutil.copytree(campaign.reference_ckpt, c.save)
    root = str(c.save)
    for iteration, kind in spec["damage"]:
        damage(campaign, c.save, iteration, kind, spec["node"], result)
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
    common_end_checks(campaign, c, result, "full")


def damage(campaign, root: Path, iteration: int, kind: str, rank: int, result: dict) -> None:
    victim = root / _checkpoints(root).read_manifest(iteration).ranks[str(rank)].file
    if kind == "flip_byte":
        with open(victim, "r+b") as f:
            offset = campaign.rng.randrange(os.path.getsize(victim))
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << campaign.rng.randrange(8))]))
        result.setdefault("offsets", []).append(offset)
    elif kind == "truncate":
        os.truncate(victim, campaign.rng.randrange(os.path.getsize(victim)))
    elif kind == "delete_rank_file":
        os.unlink(victim)
    elif kind == "manifest_missing_file":
        path = Path(_checkpoints(root).manifest_path(iteration))
        m = json.loads(path.read_text())
        m["ranks"][str(rank)]["file"] = f"iter_{iteration:07d}/pec/rank_09999.safetensors"
        path.write_text(json.dumps(m))


SCENARIOS = {name: globals()[name] for name in TYPES}  # fault type -> its scenario

__all__ = ["SCENARIOS", "TYPES", "Failure", "check", "FULL", "PEC", "TIMEOUT"]
