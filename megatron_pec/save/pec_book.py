"""The trainer's PEC bookkeeping from save to save: cumulative token counts, each level's expert
versions and K, and which experts the next save writes.

One per trainer (the engine's). Identical on every rank: it changes only through the save's
agreement (all-reduced token counts) and the deterministic policies, so every rank plans the same
experts without further coordination.
"""

from __future__ import annotations

import numpy
import torch

from megatron_pec.common import log
from megatron_pec.config import PecConfig
from megatron_pec.job_facts import JobFacts
from megatron_pec.pec import policy
from megatron_pec.pec.expert_values import ExpertValues
from megatron_pec.pec.state import Level, PecState, flag_k


class PecBook:
    def __init__(self, config: PecConfig, job: JobFacts):
        self.config, self.job = config, job
        order = job.order
        self.cumulative = ExpertValues(order, numpy.zeros(len(order), dtype=numpy.int64)) if order \
            else ExpertValues()
        self.state = self.initial_state()
        # Restored from another layout or Megatron's own format: no older file of this layout holds
        # this rank's experts, so saves write every expert until a persistent one has.
        self.rewrite_all = False
        self.max_k: int | None = None  # the snapshot K node memory holds (a budget's), if less than all
        self._changes = 0  # counts what may change a plan: recorded saves, restores, K's limits
        self._ahead: tuple | None = None  # (``_changes``, persistent, plan): the next save's, made ahead

    def limit_k(self, k: int) -> None:
        """Node memory holds snapshots of at most ``k`` experts per layer (identical on every rank)."""
        self._changes += 1
        layout = self.job.expert_layout
        self.max_k = k if layout is not None and k < layout.num_experts else None
        self._clamp()

    def _clamp(self) -> None:
        # Only the snapshot K: a persistent save keeps the asked persist-K (every expert at K = all), whatever
        # node memory takes at once - it goes through the spares in rounds (``save.Save.write_in_rounds``).
        if self.max_k is not None and self.state.snapshot.k > self.max_k:
            self.state.set_k(self.max_k, self.state.persist.k)

    def initial_state(self) -> PecState:
        """K from the flags (capped at the experts per layer), nothing saved yet."""
        n = self.job.expert_layout.num_experts if self.job.expert_layout else 1
        snap_k, persist_k = flag_k(self.config.snapshot_k, self.config.persist_k, n)
        if self.config.snapshot_k and self.config.snapshot_k > n:
            log.warning(f"--pec-snapshot-k {self.config.snapshot_k} exceeds the {n} experts per layer; saving all "
                        "of them", rank0=True, once=True)
        state = PecState(Level(snap_k), Level(persist_k))
        return state.laid_out(self.job.order) if self.job.order else state

    # ---- a save ------------------------------------------------------------------------------------
    @property
    def plans_without_counts(self) -> bool:
        """The next plan reads no token counts (sequential): it may be made before the agreement."""
        return self.config.selection in policy.TOKEN_BLIND

    def agreement_values(self, tokens: torch.Tensor, can_snapshot: bool, capacity: int) -> torch.Tensor:
        """This rank's part of the save's one all-reduce (a SUM): its token counts since the last save
        at their places among all the model's experts, 1 if it cannot snapshot, and at its rank's place
        the experts its node memory can take now (``capacity``)."""
        n, job = len(self.job.all_experts), self.job
        values = torch.zeros(n + 1 + job.world_size, dtype=torch.int64)
        values[job.token_positions] = tokens.reshape(-1)
        values[n] = 0 if can_snapshot else 1
        values[n + 1 + job.rank] = capacity
        return values

    def agreed(self, totals: torch.Tensor) -> tuple[bool, list[int]]:
        """Take the summed values in: (whether every rank can snapshot, the experts each EP rank of this
        stage can take now: the least any of its ranks can)."""
        n = len(self.job.all_experts)
        self.cumulative.add((totals[self.job.token_positions] // self.job.token_replicas).numpy())
        capacity = totals[n + 1:].tolist()
        caps = [min((capacity[r] for r in group), default=0) for group in self.job.ep_groups]
        return int(totals[n]) == 0, caps

    def within(self, experts: tuple[frozenset, frozenset], caps: dict[int, int]) -> tuple[frozenset, frozenset]:
        """(snapshot, persist) experts with no EP rank beyond its cap in ``caps`` (EP rank -> experts its
        node memory can take now): where one is, the experts it drops are those not persisted first, then
        the most recently saved (the same choice on every rank). A smaller cap drops more of the same."""
        snapshot, persist = experts
        layout = self.job.expert_layout
        if layout is None or not caps:
            return experts
        per_rank = layout.num_experts // layout.ep_size
        by_rank: dict[int, list] = {}
        for e in snapshot:
            by_rank.setdefault(e.expert // per_rank, []).append(e)
        dropped = set()
        saved = self.state.snapshot.saved_at
        for rank, cap in caps.items():
            mine = by_rank.get(rank, [])
            if len(mine) <= cap:
                continue
            order = sorted(mine, key=lambda e: (e in persist, -saved.get(e, -1), -layout._index[e]))
            dropped.update(order[:len(mine) - max(cap, 0)])
        if not dropped:
            return experts
        return snapshot - dropped, persist - dropped

    def plan(self, persistent: bool) -> tuple[frozenset, frozenset]:
        """(experts to snapshot, the subset to persist); changes nothing (the save may be skipped). The plan
        made ahead for this very state (``plan_ahead``) where there is one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (self._changes, persistent):
            return ahead[2]
        return self._plan(persistent)

    def plan_ahead(self, persistent: bool) -> None:
        """Plan the next save now, taking it to be of the kind of the last (``persistent``: a snapshot every
        iteration plans memory-only ones; a save of the other kind plans itself), on the hand-over thread
        once a save is recorded: off the training thread's next save. Only where the policy reads no token
        counts: then the plan depends on nothing but what ``_changes`` counts."""
        if not self.plans_without_counts or self.job.expert_layout is None:
            return
        try:
            self._ahead = (self._changes, persistent, self._plan(persistent))
        except Exception:  # (only a head start: the save that needs the plan makes it, and raises there)
            self._ahead = None

    def _plan(self, persistent: bool) -> tuple[frozenset, frozenset]:
        layout = self.job.expert_layout
        if layout is None:
            return frozenset(), frozenset()
        if self.rewrite_all:
            every = frozenset(layout.all_experts())
            return every, every if persistent else frozenset()
        budget = None if self.config.budget_mb is None else int(self.config.budget_mb * 2**20)
        return self.state.plan(self.config.selection, layout, self.cumulative, persistent, budget)

    def record(self, snapshot: frozenset, persist: frozenset, iteration: int, persistent: bool) -> None:
        """The save happened: its experts are now at ``iteration`` on their levels."""
        self._changes += 1
        self.state.snapshot.record(snapshot, iteration, self.cumulative)
        if persistent:
            self.state.persist.record(persist, iteration, self.cumulative)
            layout = self.job.expert_layout
            if layout is None or len(persist) == len(layout.all_experts()):
                self.rewrite_all = False  # (node memory may have held fewer: the next saves write the rest)

    def header_columns(self) -> tuple[object, object]:
        """(the held experts' cumulative token counts, the PEC state): what a slot header records."""
        held = self.job.held
        return (held.column(self.cumulative) if held else {}), self.state.dumps(held)

    # ---- a restore ---------------------------------------------------------------------------------
    def adopt(self, state: PecState | None, tokens_at_target: dict, resharded: bool) -> None:
        """Continue from a restored PEC state (None: none was saved) and its token counts."""
        self._changes += 1
        self.rewrite_all = resharded
        if state is None:
            return
        order = self.job.order
        self.state = state.laid_out(order) if order else state
        self._clamp()
        if order:
            self.cumulative.update({x: v for x, v in tokens_at_target.items() if x in order.index})

    def adopted_megatron(self) -> None:
        """Megatron's own loader restored the state: the next persistent save writes every expert."""
        self._changes += 1
        self.rewrite_all = True
