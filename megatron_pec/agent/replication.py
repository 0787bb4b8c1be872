"""The node agent's side of replication, started once a job asks for it (``--pec-replicas``, more
than one node): accept peers' replicas (``ReplicaStore`` behind a ``ReplicaServer``), publish where,
send this node's recorded snapshots to its holders (``Replicator``), and pull a rank's replica onto
a replacement node. The transfers themselves are ``replica_transport.py``'s.
"""

from __future__ import annotations

import os
import threading

from megatron_pec.agent import peers
from megatron_pec.agent.replica_transport import ReplicaServer, ReplicaStore, Replicator, pull
from megatron_pec.common import log
from megatron_pec.format.protocol import JobInfo, PeerAddress, Pin
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.slots import SlotCache, slot_path
from megatron_pec.store.storage import Storage


class Replication:
    def __init__(self, directory: str, slots: SlotCache, on_push_done=None):
        """``on_push_done()``: called as a push hands regions back and when it ends (a trainer may be
        waiting for its regions)."""
        self.directory, self.slots, self.on_push_done = directory, slots, on_push_done
        self.storage: Storage | None = None  # the job's (where peers' addresses are published)
        self.replicator: Replicator | None = None
        self.store: ReplicaStore | None = None
        self.server: ReplicaServer | None = None
        self.address: PeerAddress | None = None
        self.published = False
        self._lock = threading.Lock()
        self.recorded: dict[int, list[int]] = {}  # rank -> iterations of its recent snapshots on its timeline

    @property
    def started(self) -> bool:
        return self.replicator is not None

    def start(self, job: JobInfo, storage: Storage) -> None:
        """Once per agent: accept peers' replicas, publish where (through the job's ``storage``), send ours."""
        with self._lock:
            if self.replicator is not None:
                return
            self.storage = storage
            self.store = ReplicaStore(self.directory)
            host = peers.advertised_host(job)
            self.server = ReplicaServer(self.store, host)
            self.address = PeerAddress(job.node_rank, host, self.server.port,
                                       job.domain or f"node {job.node_rank}", os.getpid())
            self.replicator = Replicator(self.directory, job, self.storage, self.slots, self.on_push_done)
        self.publish(job)  # storage I/O: outside the lock

    def publish(self, job: JobInfo) -> None:
        """Tell the peers where this agent takes replicas (again at every snapshot until storage takes it)."""
        if self.published:
            return
        try:
            peers.publish(job.save, job.job_id, self.address, self.storage)
        except OSError as exc:
            log.info(f"replication: cannot publish this agent's address under {job.save} ({exc}); retrying at the "
                     "next snapshot")
            return
        self.published = True
        domains = {n: a.domain for n, a in peers.read_peers(job.save, job.job_id, job.num_nodes, self.storage).items()}
        log.info(f"replication: {job.replicas} replica(s) of node {job.node_rank}'s snapshots go to node(s) "
                 f"{peers.holders(job.node_rank, job.num_nodes, job.replicas, domains)} (failure domain "
                 f"{self.address.domain}; address in {peers.address_path(job.save, job.job_id, job.node_rank)})")

    def offer(self, job: JobInfo, rank: int, iteration: int, memory: NodeMemory) -> None:
        """Snapshot ``iteration`` is recorded: send it to the holders (in the background), every item at
        its newest version up to it, each read from the slot its region is in."""
        if self.replicator is None:
            return
        self.recorded[rank] = [i for i in self.recorded.get(rank, []) if i < iteration][-63:] + [iteration]
        self.publish(job)
        home, places = memory.view_places(rank, iteration)
        self.replicator.offer(rank, home, places, memory.view(rank, iteration), memory.lineage.get(rank, []))

    def hold(self, rank: int, bound: int) -> str | None:
        """Why the rank's next snapshot must wait, if it must: its newest replica on every holder lags
        ``bound`` snapshots or more behind, and a push of a newer one is under way (a push that failed
        frees it: training goes on, the lost node would restore from storage)."""
        replicator = self.replicator
        if replicator is None or not replicator.busy(rank):
            return None
        landed = replicator.landed.get(rank, -1)
        lag = sum(1 for i in self.recorded.get(rank, []) if i > landed)
        if lag < bound:
            return None
        return (f"rank {rank}'s newest replica on its peers is {lag} snapshots behind (--pec-replica-lag {bound}): "
                "waiting for the push under way")

    def replicating(self, rank: int) -> list[Pin]:
        """The regions of the rank's snapshots being sent to a peer (those still to read) or waiting to be
        (pinned on its trainer)."""
        return self.replicator.replicating(rank) if self.replicator is not None else []

    def pull(self, job: JobInfo, rank: int, memory: NodeMemory) -> None:
        """This node's memory has nothing for ``rank`` (a replacement node): take its newest replica from
        a peer's memory, verified, as this node's own slot 0."""
        path = slot_path(self.directory, rank, 0)
        if memory.slots.get(rank) or not os.path.exists(path):
            return
        result = pull(self.directory, job, rank, self.slots, self.storage)
        if isinstance(result, str):
            log.info(f"rank {rank}: nothing pulled from peer memory ({result}); it restores from storage")
            return
        record, lineage, places = result
        memory.adopt(rank, 0, record, lineage, job.key, places)
        memory.write()
        log.info(f"rank {rank}: pulled iteration {record.iteration} from node {record.origin}'s memory")

    def close(self) -> None:
        """Report what was sent (the replicas this node holds go with the job's node memory)."""
        if self.replicator is not None:
            sent = self.replicator.sent
            log.info(f"replication: sent {sent['snapshots']} snapshot(s) to peers, {sent['whole']} of them whole, "
                     f"{sent['bytes']} bytes")


__all__ = ["Replication"]
