"""The trainer's PEC bookkeeping from save to save: cumulative token counts, each level's expert
versions and K, and which experts the next save writes.

One per trainer (the engine's). Identical on every rank: it changes only through the save's
agreement (all-reduced token counts) and the deterministic policies, so every rank plans the same
experts without further coordination.
"""

from __future__ import annotations

import numpy
import torch

from megatron_pec import log, policy
from megatron_pec.config import PecConfig
from megatron_pec.expert_values import ExpertValues
from megatron_pec.job import JobFacts
from megatron_pec.pec_state import Level, PecState, flag_k


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

    def agreement_values(self, tokens: torch.Tensor, can_snapshot: bool) -> torch.Tensor:
        """This rank's part of the save's one all-reduce (a SUM): its token counts since the last save
        at their places among all the model's experts, and 1 if it cannot snapshot."""
        n = len(self.job.all_experts)
        values = torch.zeros(n + 1, dtype=torch.int64)
        values[self.job.token_positions] = tokens.reshape(-1)
        values[n] = 0 if can_snapshot else 1
        return values

    def agreed(self, totals: torch.Tensor) -> bool:
        """Take the summed values in; whether every rank can snapshot."""
        self.cumulative.add((totals[self.job.token_positions] // self.job.token_replicas).numpy())
        return int(totals[-1]) == 0

    def plan(self, persistent: bool) -> tuple[frozenset, frozenset]:
        """(experts to snapshot, the subset to persist); changes nothing (the save may be skipped)."""
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
        self.state.snapshot.record(snapshot, iteration, self.cumulative)
        if persistent:
            self.state.persist.record(persist, iteration, self.cumulative)
            self.rewrite_all = False

    def header_columns(self) -> tuple[object, object]:
        """(the held experts' cumulative token counts, the PEC state): what a slot header records."""
        held = self.job.held
        return (held.column(self.cumulative) if held else {}), self.state.dumps(held)

    # ---- a restore ---------------------------------------------------------------------------------
    def adopt(self, state: PecState | None, tokens_at_target: dict, resharded: bool) -> None:
        """Continue from a restored PEC state (None: none was saved) and its token counts."""
        self.rewrite_all = resharded
        if state is None:
            return
        order = self.job.order
        self.state = state.laid_out(order) if order else state
        if order:
            self.cumulative.update({x: v for x, v in tokens_at_target.items() if x in order.index})

    def adopted_megatron(self) -> None:
        """Megatron's own loader restored the state: the next persistent save writes every expert."""
        self.rewrite_all = True
