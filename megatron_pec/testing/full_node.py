"""A full node: 8 scripted ranks sharing one real node agent, beside a peer node of 8 that keeps their
replicas (and they its). Shared by the test (``tests/test_node_of_eight.py``) and the benchmark
(``benchmarks.node_memory``): a snapshot every iteration, a persist every ``persist``, then node 1 lost and
its ranks pulled back from node 0's memory."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from dataclasses import dataclass, field

import torch

from megatron_pec.agent.client import agent_pid
from megatron_pec.agent.cpu_ledger import read_ledger
from megatron_pec.format.protocol import Flush, Flushed
from megatron_pec.format.stformat import layout
from megatron_pec.memory.slots import HEADER_RESERVE, node_dir, snapshot_file_bytes
from megatron_pec.store.checkpoint_dir import CheckpointDir
from megatron_pec.store.storage import open_storage
from megatron_pec.testing.scripted import ScriptedTrainer

EXPERTS = 8
ENTRIES = layout([("dense/w.param", torch.float32, 1 << 16)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 1 << 14) for e in range(EXPERTS)
                    for k in ("param", "exp_avg", "exp_avg_sq")])
ITEMS = ("dense",) + tuple(f"L1.E{e}" for e in range(EXPERTS))
STEP_S = 0.1  # a training step between two snapshots (persists and replica pushes run meanwhile)


@dataclass
class NodeMeasure:
    own_bytes: int  # the node's ranks' home slots and pools
    replica_bytes: int  # the replicas of the peer node it keeps
    state_bytes: int  # one complete snapshot of every rank of the node
    agent_cpu_s: float  # the node agent's CPU over the measured snapshots
    agent_phases_s: dict  # ... by phase (its ledger's)


@dataclass
class FullNodeRun:
    waits: int  # snapshots that found no home within the engine's wait (it would skip a memory-only one)
    waited_s: float  # the longest a snapshot waited for a home
    committed: list[int]
    nodes: list[NodeMeasure]
    snapshots: int  # per node, measured
    pulled: list[dict] = field(default_factory=list)  # per rank of the lost node: what came back
    pulled_own_bytes: int = 0  # the replacement node's own files after the pull


def node_bytes(directory) -> tuple[int, int]:
    """(bytes of the node's own files, bytes of the replicas it keeps)."""
    own = sum(e.stat().st_size for e in os.scandir(directory)
              if e.is_file() and (".slot" in e.name or e.name.endswith(".pool")))
    replicas = os.path.join(directory, "replicas")
    held = sum(e.stat().st_size for e in os.scandir(replicas) if e.name.endswith(".replica")) \
        if os.path.isdir(replicas) else 0
    return own, held


def run_full_node(shm_dir: str, root: str, ranks: int = 8, iterations: int = 25, persist: int = 20,
                  job: str = "eight") -> FullNodeRun:
    """Two nodes of ``ranks`` each: snapshots, persists, then node 1 lost and pulled from node 0."""
    dirs = [node_dir(shm_dir, job, n) for n in (0, 1)]
    made: list[ScriptedTrainer] = []

    def trainer(rank, **kw):
        node = rank // ranks
        t = ScriptedTrainer(dirs[node], rank, root, ENTRIES, ITEMS, nodes=2, replicas=1, node=node,
                            local_ranks=ranks, job=job, **kw)
        made.append(t)
        return t

    try:
        trainers = [trainer(r) for r in range(2 * ranks)]
        leaders = [trainers[0], trainers[ranks]]
        for t in trainers:
            t.snapshot(1, persist=False)  # (the agents map every slot once, before the measured snapshots)
        before = [agent_ledger(t) for t in leaders]
        for iteration in range(2, iterations + 1):
            for t in trainers:
                t.snapshot(iteration, persist=iteration % persist == 0)
            time.sleep(STEP_S)
        after = [agent_ledger(t) for t in leaders]
        files = trainers[0].files
        state = ranks * snapshot_file_bytes(files.layout, HEADER_RESERVE)
        result = FullNodeRun(sum(t.waits for t in trainers), max(t.waited_s for t in trainers),
                             CheckpointDir(root, open_storage("posix")).committed_iterations(),
                             [NodeMeasure(*node_bytes(d), state, a["process_s"] - b["process_s"],
                                          {p: v - b["phases"].get(p, 0.0) for p, v in a["phases"].items()})
                              for d, a, b in zip(dirs, after, before)],
                             iterations - 1)

        # Node 1 lost: its agent and memory gone; new trainers on a new agent pull their ranks' replicas.
        os.kill(agent_pid(dirs[1]), 9)
        for t in trainers[ranks:]:
            t.files.close()
            t.client.close(detach=False)
        subprocess.run(["rm", "-rf", dirs[1]], check=True)
        pulled = [_pulled(t) for t in [trainer(r, run="run-2") for r in range(ranks, 2 * ranks)]]
        return dataclasses.replace(result, pulled=pulled, pulled_own_bytes=node_bytes(dirs[1])[0])
    finally:
        for t in made:
            try:
                t.close()
            except OSError:
                pass


def agent_ledger(t: ScriptedTrainer) -> dict:
    """The node agent's CPU ledger so far (written at a flush): ``process_s`` and ``phases``."""
    t.client.request(Flush(), Flushed, timeout=120)
    ledger = read_ledger(t.directory)
    if ledger is None:
        raise RuntimeError(f"the agent wrote no CPU ledger under {t.directory}")
    return ledger


def _pulled(t: ScriptedTrainer) -> dict:
    """What the replacement node's memory holds for ``t``'s rank: the home's record, every item's version
    and the values its regions hold."""
    records = t.memory().slots[t.rank]
    home = records[0]
    versions = {i: v for r in records.values() for i, v in r.items.items()}
    values = {item: {float(v.flatten()[0]) for v in t.files.item_views(slot, item).values()}
              for slot, r in records.items() for item in r.items}
    return {"rank": t.rank, "origin": home.origin, "iteration": home.iteration, "versions": versions,
            "values": values}


__all__ = ["FullNodeRun", "NodeMeasure", "run_full_node", "node_bytes", "agent_ledger", "ITEMS", "STEP_S"]
