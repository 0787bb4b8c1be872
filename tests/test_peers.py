
"""Replica placement and the peer address book (``agent/peers.py``): pure, no processes."""

import pytest

from megatron_pec.agent import peers
from megatron_pec.config import Launch
from megatron_pec.format.protocol import JobInfo, PeerAddress
from megatron_pec.store.storage import PosixStorage

pytestmark = pytest.mark.megatron_free


def test_holders_are_other_nodes_in_ring_order():
    assert peers.holders(0, 2, 1, {}) == [1]
    assert peers.holders(1, 2, 1, {}) == [0]
    assert peers.holders(2, 4, 2, {}) == [3, 0]
    assert peers.holders(0, 1, 1, {}) == []              # one node: nobody to hold a replica
    assert peers.holders(0, 3, 5, {}) == [1, 2]          # never more than the other nodes


def test_holders_never_share_the_failure_domain():
    racks = {0: "rack-a", 1: "rack-a", 2: "rack-b", 3: "rack-b"}
    assert peers.holders(0, 4, 1, racks) == [2]
    assert peers.holders(1, 4, 1, racks) == [2]
    assert peers.holders(2, 4, 2, racks) == [0, 1]
    assert peers.holders(0, 2, 1, {0: "rack-a", 1: "rack-a"}) == []   # no other domain: no replica
    assert peers.holders(0, 3, 1, {0: "x", 1: "", 2: "y"}) == [1]    # unnamed: its own domain


def test_addresses_are_published_and_read_back(tmp_path):
    storage = PosixStorage()
    save = str(tmp_path)
    peers.publish(save, "job", PeerAddress(1, "127.0.0.1", 4242, "rack-a", 77), storage)
    assert peers.read_peers(save, "job", 3, storage) == {1: PeerAddress(1, "127.0.0.1", 4242, "rack-a", 77)}
    (tmp_path / peers.RENDEZVOUS / "job" / "node_0000.json").write_text("{torn")
    assert set(peers.read_peers(save, "job", 3, storage)) == {1}    # an unreadable address is just absent
    assert peers.read_peers(save, "other", 3, storage) == {}        # another job's agents are not peers


def test_the_advertised_host_follows_the_launch():
    """The trainers' launch says where their agent is reached (read once, in ``config``); the agent
    advertises that, or its host's address."""
    assert Launch.from_environment({"MASTER_ADDR": "localhost"}).agent_host == "127.0.0.1"
    assert Launch.from_environment({"MASTER_ADDR": "10.0.0.1", "MEGATRON_PEC_AGENT_HOST": "10.1.2.3"}).agent_host \
        == "10.1.2.3"
    assert Launch.from_environment({"MASTER_ADDR": "10.0.0.1"}).agent_host == ""
    job = JobInfo(job_id="j", fingerprint="f", save="/s", local_world_size=1, node_rank=0, num_nodes=2, topology={},
                  keep=2, host="10.1.2.3")
    assert peers.advertised_host(job) == "10.1.2.3"
