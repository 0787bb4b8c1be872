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
import operator
from dataclasses import dataclass, field
from itertools import repeat

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
              candidates=None, tokens: bool = True) -> policy.SelectionInput:
        """``tokens=False``: without the unsaved token counts, for a policy that never reads them."""
        experts = layout.all_experts()  # (map and zip: no Python call per expert, 15k of them at scale)
        unsaved = dict(zip(experts, map(operator.sub, map(cumulative.get, experts, repeat(0)),
                                        map(self.tokens_at.get, experts, repeat(0))))) if tokens else {}
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

    def json_text(self, names: "ExpertNames") -> str:
        """``json.dumps(self.to_json(names.names), separators=(",", ":"))``, at every save."""
        return (f'{{"k":{json.dumps(self.k)},"checkpoints":{json.dumps(self.checkpoints)},'
                f'"saved_at":{names.object_text(self.saved_at)},"tokens_at":{names.object_text(self.tokens_at)}}}')

    @classmethod
    def from_json(cls, data: dict) -> "Level":
        return cls(k=data["k"], checkpoints=data["checkpoints"],
                   saved_at={parse_item(k): v for k, v in data["saved_at"].items()},
                   tokens_at={parse_item(k): v for k, v in data["tokens_at"].items()})


class ExpertNames:
    """The experts whose versions a rank's checkpoint stores, with their item names: encodes a level's
    per-expert values as the JSON object ``json.dumps`` writes, without a Python call per expert
    (a save at scale writes 4 x 7k of them; the names' JSON is built once)."""

    def __init__(self, names: dict[ExpertId, str]):
        self.names = names
        self._experts = tuple(names)
        self._keys = tuple(json.dumps(name) + ":" for name in names.values())

    def object_text(self, values: dict[ExpertId, int]) -> str:
        """``{name: values[expert]}`` as compact JSON, for the experts that have a value."""
        if all(map(values.__contains__, self._experts)):  # (values are ints: iterations and token counts)
            encoded = map(str, map(values.__getitem__, self._experts))
            return "{" + ",".join(map(operator.add, self._keys, encoded)) + "}"
        return json.dumps({n: values[e] for e, n in self.names.items() if e in values}, separators=(",", ":"))


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
        for x in restored:
            self.snapshot.saved_at[x], self.snapshot.tokens_at[x] = version_of[x], tokens_at_version[x]

    def set_k(self, snapshot_k: int, persist_k: int) -> None:
        self.snapshot.k, self.persist.k = snapshot_k, persist_k

    def dumps(self, names: ExpertNames | dict[ExpertId, str] | None = None) -> str:
        """``names``: the experts whose versions to include, with their item names (None: all)."""
        if not isinstance(names, ExpertNames):
            return json.dumps({"snapshot": self.snapshot.to_json(names), "persist": self.persist.to_json(names),
                               "lost_tokens": self.lost_tokens, "plt": self.plt, "recoveries": self.recoveries},
                              separators=(",", ":"))
        return (f'{{"snapshot":{self.snapshot.json_text(names)},"persist":{self.persist.json_text(names)},'
                f'"lost_tokens":{json.dumps(self.lost_tokens)},"plt":{json.dumps(self.plt)},'
                f'"recoveries":{json.dumps(self.recoveries)}}}')

    @classmethod
    def loads(cls, text: str) -> "PecState":
        d = json.loads(text)
        return cls(Level.from_json(d["snapshot"]), Level.from_json(d["persist"]), d["lost_tokens"], d["plt"],
                   d["recoveries"])
