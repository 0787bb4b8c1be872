"""Node memory's history, owned by the node agent: which region of which slot file holds which version
of which item, of which timeline - and the one predicate that says what may be restored.

A rank has two home slots, each with a region for its dense state, and a pool of expert regions
(``memory/slot_map.py``; pool region j is slot ``POOL + j``, holding one expert's version at a time). A
snapshot writes its header and dense state into one home slot and each expert it writes into a pool
region the trainer chose (``regions.RegionBook``); nothing is copied afterwards.
The agent is the only writer of ``<node dir>/slots.json`` (a ``MemoryIndex``): per slot, a
``SlotRecord`` of its home snapshot and of every region that holds a recorded version. It records a
snapshot as soon as its header is checked (``record_snapshot``), drops regions a trainer overwrote
without announcing them, and forks a rank's timeline when a trainer ``Begin``s after a restore.
Restore (``sources.memory_sources``), persists and replication read it through ``restorable``,
``newest`` and ``view``; nothing else decides.

Timelines: every region carries the run (trainer process) that wrote it. A rank's lineage is a list of
segments ``(run, last iteration)``; a restart that resumes from iteration T closes every earlier
run's segment at T. A region or home is restorable only if its run and version lie on the lineage,
so a snapshot of an abandoned timeline is never restored, whatever order regions are reused in.
"""

from __future__ import annotations

import dataclasses
import json
import os

from megatron_pec.format.item_names import NON_EXPERT
from megatron_pec.format.protocol import JobKey, MemoryIndex, ProtocolError, RankMemory, Segment, SlotHeader, SlotRecord
from megatron_pec.format.stformat import FormatError
from megatron_pec.memory.node_files import replace_node_file
from megatron_pec.memory.slot_map import is_pool
from megatron_pec.memory.slots import read_slot_metadata, slot_path

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


NO_HOME = -1  # a slot record's iteration when the slot holds no complete snapshot's header


class NodeMemory:
    """The index of one node directory (every local rank's slots and timeline)."""

    def __init__(self, directory: str, index: MemoryIndex | None = None):
        self.directory = directory
        index = index or MemoryIndex()
        self.slots: dict[int, dict[int, SlotRecord]] = {
            int(r): {int(s): rec for s, rec in m.slots.items()} for r, m in index.ranks.items()}
        self.lineage: dict[int, list[Segment]] = {int(r): list(m.lineage) for r, m in index.ranks.items()}
        self.jobs: dict[int, JobKey] = {int(r): JobKey(*m.job) for r, m in index.ranks.items() if len(m.job) == 3}

    @classmethod
    def read(cls, directory: str, rank: int | None = None) -> "NodeMemory":
        """The index as the agent last wrote it; empty if there is none or it cannot be decoded
        (then nothing in node memory is restorable - never a guess). ``rank``: that rank's part only
        (a trainer reads its own: the other local ranks' records are not decoded, 7 of 8 on a GPU node)."""
        try:
            with open(os.path.join(directory, INDEX), "rb") as f:
                data = json.loads(f.read())
            if rank is not None and isinstance(data, dict) and isinstance(data.get("ranks"), dict):
                data = {**data, "ranks": {k: v for k, v in data["ranks"].items() if k == str(rank)}}
            return cls(directory, MemoryIndex.decode(data))
        except (OSError, ValueError, ProtocolError):
            return cls(directory)

    def write(self) -> None:
        """Agent only: replace ``slots.json`` atomically (tmpfs: no fsync needed)."""
        ranks = {str(r): RankMemory({str(s): rec for s, rec in self.slots.get(r, {}).items()},
                                    self.lineage.get(r, []), list(self.jobs[r]) if r in self.jobs else [])
                 for r in sorted(set(self.slots) | set(self.lineage))}
        replace_node_file(os.path.join(self.directory, INDEX), MemoryIndex(ranks).dumps())

    # ---- the agent's updates ---------------------------------------------------------------------
    def record_snapshot(self, rank: int, home: int, header: SlotHeader, checks: dict, places: dict[str, int],
                        stale: dict[str, list[int]], job: JobKey) -> None:
        """Snapshot ``header`` is complete: its header and dense state in slot ``home``, each item it wrote
        in ``places.get(item, home)`` with its checksum in ``checks``; the regions in ``stale`` lost
        what they held."""
        self._own(rank, job)
        for item, slots in stale.items():
            for slot in slots:
                self._drop(rank, slot, item)
        records = self.slots.setdefault(rank, {})
        for slot, record in list(records.items()):  # an earlier snapshot of the same iteration: superseded
            if slot != home and record.iteration == header.iteration and record.run == header.run:
                records[slot] = self._without_home(record)
        previous_home = records.get(home)
        if previous_home is not None and previous_home.iteration != NO_HOME:
            # The home's header is replaced: what stays of the old home snapshot keeps its run.
            records[home] = self._without_home(previous_home)
        for item, version in header.items.items():
            slot = places.get(item, home)
            self._put(rank, slot, item, version, checks[item], header.run, header.tokens.get(item))
        record = records[home]
        records[home] = dataclasses.replace(
            record, iteration=header.iteration, run=header.run,
            runs={i: r for i, r in ((i, record.run_of(i)) for i in record.items) if r != header.run})

    def adopt(self, rank: int, home: int, record: SlotRecord, lineage: list[Segment], job: JobKey,
              places: dict[str, int]) -> None:
        """A snapshot pulled from a peer's replica becomes this rank's node memory, with the timeline it had:
        its dense state in ``home``, each expert in the region ``places`` names."""
        self.jobs[rank] = job
        self.lineage[rank] = list(lineage)
        self.slots[rank] = {}
        for item, slot in {NON_EXPERT: home, **places}.items():
            if item not in record.items:
                continue
            keep = lambda values, item=item: {item: values[item]} if item in values else {}  # (bound per item)
            runs = {item: record.run_of(item)} if record.run_of(item) != record.run else {}
            self.slots[rank][slot] = dataclasses.replace(
                record, iteration=record.iteration if slot == home else NO_HOME, run=record.run if slot == home else "",
                items={item: record.items[item]}, crcs=keep(record.crcs), sums=keep(record.sums),
                tokens=keep(record.tokens), runs=runs if slot == home else {item: record.run_of(item)})

    def begin(self, rank: int, run: str, resumed_from: int | None, job: JobKey) -> None:
        """``run`` continues from ``resumed_from`` (None: from scratch): every other run's snapshots
        after that iteration are abandoned. Repeating it (a reconnect) changes nothing."""
        self._own(rank, job)
        cut = -1 if resumed_from is None else resumed_from
        kept = [Segment(s.run, cut if s.last is None else min(s.last, cut))
                for s in self.lineage.get(rank, []) if s.run != run]
        own = [s for s in self.lineage.get(rank, []) if s.run == run] or [Segment(run, None)]
        held = self._runs_held(rank)  # (a segment of a run that holds nothing admits nothing: every restart
        # would otherwise add one for good, and every restore reads them)
        self.lineage[rank] = [s for s in kept if s.last >= 0 and s.run in held] + own

    def _runs_held(self, rank: int) -> set[str]:
        """The runs that wrote what the rank's records hold."""
        runs = set()
        for record in self.slots.get(rank, {}).values():
            runs.add(record.run)
            runs.update(record.runs.values())
        return runs

    def _own(self, rank: int, job: JobKey) -> None:
        """Regions written under another job, configuration or --save are forgotten (the slot files of
        another configuration are laid out anew anyway)."""
        if self.jobs.get(rank) not in (None, job):
            self.slots.pop(rank, None)
            self.lineage.pop(rank, None)
        self.jobs[rank] = job

    def _drop(self, rank: int, slot: int, item: str) -> None:
        record = self.slots.get(rank, {}).get(slot)
        if record is not None and is_pool(slot):
            del self.slots[rank][slot]  # (a pool region held one item, whichever: it was overwritten)
            return
        if record is None or item not in record.items:
            return
        if item == NON_EXPERT and record.iteration != NO_HOME:
            record = self._without_home(record)
        self.slots[rank][slot] = dataclasses.replace(
            record, items=_without(record.items, item), crcs=_without(record.crcs, item),
            sums=_without(record.sums, item), tokens=_without(record.tokens, item), runs=_without(record.runs, item))

    def _put(self, rank: int, slot: int, item: str, version: int, check, run: str, tokens: int | None) -> None:
        record = self.slots.setdefault(rank, {}).get(slot) or SlotRecord(NO_HOME, "", {})
        if is_pool(slot) and set(record.items) - {item}:
            record = SlotRecord(NO_HOME, "", {})  # a pool region holds one item: the one written now
        sums, crcs = dict(record.sums), dict(record.crcs)
        (sums if isinstance(check, str) else crcs)[item] = check
        (crcs if isinstance(check, str) else sums).pop(item, None)
        runs = dict(record.runs)
        if run != record.run:
            runs[item] = run
        else:
            runs.pop(item, None)
        tokens_at = dict(record.tokens)
        if tokens is not None:
            tokens_at[item] = tokens
        else:
            tokens_at.pop(item, None)
        self.slots[rank][slot] = dataclasses.replace(record, items={**record.items, item: version}, sums=sums,
                                                     crcs=crcs, runs=runs, tokens=tokens_at)

    @staticmethod
    def _without_home(record: SlotRecord) -> SlotRecord:
        """The record with no home snapshot: its regions keep their runs; its dense state goes with the
        header it belonged to."""
        runs = {i: record.run_of(i) for i in record.items if i != NON_EXPERT}
        kept = dataclasses.replace(record, iteration=NO_HOME, run="", runs=runs)
        if NON_EXPERT not in record.items:
            return kept
        return dataclasses.replace(kept, items=_without(kept.items, NON_EXPERT), crcs=_without(kept.crcs, NON_EXPERT),
                                   sums=_without(kept.sums, NON_EXPERT), tokens=_without(kept.tokens, NON_EXPERT))

    # ---- questions ---------------------------------------------------------------------------------
    def admits(self, rank: int, run: str, version: int) -> bool:
        return any(s.admits(run, version) for s in self.lineage.get(rank, []))

    def on_lineage(self, rank: int, record: SlotRecord) -> bool:
        """The slot's home snapshot lies on the rank's timeline."""
        return record.iteration != NO_HOME and self.admits(rank, record.run, record.iteration)

    def newest(self, rank: int, accept=None) -> tuple[int, SlotRecord] | None:
        """The slot of the newest home snapshot on the rank's timeline, among the records ``accept(record)``
        approves if given."""
        live = [(rec.iteration, slot) for slot, rec in self.slots.get(rank, {}).items()
                if self.on_lineage(rank, rec) and (accept is None or accept(rec))]
        if not live:
            return None
        slot = max(live)[1]
        return slot, self.slots[rank][slot]

    def regions(self, rank: int, upto: int | None = None) -> dict[str, tuple[int, int]]:
        """item -> (slot, version) of its newest version on the rank's timeline (up to ``upto``)."""
        best: dict[str, tuple[int, int]] = {}
        for slot, record in self.slots.get(rank, {}).items():
            for item, version in record.items.items():
                if (upto is None or version <= upto) and self.admits(rank, record.run_of(item), version) \
                        and version > best.get(item, (0, -1))[1]:
                    if item == NON_EXPERT and not self.on_lineage(rank, record):
                        continue
                    best[item] = (slot, version)
        return best

    def view(self, rank: int, iteration: int) -> SlotRecord:
        """Snapshot ``iteration`` as a whole: every item at its newest version up to it, its checksum and
        token count, and (``places``: ``view_places``) where it lies."""
        home = next((s for s, r in self.slots.get(rank, {}).items() if r.iteration == iteration
                     and self.on_lineage(rank, r)), None)
        items, sums, crcs, tokens, runs = {}, {}, {}, {}, {}
        run = self.slots[rank][home].run if home is not None else ""
        for item, (slot, version) in self.regions(rank, iteration).items():
            record = self.slots[rank][slot]
            items[item] = version
            check = record.checks[item]
            (sums if isinstance(check, str) else crcs)[item] = check
            if item in record.tokens:
                tokens[item] = record.tokens[item]
            if record.run_of(item) != run:
                runs[item] = record.run_of(item)
        return SlotRecord(iteration, run, items, crcs=crcs, tokens=tokens, sums=sums, runs=runs)

    def view_places(self, rank: int, iteration: int) -> tuple[int, dict[str, int]]:
        """(home slot, item -> slot where not the home) of the view of snapshot ``iteration``."""
        home = next(s for s, r in self.slots.get(rank, {}).items() if r.iteration == iteration
                    and self.on_lineage(rank, r))
        return home, {item: slot for item, (slot, _) in self.regions(rank, iteration).items() if slot != home}

    def is_restorable(self, rank: int, slot: int, job: JobKey | None) -> tuple[SlotRecord, SlotHeader | None] | str:
        """The slot's record, restricted to what may serve a restore of ``job`` (None: any job), and its
        home snapshot's header (None when it has no home on the timeline; its regions may still serve),
        else the reason nothing of it may."""
        record = self.slots.get(rank, {}).get(slot)
        if record is None:
            return "is not recorded as complete by the node agent"
        if job is not None and self.jobs.get(rank) not in (None, job):
            known = self.jobs[rank]
            return (f"belongs to job {known.job_id!r} with configuration {known.fingerprint} and --save {known.save}; "
                    f"this run is job {job.job_id!r} with configuration {job.fingerprint} and --save {job.save}")
        header = None
        if self.on_lineage(rank, record):
            found = read_header(slot_path(self.directory, rank, slot))
            problem = header_problem(found, record.iteration, record.run, job)
            if problem is not None and problem.startswith("belongs to job"):
                return problem
            header = None if problem is not None else found
        keep = {i: v for i, v in record.items.items() if self.admits(rank, record.run_of(i), v)
                and (i != NON_EXPERT or header is not None)}
        if not keep:
            if record.iteration != NO_HOME and not self.on_lineage(rank, record):
                return f"holds iteration {record.iteration} of an abandoned timeline (run {record.run})"
            return "holds no complete snapshot and no recorded region"
        if header is None and record.iteration != NO_HOME:
            record = dataclasses.replace(record, iteration=NO_HOME)
        # (a pool region's record is mostly kept whole: a listing goes through thousands of them)
        return (record if len(keep) == len(record.items) else dataclasses.replace(record, items=keep)), header

    def restorable(self, rank: int, job: JobKey
                   ) -> tuple[list[tuple[int, str, SlotRecord, SlotHeader | None]], list[str]]:
        """(slot, path, record, home header) of every slot of ``rank`` that may serve a restore of ``job``, the
        newest home first (records keep only what may serve), and the reasons slots of another job or
        configuration were passed over."""
        found, foreign = [], []
        for slot in sorted(self.slots.get(rank, {})):
            path = slot_path(self.directory, rank, slot)
            verdict = self.is_restorable(rank, slot, job)
            if isinstance(verdict, str):
                if verdict.startswith("belongs to job"):
                    foreign.append(f"{path} {verdict}")
                continue
            found.append((slot, path, *verdict))
        found.sort(key=lambda t: -t[2].iteration)
        return found, foreign


def _without(values: dict, key) -> dict:
    if key not in values:
        return values
    return {k: v for k, v in values.items() if k != key}


__all__ += ["NO_HOME"]
