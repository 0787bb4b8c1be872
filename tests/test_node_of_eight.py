"""A full node - 8 ranks sharing one node agent - beside a peer node of 8 that keeps its
replicas. A snapshot every iteration and a persist every 20 (scripted trainers: the agent is the real
process, the ranks write known values through the trainer's own node-memory classes): no snapshot waits
for a region, the node's memory (its ranks' files and the replicas it keeps) stays within 3x its state,
and a lost node's 8 ranks come back from the peer's replicas."""

import shutil

import pytest

from megatron_pec.testing.full_node import ITEMS, run_full_node

pytestmark = pytest.mark.multiprocess

RANKS, ITERS, PERSIST = 8, 25, 20


def test_a_node_of_eight_ranks_keeps_within_three_times_its_state_and_comes_back_from_its_peer(shm_dir, tmp_path):
    try:
        run = run_full_node(shm_dir, str(tmp_path / "ckpt"), RANKS, ITERS, PERSIST)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    assert run.waits == 0, "a snapshot found no region at once"
    assert run.committed == [PERSIST]
    for node in run.nodes:  # (to the hundredth: the pool file's own header is a few KiB beyond the state)
        assert round(node.own_bytes / node.state_bytes, 2) <= 2.0, node
        assert round((node.own_bytes + node.replica_bytes) / node.state_bytes, 2) <= 3.0, node
        assert node.agent_cpu_s > 0, node

    # Node 1 lost: its 8 new ranks hold their newest iteration again, pulled from node 0's replicas.
    assert [p["rank"] for p in run.pulled] == list(range(RANKS, 2 * RANKS))
    for pulled in run.pulled:
        assert pulled["origin"] == 0 and pulled["iteration"] >= ITERS - 2, pulled  # (replica lag 2 at most)
        assert set(pulled["versions"]) == set(ITEMS), pulled
        assert set(pulled["versions"].values()) == {pulled["iteration"]}, pulled
        assert all(v == {pulled["iteration"] + 0.5} for v in pulled["values"].values()), pulled
    assert round(run.pulled_own_bytes / run.nodes[1].state_bytes, 2) <= 2.0
