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
from dataclasses import dataclass, field

from megatron_pec import plt as lost, policy
from megatron_pec.items import ExpertId, item_name, parse_item


@dataclass
class Level:
    """One checkpoint level (snapshot in memory, or persist to storage)."""

    k: int
    saved_at: dict[ExpertId, int] = field(default_factory=dict)      # iteration of the last saved version
    tokens_at: dict[ExpertId, int] = field(default_factory=dict)     # cumulative tokens at that version
    checkpoints: int = 0

    def input(self, layout: policy.ExpertLayout, cumulative: dict[ExpertId, int], budget: int | None,
              candidates=None) -> policy.SelectionInput:
        unsaved = {e: cumulative.get(e, 0) - self.tokens_at.get(e, 0) for e in layout.all_experts()}
        return policy.SelectionInput(layout=layout, k=self.k, unsaved_tokens=unsaved, last_saved=self.saved_at,
                                     checkpoint_index=self.checkpoints, budget_bytes=budget, candidates=candidates)

    def record(self, experts, iteration: int, cumulative: dict[ExpertId, int]) -> None:
        for e in experts:
            self.saved_at[e] = iteration
            self.tokens_at[e] = cumulative.get(e, 0)
        self.checkpoints += 1

    def to_json(self, names: dict[ExpertId, str] | None = None) -> dict:
        """``names``: the experts to include, with their item names (None: every expert)."""
        if names is None:
            names = {e: item_name(e) for e in self.saved_at.keys() | self.tokens_at.keys()}
        return {"k": self.k, "checkpoints": self.checkpoints,
                "saved_at": {n: self.saved_at[e] for e, n in names.items() if e in self.saved_at},
                "tokens_at": {n: self.tokens_at[e] for e, n in names.items() if e in self.tokens_at}}

    @classmethod
    def from_json(cls, data: dict) -> "Level":
        return cls(k=data["k"], checkpoints=data["checkpoints"],
                   saved_at={parse_item(k): v for k, v in data["saved_at"].items()},
                   tokens_at={parse_item(k): v for k, v in data["tokens_at"].items()})


@dataclass
class PecState:
    snapshot: Level
    persist: Level
    lost_tokens: int = 0
    plt: float = 0.0
    recoveries: int = 0

    def plan(self, selection: str, layout: policy.ExpertLayout, cumulative: dict[ExpertId, int],
             persist: bool, budget_bytes: int | None) -> tuple[frozenset, frozenset]:
        """Experts to snapshot, and the subset to persist (empty when this save is memory-only)."""
        snap_in = self.snapshot.input(layout, cumulative, budget_bytes)
        if not persist:
            return policy.select_experts(selection, snap_in), frozenset()
        persist_budget = None if budget_bytes is None else budget_bytes * self.persist.k // max(1, self.snapshot.k)
        return policy.select_two_level(selection, snap_in, self.persist.input(layout, cumulative, persist_budget))

    def recovered(self, report: lost.PltReport, version_of: dict[ExpertId, int],
                  tokens_at_version: dict[ExpertId, int], restored: set[ExpertId]) -> None:
        """Fold one restore in: its lost tokens, and the ``restored`` experts' snapshot level now
        holds exactly the versions that were restored."""
        self.lost_tokens, self.plt = lost.accumulate(self.lost_tokens, report)
        self.recoveries += 1
        for x in restored:
            self.snapshot.saved_at[x], self.snapshot.tokens_at[x] = version_of[x], tokens_at_version[x]

    def set_k(self, snapshot_k: int, persist_k: int) -> None:
        self.snapshot.k, self.persist.k = snapshot_k, persist_k

    def dumps(self, names: dict[ExpertId, str] | None = None) -> str:
        """``names``: the experts whose versions to include, with their item names (None: all)."""
        return json.dumps({"snapshot": self.snapshot.to_json(names), "persist": self.persist.to_json(names),
                           "lost_tokens": self.lost_tokens, "plt": self.plt, "recoveries": self.recoveries},
                          separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "PecState":
        d = json.loads(text)
        return cls(Level.from_json(d["snapshot"]), Level.from_json(d["persist"]), d["lost_tokens"], d["plt"],
                   d["recoveries"])
