"""Agent phase 6, commit - and the persists a restart relies on.

Runs in the node agent's worker thread. A node's part of an iteration is done when every local
rank's file of it is durable: then the node marker is written, and whichever node's agent sees
every marker writes the manifest and the tracker (``manifest.try_commit``). An iteration any of
whose rank files failed is never committed. A snapshot held only in node memory is persisted
here too: at a planned exit (the newest one), and after a restart restored it from memory.
"""

from __future__ import annotations

from megatron_pec import log, manifest
from megatron_pec.agent.memory import NodeMemory
from megatron_pec.agent.persist import check_and_persist
from megatron_pec.protocol import JobInfo, NodeMarker, RankFile, SlotRecord
from megatron_pec.slots import SlotCache, slot_path
from megatron_pec.storage import PosixStorage


class Committer:
    def __init__(self, directory: str, storage: PosixStorage, slots: SlotCache):
        self.directory, self.storage, self.slots = directory, storage, slots
        self.pending: dict[tuple[str, int], dict[str, RankFile]] = {}  # (save root, iteration) -> rank files
        self.failed: set[tuple[str, int]] = set()  # (save root, iteration) with a failed rank file

    def failed_persist(self, root: str, iteration: int) -> None:
        self.failed.add((root, iteration))

    def persisted(self, job: JobInfo, iteration: int, rank: int, entry: RankFile) -> None:
        """Rank ``rank``'s file of ``iteration`` is durable; raises OSError when the marker or the
        commit cannot be written."""
        key = (job.save, iteration)
        if key in self.failed:
            return
        done = self.pending.setdefault(key, {})
        done[str(rank)] = entry
        if len(done) < job.local_world_size:
            return
        del self.pending[key]
        marker = NodeMarker(iteration=iteration, node=job.node_rank, job_id=job.job_id,
                            fingerprint=job.fingerprint, topology=job.topology, ranks=done)
        manifest.write_node_marker(job.save, marker, self.storage)
        try:
            committed = manifest.try_commit(job.save, iteration, job.num_nodes, job.keep, self.storage)
        except OSError as exc:
            if not self.storage.exists(manifest.manifest_path(job.save, iteration)):
                raise
            # every node's marker was durable and another node's agent wrote the same manifest
            log.info(f"could not write the commit of iteration {iteration} ({exc}); another node's agent did")
            return
        if committed:
            log.info(f"committed iteration {iteration}")

    def persist_newest(self, served: dict, memory: NodeMemory) -> None:
        """A planned exit (every trainer detached cleanly): persist and commit each rank's newest
        snapshot if storage has nothing as new, so the restart loses nothing. ``served``: rank -> the
        ``Link`` of its latest trainer."""
        for rank, link in sorted(served.items()):
            newest = memory.newest(rank)
            if newest is not None:
                self.persist_from_memory(link, *newest, "planned exit", memory)

    def persist_resumed(self, link, iteration: int, memory: NodeMemory) -> None:
        """A restart restored ``iteration`` from node memory: persist it if it never was, so a second
        failure does not fall back further than it."""
        resumed = memory.newest(link.rank, lambda r: r.iteration == iteration)
        if resumed is not None:
            self.persist_from_memory(link, *resumed, "resumed", memory)

    def persist_from_memory(self, link, slot: int, record: SlotRecord, why: str, memory: NodeMemory) -> None:
        """Persist and commit a snapshot held in node memory unless storage commits it or a newer
        iteration. Only what that snapshot wrote is persisted (a rank file holds one iteration); the
        experts it did not write keep their persisted versions, and a restore accounts their PLT as usual."""
        rank, job, iteration = link.rank, link.job, record.iteration
        root = job.save
        committed = manifest.committed_iterations(root, self.storage)
        if committed and committed[0] >= iteration:
            return
        if self.storage.exists(manifest.node_marker(root, iteration, job.node_rank)):
            return  # persisted by this node already; another node's agent has yet to commit it
        self.failed.discard((root, iteration))  # a failed persist of it is retried now
        target = manifest.rank_file(root, iteration, rank)
        _, places = memory.view_places(rank, iteration)
        elsewhere = {item: slot_path(self.directory, rank, place) for item, place in places.items()}
        try:
            _, _, file = check_and_persist(slot_path(self.directory, rank, slot), iteration, record.run, job.key,
                                           None, target, self.storage, self.slots, elsewhere)
            log.info(f"{why}: persisted rank {rank}'s snapshot of iteration {iteration}")
            self.persisted(job, iteration, rank, RankFile(file=manifest.relative(root, target), **file))
        except Exception as exc:  # storage keeps what it had: said, never hidden
            log.info(f"{why}: cannot persist rank {rank}'s iteration {iteration}: {type(exc).__name__}: {exc}")


__all__ = ["Committer"]
