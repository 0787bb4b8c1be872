"""Load steps 3-5: what every rank restores, decided without side effects - a ``RestoreDecision``. The
restore acts on it (``restore/restore.py``: load steps 6-7, the fallback loop, the retirement after success).

Runs on every rank (collective). Communication is limited to a few small
all-gathers/all-reduces (``Collectives``): every rank reads its own shard back,
no scatter. Nothing here knows Megatron, writes a file or changes another object's state.

3. list     each rank's candidates: node-memory snapshots (the agent's index) and committed
            iterations of its configuration, once per load (``Loader.candidates``).
4. agree    the newest iteration every rank can restore, none the caller excluded; non-expert
   and read state from it (T); each expert from the newest version <= T that every rank holding
            a shard of it can read; every item read and verified against its checksum
            (``Loader.plan``). An iteration some rank cannot read is ``Refused``: the engine
            excludes it and asks again.
5. decide   the tensors per slice, the small state, the PEC state with this restore's
            PLT folded in (Dynamic-K applied): a ``RestoreDecision``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megatron_pec.common import log
from megatron_pec.common.collectives import ANOTHER_RANK_FAILED, Collectives
from megatron_pec.common.errors import CheckpointError, StorageUnreachable
from megatron_pec.common.phases import Phases
from megatron_pec.config import PecConfig
from megatron_pec.format import reduced_record
from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
from megatron_pec.format.protocol import JobKey, Manifest
from megatron_pec.format.reduced_record import MIN, columns, scalar, vector
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.integrity.kinds import is_sum64
from megatron_pec.job_facts import JobFacts
from megatron_pec.memory.slots import SlotFiles
from megatron_pec.pec import lost_tokens
from megatron_pec.pec.state import PecState
from megatron_pec.restore import reshard
from megatron_pec.restore.accounting import ACCOUNT_VECTORS, account, accounting_columns, choose_k, stage_experts
from megatron_pec.restore.sources import Source, SourceError, expert_source_for, memory_sources, storage_sources
from megatron_pec.store.checkpoint_dir import TRACKER, CheckpointDir, ManifestError

MAX_CANDIDATES = 32
LIST_OLDER = 64  # a restore log line names at most this many experts restored from older versions
NONE = 2**62  # "no version" in MIN reductions


@dataclass(frozen=True)
class LoadContext:
    """What a load needs to know about this rank and job (built by the engine, read-only here)."""

    job: JobFacts
    config: PecConfig
    collectives: Collectives
    slice_items: dict[str, str]         # slice name -> item it belongs to
    slots: SlotFiles | None = None      # the trainer's own slot files, if mapped
    phases: Phases = field(default_factory=Phases)  # where this load's time goes (the engine's)

    @property
    def rank(self) -> int:
        return self.job.rank

    @property
    def experts_held(self) -> tuple[ExpertId, ...]:
        """The experts this rank holds a shard of."""
        return tuple(self.job.held_names)

    @property
    def all_experts(self) -> tuple[ExpertId, ...]:
        """Every expert of the model: the index space of the agreement's vectors."""
        return self.job.all_experts

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (Dynamic-K's ceiling); 0 without MoE."""
        return self.job.expert_layout.num_experts if self.job.expert_layout else 0


@dataclass
class Candidates:
    """What one rank can restore from (load step 3), listed once per load and planned from until a plan
    sticks (``Loader.plan``)."""

    memory: list[Source]                 # node-memory snapshots the agent says may serve a restore
    stored: dict[int, Source]            # committed iteration -> this rank's file of it (this configuration)
    manifests: dict[int, Manifest]       # ... and its manifest
    error: str | None = None             # this rank could not list its sources (every rank raises)
    reshard: Manifest | None = None      # the newest committed iteration, saved by another layout: reshard it
    unreachable: str | None = None       # the storage could not be reached: node memory alone was listed

    @property
    def iterations(self) -> set[int]:
        return {s.iteration for s in self.memory if s.iteration >= 0} | set(self.stored)


@dataclass(frozen=True)
class Refused:
    """The ranks agreed on ``iteration`` and some rank cannot restore it: every rank excludes it and plans
    again (``Restore.run``)."""

    iteration: int
    why: str | None  # this rank's reason (None: another rank's)


@dataclass
class RestoreDecision:
    """What the loader decided: iteration ``iteration`` of ``source`` with these item versions."""

    iteration: int
    source: str                             # where the non-expert state comes from: memory, peer memory, storage
    versions: dict[str, int]                # item -> version restored (this rank's items)
    tensors: dict                           # slice name -> tensor (verified bytes, read-only views)
    small: SmallState                       # optimizer param_groups, scheduler, RNG, args, ...
    pec: PecState | None                    # with this restore's PLT folded in; None without MoE
    tokens_at_target: dict[ExpertId, int]   # cumulative token counts at the iteration, this stage's experts
    report: lost_tokens.PltReport | None
    resharded: bool = False                 # saved by another layout: no older file holds this rank's slices
    # item -> (its recorded checksum, where it came from): memory items the restore verifies once the
    # bytes are on the device, or while the host copies them (``Loader(checked_after_copy=True)``); on a
    # device, the items of the rank files it reads there too
    check_after_copy: dict[str, tuple] = field(default_factory=dict)
    # slice name -> (its item, its byte offset in the item) of those items' slices, for a host copy that
    # sums them (``Loader(summed_by_copy=True)``)
    places: dict[str, tuple[str, int]] = field(default_factory=dict)
    newest: int = -1                        # the newest iteration any rank has a source of (a lost node's)
    # rank files the restore reads in step 6, straight into the tensors it restores, and the slices it takes
    # from each (``Loader(read_later=True)``; ``Source.read_into``)
    reads: list[tuple[Source, set[str]]] = field(default_factory=list)

    def log(self, rank: int) -> None:
        """Every rank: where it restored from and which experts are older; rank 0: the PLT."""
        line = f"restored iteration {self.iteration} from {self.source}"
        if self.source.startswith("peer memory") and self.newest > self.iteration:
            line += f", {self.newest - self.iteration} iteration(s) behind the newest snapshot of any rank"
        older = {i: v for i, v in self.versions.items() if i != NON_EXPERT and v < self.iteration}
        if len(older) > LIST_OLDER:  # thousands of experts: their count per version
            counts = Counter(older.values())
            line += f"; experts from older versions: {len(older)} (" + ", ".join(
                f"{n} at {v}" for v, n in sorted(counts.items(), reverse=True)) + ")"
        elif older:
            line += "; experts from older versions: " + ", ".join(f"{i}@{v}" for i, v in sorted(older.items()))
        files = {source.where for source, _ in self.reads}
        stored = sum(where in files for _, where in self.check_after_copy.values())
        if len(self.check_after_copy) > stored:
            line += f"; {len(self.check_after_copy) - stored} item(s) from node memory checked where they landed"
        if stored:
            line += f"; {stored} item(s) from storage checked where they landed"
        log.info(line, rank=rank)
        if self.report is not None and rank == 0:
            for text in self.report.format_lines():
                log.info(text)


@dataclass
class DecisionVote:
    """One rank's part of the agreement on a plan - and, after the all-reduce, every rank's: each field
    reduced over the ranks as it declares (``format/reduced_record.py``).

    ``high``/``low``/``lacking`` (one int per expert of the model) are sent only with the first plan of
    an iteration, to find experts that ranks planned at different versions."""

    failed: int = scalar()               # 1: this rank could not list its sources (reduced: any rank; all raise)
    cannot: int = scalar()               # 1: this rank cannot restore its plan (reduced: any rank)
    iteration: int = scalar()            # the iteration planned (-1: none); reduced: the highest any rank planned
    lowest_iteration: int = scalar(MIN)  # the same; reduced: the lowest any rank planned
    newest: int = scalar()               # the newest iteration this rank has a source of, excluded or not (-1: none)
    accounting: list[list[int]] = columns(ACCOUNT_VECTORS)  # the PLT accounting (-1: unknown here)
    high: list[int] | None = vector(optional=True)          # the newest version planned (-2: not held)
    low: list[int] | None = vector(MIN, optional=True)      # the oldest version planned (NONE: not held)
    lacking: list[int] | None = vector(optional=True)       # 1: a rank planned a version but has no source for it


@dataclass
class Agreement:
    """What the ranks agreed about their plans (``Loader._vote``): all but ``state`` and ``versions``
    (this rank's experts) the same on every rank."""

    failed: bool                  # some rank could not list its sources: every rank raises
    same_iteration: bool          # every rank planned the same iteration
    every_rank_can: bool          # ... and every rank can restore its plan for it
    accounted: list[list[int]]    # the PLT accounting's columns, completed over the ranks
    state: PecState | None        # the dense source's PEC state (None without MoE or on failure)
    newest: int = -1              # the newest iteration any rank has a source of (what a lost node was at)
    versions: dict[str, int | None] | None = None  # per held expert, where ranks planned different versions


@dataclass
class Prepared:
    """The part of a decision (load step 5) that needs no other rank (``Loader._prepare``)."""

    tensors: dict                          # slice name -> tensor (verified bytes, read-only views)
    places: dict[str, tuple[str, int]]     # slice name -> (item, byte offset) for a host copy that sums them
    reads: list                            # (rank file, slices) read in step 6
    versions: dict[str, int]               # item -> version restored
    after_copy: dict[str, tuple]           # item -> (its checksum, where it came from), checked where it lands
    small: SmallState


def _newest_committed(directory: CheckpointDir) -> Manifest | None:
    """The manifest of the newest committed iteration (another layout's too), if readable."""
    committed = directory.committed_iterations()
    if not committed:
        return None
    try:
        return directory.read_manifest(committed[0])
    except ManifestError:
        return None  # the normal path skips it with its warning


def _warn_stale_tracker(directory: CheckpointDir, rank: int, manifests: dict) -> None:
    """The tracker is a hint for Megatron's tools; validity comes only from manifests (rank 0 says so; the
    other ranks do not read it)."""
    if rank != 0:
        return
    tracker = directory.read_tracker()
    if tracker and tracker.isdigit() and int(tracker) not in manifests:
        log.warning(f"{directory.root}/{TRACKER} names iteration {tracker}, which has no valid manifest; "
                    "ignoring it and using the newest committed iteration")


def _unless_unreachable(read, otherwise=None):
    """(``read()``, None), or (``otherwise``, why) where the storage cannot be reached."""
    try:
        return read(), None
    except StorageUnreachable as exc:
        return otherwise, str(exc)


def _by_item(memory: list[Source]) -> dict[str, list[Source]]:
    """Item -> the node-memory sources holding a version of it, in ``memory``'s order: each source's items read
    once, not once per item (a rank holds thousands of experts in as many pool regions: 4 s a restore at
    DeepSeek-V3's 58 x 256 experts with EP 2, when every item scanned every source)."""
    out: dict[str, list[Source]] = {}
    for source in memory:
        for item in source.items:
            out.setdefault(item, []).append(source)
    return out


class Loader:
    """Plans a restore from one checkpoint directory (and this rank's node memory): load steps 3-5.

    The engine calls ``candidates`` once per load, then ``plan`` until a plan sticks, excluding each
    iteration some rank could not restore (``Restore.run``, the one fallback loop). Both are collective
    (every rank calls them, in the same order); they read and verify bytes, log what they find, and
    change nothing outside this object: no file is written or removed, no configuration changed."""

    def __init__(self, ctx: LoadContext, directory: CheckpointDir, checked_after_copy: bool = False,
                 summed_by_copy: bool = False, read_later: bool = False):
        """``checked_after_copy``: node memory's bytes are verified by the restore where they land (once on
        the device, or by the host copy that sums them: ``summed_by_copy``, the plan then names each slice's
        place in its item), not here before. ``read_later``: a rank file planned whole is read by the
        restore, straight into the tensors it restores, and checked as it is read (``RestoreDecision.reads``);
        here only its header is read and checked."""
        self.ctx, self.directory, self.root = ctx, directory, directory.root
        self.checked_after_copy, self.summed_by_copy = checked_after_copy, summed_by_copy
        self.read_later = read_later
        self.storage = directory.storage
        self.rank = ctx.rank
        self.coll = ctx.collectives
        self.names = [item_name(x) for x in ctx.all_experts]  # the vectors' index space, spelled once
        self.held = [item_name(x) for x in ctx.experts_held]

    # ---- 3. list: what this rank can read --------------------------------------------------------------
    def candidates(self) -> Candidates:
        """This rank's node-memory snapshots and the committed iterations of this configuration; or, when
        the newest committed iteration was saved by another layout and no rank has node memory, that one
        to reshard (deciding so is the one collective here). Storage that cannot be reached (an outage)
        leaves node memory alone to list."""
        ctx, phases = self.ctx, self.ctx.phases
        error, memory, stored, manifests = None, [], {}, {}
        with phases("listing sources"):
            try:
                memory = memory_sources(ctx.job.node_dir, self.rank,
                                        JobKey(ctx.config.job_id, ctx.job.fingerprint, self.root), ctx.slots,
                                        self.checked_after_copy)
            except SourceError as exc:
                error = str(exc)
            newest, unreachable = _unless_unreachable(lambda: _newest_committed(self.directory))
        other = newest if newest is not None and newest.fingerprint != ctx.job.fingerprint else None
        if other is not None and self.coll.all_ok(error is None and not memory):
            return Candidates(memory, {}, {}, reshard=other)
        with phases("listing sources"):
            if error is None and unreachable is None:
                known = {newest.iteration: newest} if newest else None
                try:
                    (stored, manifests), unreachable = _unless_unreachable(lambda: storage_sources(
                        self.directory, self.rank, ctx.job.fingerprint, ctx.job.topology, known), ({}, {}))
                except SourceError as exc:
                    error = str(exc)
            if unreachable is None:
                _unless_unreachable(lambda: _warn_stale_tracker(self.directory, self.rank, manifests))
            else:
                log.warning(f"the storage of {self.root} cannot be reached ({unreachable}): restoring from node "
                            "memory alone", rank=self.rank)
        return Candidates(memory, stored, manifests, error, unreachable=unreachable)

    # ---- 4. agree on an iteration ----------------------------------------------------------------------
    def plan(self, found: Candidates, excluded: set[int]) -> RestoreDecision | Refused | None:
        """What every rank restores from ``found``, read and verified: a ``RestoreDecision``; ``Refused`` when
        the ranks agreed on an iteration some rank cannot restore (the caller excludes it and asks again);
        None when there is nothing to restore. ``excluded``: iterations not to restore. Raises
        CheckpointError on every rank when a rank could not list its sources, or every candidate was
        excluded.

        First every rank plans its own newest iteration: the plan's all-reduce also says whether it is
        every rank's (usually), then that one collective is the whole agreement. Otherwise the ranks agree
        on the newest iteration they all have and plan that."""
        if found.reshard is not None:
            return self._reshard(found.reshard)
        mine = found.iterations - excluded
        target = max(mine) if mine and found.error is None else None
        prepared: list[tuple[dict, Prepared]] = []  # (plan, its decision's local part), made while the ranks vote
        plan, unreadable, agreed = self._plan(target, found, prepared)
        if not agreed.failed and not agreed.same_iteration:
            with self.ctx.phases("agreeing"):
                target = self._agree(mine)
            if target is None:
                return self._nothing(excluded, found)
            plan, unreadable, agreed = self._plan(target, found)
        if agreed.failed:
            raise CheckpointError(found.error or ANOTHER_RANK_FAILED)
        if not agreed.every_rank_can:
            return Refused(target, unreadable)
        for source in {id(s): s for s in plan.values() if s is not None}.values():
            source.fetch_ahead(self.storage)  # (the disk streams it while this rank decides and allocates)
        with self.ctx.phases("deciding"):
            return self._decide(target, plan, agreed, next((p for planned, p in prepared if planned is plan), None))

    def _nothing(self, excluded: set[int], found: Candidates) -> None:
        """Nothing every rank can restore: from scratch, unless a rank could not reach the storage (it may
        hold what node memory lacks: never train from scratch over it) or every candidate was excluded."""
        self.coll.raise_if_any(found.unreachable and (
            f"cannot restore: node memory holds no snapshot every rank can restore, and the storage of {self.root} "
            f"cannot be reached ({found.unreachable}); nothing was changed and training did not start from "
            "scratch: relaunch once the storage answers"))
        if excluded:
            raise CheckpointError(f"no valid checkpoint left under {self.root} after rejecting iterations "
                                  f"{sorted(excluded)}; see the messages above")
        log.info(f"no checkpoint found under {self.root}; training from scratch", rank0=True)
        return None

    def _agree(self, mine: set[int]) -> int | None:
        """The newest iteration every rank can restore (``mine``: this rank's, none excluded)."""
        mine = sorted(mine, reverse=True)[:MAX_CANDIDATES]
        every = self.coll.gather(mine, MAX_CANDIDATES)
        common = set.intersection(*({x for x in row if x >= 0} for row in every))
        return max(common) if common else None

    # ---- another layout -------------------------------------------------------------------------
    def _reshard(self, m: Manifest) -> RestoreDecision:
        """Iteration ``m`` onto this rank's slices from the files of another layout (``restore/reshard.py``)."""
        ctx, error, done = self.ctx, None, None
        where = f"checkpoint {self.root} iteration {m.iteration}"
        topology, layout = ctx.job.topology, ctx.job.layout
        why = reshard.refusal(m.topology, topology)
        if why is None and m.topology == topology:
            why = ("the same parallel sizes but a different model (its parameters or their layout differ): "
                   "restart with the model flags it was saved with")
        if why is None and (layout is None or layout.not_global):
            why = f"this run cannot place it: {layout.not_global if layout else 'no layout'}"
        if why is not None:
            error = f"{where} was saved with another configuration ({reshard.change(m.topology, topology)}): {why}"
        else:
            try:
                done = reshard.Resharder(self.directory, m, layout, self.rank, stage_experts(self.ctx)).restore()
            except (reshard.ReshardError, SourceError) as exc:
                error = f"cannot restore {where} onto this layout: {exc}"
        self.coll.raise_if_any(error)
        if done.pec is not None:
            choose_k(self.ctx.config, self.ctx.num_experts, done.pec)
        return RestoreDecision(m.iteration, f"storage (resharded: {reshard.change(m.topology, topology)})",
                               done.versions, done.tensors, done.small, done.pec, done.tokens_at_target, done.report,
                           resharded=True)

    # ---- 4. ... and read it: each item's source, opened and verified -----------------------------------
    def _plan(self, target: int | None, found: Candidates,
              prepared: list | None = None) -> tuple[dict, str | None, Agreement]:
        """Sources for T's non-expert state and each held expert's version, agreed across ranks, opened
        and verified: (plan, this rank's error, the ``Agreement``). ``target``: the iteration this rank
        plans (None: none); ``found.error``: this rank could not list its sources (all ranks raise).
        ``prepared``: where the decision's local part for this rank's first plan goes, made while the ranks
        vote on it: (that plan, its ``Prepared``).

        Optimistic: each rank first plans the newest version of each expert it can read itself; the
        all-reduce that agrees on the plan also says whether every rank holding an expert planned
        the same version of it, which is the usual case. Only where they differ is the plan redone
        from the agreed (oldest) versions: two more all-reduces."""
        phases, memory, stored, manifests = self.ctx.phases, found.memory, found.stored, found.manifests
        newest = max(found.iterations, default=-1)
        if target is None or found.error is not None:
            plan, error = {NON_EXPERT: None}, found.error or "no checkpoint to restore"
            with phases("agreeing"):
                # (``planned={}``: the same vote as a rank that planned, so the all-reduce's sizes match)
                return plan, error, self._vote(target, plan, error, newest, planned={}, failed=found.error is not None)
        with phases("reading and checking"):
            dense, dense_error = self._dense_source(target, memory, stored)
        manifest_t = manifests.get(max((i for i in manifests if i <= target), default=None))
        holding = _by_item(memory)
        planned = {item: self._newest_version(item, target, holding.get(item, ()), manifest_t) for item in self.held}
        plan = self._sources(dense, planned, holding, stored, manifest_t)
        with phases("reading and checking"):
            error = self._open(plan, target, dense_error)
        meanwhile = None
        if prepared is not None and error is None:
            first = plan
            meanwhile = lambda: self._prepare_meanwhile(first, prepared)
        with phases("agreeing"):
            agreed = self._vote(target, plan, error, newest, planned=planned, meanwhile=meanwhile)
        if agreed.versions is None:
            return plan, error, agreed
        # Ranks planned different versions: every rank takes the oldest planned; where some rank lacks
        # it, everyone takes the persisted one (shared storage).
        plan = self._sources(dense, agreed.versions, holding, stored, manifest_t)
        with phases("agreeing"):
            retry = self._any_rank([plan[i] is None for i in self.held])
        for item, redo in zip(self.held, retry):
            if redo:
                version = manifest_t.experts.get(item) if manifest_t else None
                plan[item] = None if version is None else \
                    expert_source_for(item, version, [], stored, self.directory, self.rank, manifest_t)
        with phases("reading and checking"):
            error = self._open(plan, target, dense_error)
        with phases("agreeing"):
            return plan, error, self._vote(target, plan, error, newest)

    @staticmethod
    def _newest_version(item: str, target: int, memory: Sequence[Source], manifest_t: Manifest | None) -> int | None:
        """The newest version of ``item`` at or before ``target`` this rank can read (``memory``: the node-memory
        sources holding ``item``)."""
        versions = [s.items[item] for s in memory if s.items[item] <= target]
        if manifest_t is not None and item in manifest_t.experts:
            versions.append(manifest_t.experts[item])
        return max(versions, default=None)

    def _sources(self, dense: Source | None, versions: dict[str, int | None], holding: dict[str, list[Source]],
                 stored: dict[int, Source], manifest_t: Manifest | None) -> dict[str, Source | None]:
        """The dense source and, per held expert, a source of the given version (None: none here);
        ``holding``: ``_by_item``'s."""
        plan = {NON_EXPERT: dense}
        for item, version in versions.items():
            plan[item] = expert_source_for(item, version, holding.get(item, ()), stored, self.directory, self.rank,
                                           manifest_t) if version is not None else None
        return plan

    def _open(self, plan: dict[str, Source | None], target: int, error: str | None) -> str | None:
        """Open each source of ``plan`` once, for just its items: the first error, if any."""
        reads: dict[int, tuple[Source, set[str]]] = {}
        for item, source in plan.items():
            if error is None and source is None:
                error = f"no saved version of {item} at or before iteration {target}"
            if source is not None:
                reads.setdefault(id(source), (source, set()))[1].add(item)
        for source, items in reads.values():
            if error is None:
                try:
                    source.open(self.storage, items)
                except SourceError as exc:
                    error = str(exc)
        return error

    def _vote(self, target: int | None, plan: dict[str, Source | None], error: str | None, newest: int,
              planned: dict | None = None, failed: bool = False, meanwhile=None) -> Agreement:
        """The ``Agreement`` on this rank's plan for ``target``: one MAX all-reduce of every rank's
        ``DecisionVote`` (a rank that cannot contributes only its flags; ``newest``: the newest iteration it has
        a source of).

        With ``planned`` (the version this rank planned per held expert) the vote also carries which
        versions each expert was planned at; unless all agree, ``versions`` is then, per held expert,
        the newest version every rank holding it can restore (the lowest planned), and the plans are
        redone from it whatever their errors were (a rank may have failed only for lack of the newer
        version). ``meanwhile()``: called while the all-reduce runs (its wait is mostly the other ranks')."""
        n = len(self.names)
        state = PecState.loads(plan[NON_EXPERT].header.pec) if error is None and n else None
        accounting = accounting_columns(plan, state, self.names) if state is not None else [[-1] * n] * ACCOUNT_VECTORS
        iteration = -1 if target is None else target
        versions = [None] * 3
        if planned is not None:
            known = {i: (-1 if v is None else v) for i, v in planned.items()}
            versions = [self._expert_vector(known, -2), self._expert_vector(known, NONE),
                        self._expert_vector({i: int(plan[i] is None and v is not None) for i, v in planned.items()}, 0)]
        mine = DecisionVote(int(failed), int(error is not None), iteration, iteration, newest, accounting, *versions)
        voting = reduced_record.start_all_reduce(mine, n, lambda values: self.coll.start_reduce(values, "max"))
        if meanwhile is not None:
            meanwhile()
        every = voting.result()
        same_iteration = every.iteration == every.lowest_iteration >= 0
        agreed = Agreement(bool(every.failed), same_iteration, same_iteration and not every.cannot,
                           every.accounting, state, every.newest)
        if planned is None or not same_iteration:
            return agreed
        if not any(every.lacking) and all(lo == NONE or lo == hi for hi, lo in zip(every.high, every.low)):
            return agreed
        versions = {name: (v if 0 <= v < NONE else None) for name, v in zip(self.names, every.low)
                    if name in planned}
        return replace(agreed, versions=versions)

    def _dense_source(self, target: int, memory: list[Source], stored: dict[int, Source]):
        candidates = [s for s in memory if s.iteration == target] + ([stored[target]] if target in stored else [])
        problems = []
        for source in candidates:
            try:
                source.open(self.storage, read_later=self.read_later and source.kind == "storage")
                return source, None
            except SourceError as exc:
                problems.append(str(exc))
                log.warning(str(exc), rank=self.rank)
        return None, "; ".join(problems) or f"iteration {target} is not available to rank {self.rank}"

    def _expert_vector(self, values: dict[str, int], absent: int) -> list[int]:
        """One int per expert of the model (``absent`` where this rank has no value)."""
        return [values.get(name, absent) for name in self.names]

    def _any_rank(self, flags: list[bool]) -> list[bool]:
        """Per held expert: whether any rank holding it raised its flag (one MAX all-reduce)."""
        merged = self.coll.reduce(self._expert_vector(dict(zip(self.held, map(int, flags))), 0), "max")
        position = {name: i for i, name in enumerate(self.names)}
        return [bool(merged[position[n]]) for n in self.held]

    # ---- 5. decide -------------------------------------------------------------------------------------
    def _decide(self, target: int, plan: dict[str, Source], agreed: Agreement, prepared: "Prepared | None" = None):
        """``plan``'s ``RestoreDecision``: its local part (``prepared`` during the vote, else now) and the PLT."""
        p = prepared or self._prepare(plan)
        pec, report, tokens_at_target = account(self.ctx, target, agreed.state, agreed.accounted)
        return RestoreDecision(target, plan[NON_EXPERT].described, p.versions, p.tensors, p.small, pec,
                               tokens_at_target, report, check_after_copy=p.after_copy, newest=agreed.newest,
                               places=p.places, reads=p.reads)

    def _prepare(self, plan: dict[str, Source]) -> "Prepared":
        return prepare(plan, self.ctx.slice_items, self.summed_by_copy)

    def _prepare_meanwhile(self, plan: dict[str, Source], prepared: list) -> None:
        """``_prepare`` while the ranks vote on ``plan``, kept in ``prepared`` if it worked (a failure is raised
        after the vote, by ``_decide`` preparing anew: a rank raising before it would hang the others)."""
        with self.ctx.phases("deciding"):
            try:
                prepared.append((plan, self._prepare(plan)))
            except Exception:  # (raised again, after the vote, where it is made anew)
                pass


def prepare(plan: dict[str, Source], slice_items: dict[str, str], summed_by_copy: bool) -> Prepared:
    """What deciding on ``plan`` takes of this rank alone (``slice_items``: slice name -> its item): the tensors
    per slice (or the rank files to read them from), the versions, what is checked where it lands, the small
    state. ``summed_by_copy``: node memory's items are checked by the host copy that sums them (their places)."""
    by_source: dict[int, tuple[Source, set[str]]] = {}
    for name, item in slice_items.items():
        by_source.setdefault(id(plan[item]), (plan[item], set()))[1].add(name)
    tensors, places, reads = {}, {}, []
    for source, names in by_source.values():
        if source.read_later:
            reads.append((source, names))
            continue
        tensors.update(source.tensors(names))
        if summed_by_copy and source.kind == "memory" and source.checked_after_copy:
            places.update(source.item_offsets(names))
    versions = {item: source.items[item] for item, source in plan.items()}
    after_copy = {item: (source.item_checks[item], source.where) for item, source in plan.items()
                  if _checked_where_it_lands(item, source, summed_by_copy)}
    return Prepared(tensors, places, reads, versions, after_copy, SmallState.loads(plan[NON_EXPERT].header.small))


def _checked_where_it_lands(item: str, source: Source, summed_by_copy: bool) -> bool:
    """Whether the restore checks ``item`` where it lands: node memory's items checked after the copy, and on a
    device the items of a rank file it reads there (beside the file's CRC-32: the copy to the device checked too,
    where the file records the item's sum64)."""
    if source.kind == "memory":
        return source.checked_after_copy
    return source.read_later and not summed_by_copy and is_sum64(source.item_checks.get(item))
