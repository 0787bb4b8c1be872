"""Where the other nodes' agents listen, and which nodes hold this node's replicas.

Each node agent that replicates publishes its ``PeerAddress`` under the job's shared
``--save`` directory (``<save>/pec_agents/<job id>/node_<k>.json``, written atomically and
again by a restarted agent), so agents find each other without torch and after restarts.
Placement is a pure function of the node count, the replica count and the failure
domains: the next nodes in ring order whose domain differs from this node's.
"""

from __future__ import annotations

import os
import socket

from megatron_pec.format.protocol import JobInfo, PeerAddress, ProtocolError
from megatron_pec.store.storage import Storage

RENDEZVOUS = "pec_agents"  # under --save; Megatron ignores anything not named iter_* or the tracker


def address_path(save: str, job_id: str, node: int) -> str:
    return os.path.join(save, RENDEZVOUS, job_id, f"node_{node:04d}.json")


def publish(save: str, job_id: str, address: PeerAddress, storage: Storage) -> None:
    storage.write(address_path(save, job_id, address.node), [address.dumps().encode()])


def read_peers(save: str, job_id: str, num_nodes: int, storage: Storage) -> dict[int, PeerAddress]:
    """The published addresses that can be read (a missing or damaged one is simply absent)."""
    peers = {}
    for node in range(num_nodes):
        try:
            peers[node] = PeerAddress.loads(storage.read(address_path(save, job_id, node)))
        except (OSError, ProtocolError):
            continue
    return peers


def holders(node: int, num_nodes: int, replicas: int, domains: dict[int, str]) -> list[int]:
    """The nodes that keep ``node``'s replicas: never ``node`` itself, never its failure domain
    (a node without a named domain is its own), the next ones in ring order first."""
    domain = lambda n: domains.get(n) or f"node {n}"
    chosen = []
    for step in range(1, num_nodes):
        peer = (node + step) % num_nodes
        if len(chosen) < replicas and domain(peer) != domain(node):
            chosen.append(peer)
    return chosen


def advertised_host(job: JobInfo) -> str:
    """The address peers reach this node's agent at: the one its trainers' launch named
    (``config.Launch.agent_host``), else this host's address."""
    return job.host or socket.gethostbyname(socket.gethostname())
