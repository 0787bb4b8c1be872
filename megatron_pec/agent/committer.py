"""Save step 6, persist and commit (its commit) - and the persists a restart relies on.

Runs in the node agent's writer thread (``writer.py``; at a planned exit, once the writer stopped, in
the agent's main thread). A node's part of an iteration is done when every local
rank's file of it is durable: then the node marker is written, and whichever node's agent sees
every marker writes the manifest and the tracker (``CheckpointDir.try_commit``). An iteration any of
whose rank files failed is never committed. What a commit leaves to tidy (the files of a save it
replaced, retention) runs off its path, in the purge thread (``Purge``, as torchtitan's purge thread).
A snapshot held only in node memory is persisted here too: at a planned exit (the newest one), and
after a restart restored it from memory.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

from megatron_pec.agent.persist import check_snapshot, write_rank_file
from megatron_pec.common import log
from megatron_pec.format.protocol import JobInfo, NodeMarker, RankFile, SlotRecord
from megatron_pec.memory.history import NodeMemory
from megatron_pec.memory.slots import SlotCache, slot_path
from megatron_pec.store.checkpoint_dir import CheckpointDir, ManifestError


class Purge:
    """One thread that runs the tidying commits hand it (``put``), in order; a failure is said and the
    next one runs (retention is retried at the next commit). ``wait()``: until all put so far ran."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="pec-purge", daemon=True)
        self.thread.start()

    def put(self, tidy) -> None:
        self.queue.put(tidy)

    def wait(self) -> None:
        self.queue.join()

    def stop(self, timeout: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (tidy := self.queue.get()) is not None:
            try:
                tidy()
            except Exception as exc:  # (storage errors: the checkpoint is committed; training goes on)
                log.info(f"tidying after a commit failed: {type(exc).__name__}: {exc}")
            finally:
                self.queue.task_done()


class Committer:
    def __init__(self, directory: str, slots: SlotCache):
        self.directory, self.slots = directory, slots
        self.purge = Purge()
        # (save root, iteration, generation) -> rank files of one save; saves with a failed rank file
        self.pending: dict[tuple[str, int, str], dict[str, RankFile]] = {}
        self.failed: set[tuple[str, int, str]] = set()

    def locator(self, rank: int, home: int, places: dict[str, int]):
        """``locate(item)`` for ``write_rank_file``: where a snapshot's item lies (``places``: where not in
        ``home``)."""
        return self.slots.locator(self.directory, rank, home, places)

    def failed_persist(self, root: str, iteration: int, generation: str) -> None:
        self.failed.add((root, iteration, generation))

    def persisted(self, checkpoints: CheckpointDir, job: JobInfo, iteration: int, rank: int, entry: RankFile,
                  generation: str) -> bool:
        """Rank ``rank``'s file of save ``generation`` of ``iteration`` is durable in ``checkpoints`` (the job's
        --save); False when that save can no longer commit (another local rank's file of it failed). Raises
        OSError or ManifestError when the marker or the commit cannot be written."""
        key = (checkpoints.root, iteration, generation)
        if key in self.failed:
            return False
        done = self.pending.setdefault(key, {})
        done[str(rank)] = entry
        if len(done) < job.local_world_size:
            return True
        del self.pending[key]
        if job.num_nodes == 1 and checkpoints.references(iteration, done):
            # every rank's part is the committed file (a restored iteration storage holds as completely): the
            # commit stands as it is, and nothing is written (not a marker to delete again at every restore)
            return True
        marker = NodeMarker(iteration=iteration, node=job.node_rank, job_id=job.job_id,
                            fingerprint=job.fingerprint, topology=job.topology, ranks=done, generation=generation)
        checkpoints.write_node_marker(marker)
        try:
            committed = checkpoints.try_commit(iteration, job.num_nodes, job.keep, generation, defer=self.purge.put)
        except OSError as exc:
            if not self._committed_as(checkpoints, iteration, generation):
                raise
            # every node's marker was durable and another node's agent wrote the same manifest
            log.info(f"could not write the commit of iteration {iteration} ({exc}); another node's agent did")
            return True
        if committed:
            log.info(f"committed iteration {iteration}")
        return True

    @staticmethod
    def _committed_as(checkpoints: CheckpointDir, iteration: int, generation: str) -> bool:
        """The manifest of ``iteration`` is this save's (not an earlier save's it was to replace)."""
        try:
            return checkpoints.read_manifest(iteration).generation == generation
        except (OSError, ManifestError):
            return False

    def persist_newest(self, served: dict, memory: NodeMemory) -> bool:
        """A planned exit (every trainer detached cleanly): persist and commit each rank's newest snapshot
        where storage does not hold it as completely - at a clean exit the trainer completed it with
        every expert, so the restart restores with nothing lost. ``served``: rank -> the ``Link`` of its
        latest trainer. Runs after the worker and the writer stopped. False (warned) where storage does not
        hold some rank's newest snapshot (the store down, full, failing): node memory must then stay."""
        unsafe = []
        for rank, link in sorted(served.items()):
            newest = memory.newest(rank)
            if newest is not None:
                why = self.persist_from_memory(link, MemoryCopy.of(memory, rank, *newest), "planned exit",
                                               f"{link.job.session}.exit")
                if why is not None:
                    unsafe.append(f"rank {rank}'s iteration {newest[1].iteration}: {why}")
        if unsafe:  # (a planned exit loses nothing: the newest state stays where it still is)
            log.warning(f"planned exit: storage does not hold the newest snapshot of {'; '.join(unsafe)}; node memory "
                        f"keeps the job's files in {self.directory}: relaunch the job to restore from them (its next "
                        "clean end persists them and removes them)")
        return not unsafe

    def persist_from_memory(self, link, copy: "MemoryCopy", why: str, generation: str) -> str | None:
        """Persist and commit the items snapshot ``copy`` wrote (a rank file holds one iteration's items) as
        save ``generation``, unless storage holds a newer iteration or this save already. Where the
        committed file of the iteration holds every item the snapshot wrote, that file (never written
        again) is this rank's part of the save: every rank takes part, so the save can commit. Returns None
        once storage holds this rank's part, else what went wrong."""
        rank, job, iteration, checkpoints = link.rank, link.job, copy.record.iteration, link.checkpoints
        try:
            committed = checkpoints.committed_iterations()
            if committed and committed[0] > iteration:
                return None
            entry = None
            if committed and committed[0] == iteration:
                held = checkpoints.read_manifest(iteration)
                if held.generation == generation:
                    return None  # this save is committed
                entry = held.ranks.get(str(rank))
            if job.node_rank in checkpoints.persisted_nodes(iteration, generation):
                return None  # persisted by this node already; another node's agent has yet to commit it
            self.failed.discard((checkpoints.root, iteration, generation))  # a failed persist of it is retried now
            if entry is not None and copy.written <= set(entry.items):
                self.persisted(checkpoints, job, iteration, rank, entry, generation)
                return None
            target = checkpoints.fresh_rank_file(iteration, rank, generation)
            checked = check_snapshot(slot_path(self.directory, rank, copy.slot), iteration, copy.record.run, job.key,
                                     self.slots, self.locator(rank, copy.slot, copy.places))
            file = write_rank_file(checked, set(checked.snapshot.items), target, checkpoints.storage,
                                   self.locator(rank, copy.slot, copy.places))
            log.info(f"{why}: persisted rank {rank}'s snapshot of iteration {iteration}")
            self.persisted(checkpoints, job, iteration, rank, RankFile(file=checkpoints.relative(target), **file),
                           generation)
            return None
        except Exception as exc:  # storage keeps what it had: said, never hidden
            log.info(f"{why}: cannot persist rank {rank}'s iteration {iteration}: {type(exc).__name__}: {exc}")
            return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class MemoryCopy:
    """What persisting a snapshot held in node memory reads, taken where node memory is owned (the worker):
    its home ``slot`` and ``record``, the items it wrote, and the slots of the ones not in its home."""

    rank: int
    slot: int
    record: SlotRecord
    written: frozenset
    places: dict[str, int]

    @classmethod
    def of(cls, memory: NodeMemory, rank: int, slot: int, record: SlotRecord) -> "MemoryCopy":
        iteration = record.iteration
        written = frozenset(i for i, v in memory.view(rank, iteration).items.items() if v == iteration)
        _, places = memory.view_places(rank, iteration)
        return cls(rank, slot, record, written, dict(places))


__all__ = ["Committer", "MemoryCopy"]
