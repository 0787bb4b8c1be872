"""PEC bookkeeping kept by every rank and stored in every checkpoint: expert versions per
level, cumulative token counts at those versions, current K, and the lost work so far.

Identical on every rank (it is driven only by all-reduced token counts and the
deterministic policies), so each rank can plan a save without coordination. A rank's
file stores the per-expert part only for the experts it holds (the header grows with
the rank's share of the model, not with the whole model); a restore merges the ranks'
parts back into the full state (``Loader``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy

from megatron_pec.format.item_names import ExpertId, parse_item
from megatron_pec.format.json_text import Quoted
from megatron_pec.format.packed_column import ABSENT, PackedColumn
from megatron_pec.pec import lost_tokens as lost
from megatron_pec.pec import policy
from megatron_pec.pec.expert_values import ExpertOrder, ExpertValues, HeldExperts, values_in


def flag_k(snapshot_k: int | None, persist_k: int | None, num_experts: int) -> tuple[int, int]:
    """(snapshot K, persist K) the flags ask for (None: every expert), capped at the experts per layer;
    persist K never exceeds snapshot K."""
    snap = min(snapshot_k or num_experts, num_experts)
    return snap, min(persist_k or snap, snap)


@dataclass
class Level:
    """One checkpoint level (snapshot in memory, or persist to storage)."""

    k: int
    saved_at: ExpertValues = field(default_factory=ExpertValues)   # iteration of the last saved version
    tokens_at: ExpertValues = field(default_factory=ExpertValues)  # cumulative tokens at that version
    checkpoints: int = 0

    def __post_init__(self) -> None:
        for name in ("saved_at", "tokens_at"):  # (a dict from a caller, e.g. a test)
            if not isinstance(getattr(self, name), ExpertValues):
                setattr(self, name, ExpertValues.of(getattr(self, name)))

    def input(self, layout: policy.ExpertGrid, cumulative, budget: int | None,
              candidates=None, tokens: bool = True) -> policy.SelectionInput:
        """``tokens=False``: without the unsaved token counts, for a policy that never reads them."""
        unsaved = ExpertValues()
        if tokens:  # (whole arrays: 15k experts at scale)
            order = layout.order
            unsaved = ExpertValues(order, values_in(cumulative, order, 0) - values_in(self.tokens_at, order, 0))
        return policy.SelectionInput(layout=layout, k=self.k, unsaved_tokens=unsaved, last_saved=self.saved_at,
                                     checkpoint_index=self.checkpoints, budget_bytes=budget, candidates=candidates)

    def record(self, experts, iteration: int, cumulative) -> None:
        """``experts`` were saved at ``iteration``, with ``cumulative`` tokens (missing: 0)."""
        experts = list(experts)
        at = self.saved_at.order
        if self.tokens_at.order is at and all(map(at.index.__contains__, experts)):  # (K experts, not 15k)
            where = at.positions(experts)
            self.saved_at.array[where] = iteration
            self.tokens_at.array[where] = numpy.maximum(values_in(cumulative, at, ABSENT)[where], 0)
        else:
            self.saved_at.update(dict.fromkeys(experts, iteration))
            self.tokens_at.update({e: cumulative.get(e, 0) for e in experts})
        self.checkpoints += 1

    def laid_out(self, order: ExpertOrder) -> "Level":
        """This level with its per-expert values laid out in ``order`` (what a save's arrays need)."""
        return Level(self.k, ExpertValues.of(self.saved_at, order), ExpertValues.of(self.tokens_at, order),
                     self.checkpoints)

    def json_parts(self, held: HeldExperts) -> list[tuple[str, bool]]:
        """The level as JSON with the ``held`` experts' values packed (see ``packed_column.PackedColumn``), in
        ``Quoted.join``'s parts."""
        return [(f'{{"k":{json.dumps(self.k)},"checkpoints":{json.dumps(self.checkpoints)},"saved_at":"', False),
                (held.column(self.saved_at).encoded()["values"], True), ('","tokens_at":"', False),
                (held.column(self.tokens_at).encoded()["values"], True), ('"}', False)]

    @classmethod
    def from_json(cls, data: dict, experts: str | None) -> "Level":
        """``experts``: the names the packed values belong to (None: a file whose values are JSON objects)."""
        columns = [data[name] if experts is None else PackedColumn.decoded({"experts": experts, "values": data[name]})
                   for name in ("saved_at", "tokens_at")]
        saved_at, tokens_at = ({parse_item(k): v for k, v in column.items()} for column in columns)
        return cls(k=data["k"], checkpoints=data["checkpoints"], saved_at=saved_at, tokens_at=tokens_at)


@dataclass
class PecState:
    snapshot: Level
    persist: Level
    lost_tokens: int = 0
    plt: float = 0.0
    recoveries: int = 0

    def plan(self, selection: str, layout: policy.ExpertGrid, cumulative: dict[ExpertId, int],
             persist: bool, budget_bytes: int | None) -> tuple[frozenset, frozenset]:
        """Experts to snapshot, and the subset to persist (empty when this save is memory-only)."""
        if budget_bytes is None and min(self.snapshot.k, self.persist.k if persist else self.snapshot.k) \
                >= layout.num_experts:  # every expert, whatever the policy (what each of them picks then)
            every = frozenset(layout.all_experts())
            return every, every if persist else frozenset()
        tokens = selection not in policy.TOKEN_BLIND  # (15k experts at scale: not counted when unread)
        snap_in = self.snapshot.input(layout, cumulative, budget_bytes, tokens=tokens)
        if not persist:
            return policy.select_experts(selection, snap_in), frozenset()
        persist_budget = None if budget_bytes is None else budget_bytes * self.persist.k // max(1, self.snapshot.k)
        return policy.select_two_level(selection, snap_in,
                                       self.persist.input(layout, cumulative, persist_budget, tokens=tokens))

    def recovered(self, report: lost.PltReport, version_of: dict[ExpertId, int],
                  tokens_at_version: dict[ExpertId, int], restored: set[ExpertId]) -> None:
        """Fold one restore in: its lost tokens, and the ``restored`` experts' snapshot level now
        holds exactly the versions that were restored."""
        self.lost_tokens, self.plt = lost.accumulate(self.lost_tokens, report)
        self.recoveries += 1
        self.snapshot.saved_at.update({x: version_of[x] for x in restored})  # (one update: 15k experts)
        self.snapshot.tokens_at.update({x: tokens_at_version[x] for x in restored})

    def set_k(self, snapshot_k: int, persist_k: int) -> None:
        self.snapshot.k, self.persist.k = snapshot_k, persist_k

    def laid_out(self, order: ExpertOrder) -> "PecState":
        return replace(self, snapshot=self.snapshot.laid_out(order), persist=self.persist.laid_out(order))

    def dumps(self, held: HeldExperts | None = None) -> Quoted:
        """``held``: the experts whose versions to include (None: every expert either level has).
        Built from parts, not by ``json.dumps``: its long parts (names, base64) are never escaped."""
        if held is None:
            experts = sorted(set(self.snapshot.saved_at) | set(self.snapshot.tokens_at) | set(self.persist.saved_at)
                             | set(self.persist.tokens_at))
            held = HeldExperts(experts, ExpertOrder(experts))
        totals = (f',"lost_tokens":{json.dumps(self.lost_tokens)},"plt":{json.dumps(self.plt)},'
                  f'"recoveries":{json.dumps(self.recoveries)}}}')
        return Quoted.join([('{"experts":"', False), (held.names_text, True), ('","snapshot":', False),
                            *self.snapshot.json_parts(held), (',"persist":', False), *self.persist.json_parts(held),
                            (totals, False)])

    @classmethod
    def loads(cls, text: str) -> "PecState":
        """Raises ValueError (or KeyError, TypeError) for a malformed text."""
        d = json.loads(text)
        experts = d.get("experts")  # (absent: written before the values were packed, as JSON objects)
        return cls(Level.from_json(d["snapshot"], experts), Level.from_json(d["persist"], experts),
                   d["lost_tokens"], d["plt"], d["recoveries"])
