"""Node memory's history, owned by the node agent: which slot holds which snapshot, of which timeline,
with which item versions - and the one predicate that says whether a slot may be restored.

The agent is the only writer of ``<node dir>/slots.json`` (a ``MemoryIndex``): it records a
slot as soon as its snapshot is checked (the items it wrote; a restore takes the others from
older slots), again once the experts it did not write are carried forward into it, forgets
it when the trainer announces new contents for it, and forks a rank's timeline when a trainer
``Begin``s after a restore. Restore (``sources.memory_sources``) and the agent's own
carry-forward read it through :meth:`NodeMemory.restorable`; nothing else decides.

Timelines: every snapshot carries the id of the run (trainer process) that wrote it.
A rank's lineage is a list of segments ``(run, last iteration)``; a restart that resumes
from iteration T closes every earlier run's segment at T. A slot is restorable only if
its run and iteration lie on the lineage, so a snapshot of an abandoned timeline is never
restored, whatever order slots are reused in.
"""

from __future__ import annotations

import os

from megatron_pec.protocol import JobKey, MemoryIndex, ProtocolError, RankMemory, Segment, SlotHeader, SlotRecord
from megatron_pec.slots import NUM_SLOTS, read_slot_metadata, slot_path
from megatron_pec.stformat import FormatError

INDEX = "slots.json"

__all__ = ["INDEX", "JobKey", "NodeMemory", "header_problem", "read_header"]


def header_problem(header: SlotHeader | str, iteration: int, run: str, job: JobKey | None) -> str | None:
    """Why a slot header does not hold the complete snapshot (``iteration``, ``run``) of ``job``;
    None when it does. ``header`` is the decoded header or the reason it did not decode."""
    if isinstance(header, str):
        return header
    if header.iteration != iteration or header.run != run:
        return f"holds iteration {header.iteration} of run {header.run or '?'}, not iteration {iteration} of run {run}"
    if job is not None and JobKey.of(header) != job:
        return (f"belongs to job {header.job_id!r} with configuration {header.fingerprint} and --save "
                f"{header.save}; this run is job {job.job_id!r} with configuration {job.fingerprint} and --save "
                f"{job.save}")
    return None


def read_header(path: str) -> SlotHeader | str:
    """A slot's decoded header, or the reason it cannot be read (missing, torn, being written)."""
    try:
        metadata = read_slot_metadata(path)
    except (OSError, FormatError) as exc:
        return f"is unreadable ({exc})"
    try:
        return SlotHeader.from_metadata(metadata)
    except ProtocolError as exc:
        return f"has no complete snapshot ({exc})"


class NodeMemory:
    """The index of one node directory (every local rank's slots and timeline)."""

    def __init__(self, directory: str, index: MemoryIndex | None = None):
        self.directory = directory
        index = index or MemoryIndex()
        self.slots: dict[int, dict[int, SlotRecord]] = {
            int(r): {int(s): rec for s, rec in m.slots.items()} for r, m in index.ranks.items()}
        self.lineage: dict[int, list[Segment]] = {int(r): list(m.lineage) for r, m in index.ranks.items()}

    @classmethod
    def read(cls, directory: str) -> "NodeMemory":
        """The index as the agent last wrote it; empty if there is none or it cannot be decoded
        (then nothing in node memory is restorable - never a guess)."""
        try:
            with open(os.path.join(directory, INDEX), "rb") as f:
                return cls(directory, MemoryIndex.loads(f.read()))
        except (OSError, ProtocolError):
            return cls(directory)

    def write(self) -> None:
        """Agent only: replace ``slots.json`` atomically (tmpfs: no fsync needed)."""
        ranks = {str(r): RankMemory({str(s): rec for s, rec in self.slots.get(r, {}).items()},
                                    self.lineage.get(r, []))
                 for r in sorted(set(self.slots) | set(self.lineage))}
        tmp = os.path.join(self.directory, INDEX + ".tmp")
        with open(tmp, "w") as f:
            f.write(MemoryIndex(ranks).dumps())
        os.replace(tmp, os.path.join(self.directory, INDEX))

    # ---- the agent's updates ---------------------------------------------------------------------
    def forget(self, rank: int, slot: int) -> None:
        self.slots.get(rank, {}).pop(slot, None)

    def record(self, rank: int, slot: int, record: SlotRecord) -> None:
        self.slots.setdefault(rank, {})[slot] = record

    def adopt(self, rank: int, slot: int, record: SlotRecord, lineage: list[Segment]) -> None:
        """A snapshot pulled from a peer's replica becomes this rank's slot, with the timeline it had."""
        self.lineage[rank] = list(lineage)
        self.record(rank, slot, record)

    def begin(self, rank: int, run: str, resumed_from: int | None) -> None:
        """``run`` continues from ``resumed_from`` (None: from scratch): every other run's snapshots
        after that iteration are abandoned. Repeating it (a reconnect) changes nothing."""
        cut = -1 if resumed_from is None else resumed_from
        kept = [Segment(s.run, cut if s.last is None else min(s.last, cut))
                for s in self.lineage.get(rank, []) if s.run != run]
        own = [s for s in self.lineage.get(rank, []) if s.run == run] or [Segment(run, None)]
        self.lineage[rank] = [s for s in kept if s.last >= 0] + own

    # ---- questions ---------------------------------------------------------------------------------
    def on_lineage(self, rank: int, record: SlotRecord) -> bool:
        return any(s.admits(record.run, record.iteration) for s in self.lineage.get(rank, []))

    def newest(self, rank: int, accept=None, exclude=frozenset()) -> tuple[int, SlotRecord] | None:
        """The slot with the newest snapshot on the rank's timeline (the one the agent keeps for recovery),
        among the records ``accept(record)`` approves if given and the slots not in ``exclude``."""
        live = [(rec.iteration, slot) for slot, rec in self.slots.get(rank, {}).items()
                if slot not in exclude and self.on_lineage(rank, rec) and (accept is None or accept(rec))]
        if not live:
            return None
        slot = max(live)[1]
        return slot, self.slots[rank][slot]

    def grantable(self, rank: int, busy: set[int], uncarried=frozenset()) -> list[int]:
        """Slots the trainer may overwrite: not ``busy`` (announced, being read), not the newest
        snapshot and, while ``uncarried`` snapshots wait for their experts, not the newest complete
        one they are carried from; oldest contents first."""
        keep = {found[0] for found in (self.newest(rank), self.newest(rank, exclude=uncarried)) if found}
        records = self.slots.get(rank, {})

        def reuse_order(slot: int):  # abandoned or empty slots first, then the oldest snapshot
            record = records.get(slot)
            return (record is not None and self.on_lineage(rank, record), record.iteration if record else -1)

        free = [s for s in range(NUM_SLOTS) if s not in busy and s not in keep]
        return sorted(free, key=reuse_order)

    def is_restorable(self, rank: int, slot: int, job: JobKey | None) -> tuple[SlotRecord, SlotHeader] | str:
        """The one predicate: the slot's record and header when it may serve a restore or a carry of
        ``job`` (None: any job), else the reason it may not."""
        record = self.slots.get(rank, {}).get(slot)
        if record is None:
            return "is not recorded as complete by the node agent"
        if not self.on_lineage(rank, record):
            return f"holds iteration {record.iteration} of an abandoned timeline (run {record.run})"
        header = read_header(slot_path(self.directory, rank, slot))
        problem = header_problem(header, record.iteration, record.run, job)
        return problem if problem is not None else (record, header)

    def restorable(self, rank: int, job: JobKey) -> tuple[list[tuple[str, SlotRecord, SlotHeader]], list[str]]:
        """(path, record, header) of every slot of ``rank`` that may serve a restore of ``job``, newest
        first, and the reasons other recorded slots of another job or configuration were passed over."""
        found, foreign = [], []
        for slot in sorted(self.slots.get(rank, {})):
            path = slot_path(self.directory, rank, slot)
            verdict = self.is_restorable(rank, slot, job)
            if isinstance(verdict, str):
                if verdict.startswith("belongs to job"):
                    foreign.append(f"{path} {verdict}")
                continue
            found.append((path, *verdict))
        found.sort(key=lambda t: -t[1].iteration)
        return found, foreign
