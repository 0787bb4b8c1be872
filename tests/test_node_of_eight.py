"""Issue 35: a full node - 8 ranks sharing one node agent - beside a peer node of 8 that keeps its
replicas. A snapshot every iteration and a persist every 20 (scripted trainers: the agent is the real
process, the ranks write known values through the trainer's own node-memory classes): no snapshot waits
for a region, the node's memory (its ranks' files and the replicas it keeps) stays within 3x its state,
and a lost node's 8 ranks come back from the peer's replicas."""

import os
import shutil
import subprocess
import time

import pytest
import torch

from conftest import checkpoints
from megatron_pec.agent.client import agent_pid
from megatron_pec.slots import node_dir
from megatron_pec.stformat import layout
from megatron_pec.testing.scripted import ScriptedTrainer

pytestmark = pytest.mark.multiprocess

EXPERTS = 8
ENTRIES = layout([("dense/w.param", torch.float32, 1 << 16)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 1 << 14) for e in range(EXPERTS)
                    for k in ("param", "exp_avg", "exp_avg_sq")])
ITEMS = ("dense",) + tuple(f"L1.E{e}" for e in range(EXPERTS))
RANKS, ITERS, PERSIST = 8, 25, 20
STEP_S = 0.1  # a training step between two snapshots (persists and replica pushes run meanwhile)


def node_bytes(directory) -> tuple[int, int]:
    """(bytes of the node's own files, bytes of the replicas it keeps)."""
    own = sum(e.stat().st_size for e in os.scandir(directory) if e.is_file() and ".slot" in e.name or
              e.name.endswith(".pool"))
    replicas = os.path.join(directory, "replicas")
    held = sum(e.stat().st_size for e in os.scandir(replicas) if e.name.endswith(".replica")) \
        if os.path.isdir(replicas) else 0
    return own, held


def test_a_node_of_eight_ranks_keeps_within_three_times_its_state_and_comes_back_from_its_peer(shm_dir, tmp_path):
    root = str(tmp_path / "ckpt")
    dirs = [node_dir(shm_dir, "eight", n) for n in (0, 1)]
    made = []

    def trainer(rank, **kw):
        node = rank // RANKS
        t = ScriptedTrainer(dirs[node], rank, root, ENTRIES, ITEMS, nodes=2, replicas=1, node=node,
                            local_ranks=RANKS, job="eight", **kw)
        made.append(t)
        return t

    try:
        trainers = [trainer(r) for r in range(2 * RANKS)]
        for iteration in range(1, ITERS + 1):
            for t in trainers:
                t.snapshot(iteration, persist=iteration % PERSIST == 0)
            time.sleep(STEP_S)
        assert sum(t.waits for t in trainers) == 0, "a snapshot found no region at once"
        assert checkpoints(root).committed_iterations() == [PERSIST]
        state = trainers[0].files.file_len + trainers[0].files.layout.state_bytes - \
            trainers[0].files.layout.dense_bytes  # (one complete snapshot of a rank: its header too)
        for directory in dirs:  # (to the hundredth: the pool file's own header is a few KiB beyond the state)
            own, held = node_bytes(directory)
            assert round(own / (RANKS * state), 2) <= 2.0 and round((own + held) / (RANKS * state), 2) <= 3.0, \
                (own, held, state)

        # Node 1 lost: its agent and memory gone; 8 new trainers on a new agent pull their ranks' replicas.
        os.kill(agent_pid(dirs[1]), 9)
        for t in trainers[RANKS:]:
            t.files.close()
            t.client.close(detach=False)
        subprocess.run(["rm", "-rf", dirs[1]], check=True)
        fresh = [trainer(r, run="run-2") for r in range(RANKS, 2 * RANKS)]
        for t in fresh:
            records = t.memory().slots[t.rank]
            home = records[0]
            assert home.origin == 0 and home.iteration >= ITERS - 2, (t.rank, home)  # (replica lag 2 at most)
            versions = {i: v for r in records.values() for i, v in r.items.items()}
            assert set(versions) == set(ITEMS) and all(v == home.iteration for v in versions.values())
            for item, slot in ((i, s) for s, r in records.items() for i in r.items):
                assert {float(v.flatten()[0]) for v in t.files.item_views(slot, item).values()} == \
                    {home.iteration + 0.5}, (t.rank, item)
        own, held = node_bytes(dirs[1])
        assert round(own / (RANKS * state), 2) <= 2.0
    finally:
        for t in made:
            try:
                t.close()
            except OSError:
                pass
        shutil.rmtree(shm_dir, ignore_errors=True)
