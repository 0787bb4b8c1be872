"""Expert selection policies: which experts a checkpoint saves (save step 2, *plan*).

Every rank of the trainer calls :func:`select_experts` / :func:`select_two_level`
once per save with the same inputs (token counts are all-reduced beforehand) and
gets the same answer, so no further coordination is needed. Everything here is
pure and deterministic: integer arithmetic only, ties broken by a fixed order,
no torch, no torch.distributed. Sequential and load-aware run vectorised (numpy)
whenever the greedy choice respects every EP rank's capacity - the usual case: a
save's plan at 15k experts then takes milliseconds, not tens of them; otherwise, and
for popularity, the per-expert reference below decides (same answer, see
``_vectorised``).

Policies (``POLICIES``):

* ``sequential`` — PEC (Cai et al., ASPLOS'25, Fig. 1): K experts per layer in
  round-robin, interleaved so consecutive picks alternate EP ranks and each
  layer starts where the previous one stopped. Every expert is saved within
  ``ceil(E/K)`` consecutive checkpoints and every EP rank saves within one
  expert of every other.
* ``load-aware`` — PEC Algorithm 1: the K experts per layer with the most
  unsaved tokens, with an equal save capacity per EP rank.
* ``popularity`` — MoEtion: a byte budget split across layers in proportion to
  their unsaved tokens, most-unsaved experts first within a layer.

For all policies, experts never saved at this level come first (and beyond K or
the budget): the first checkpoint must hold every expert, so a restore never
needs initial weights from anywhere else.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Callable, Mapping

from megatron_pec.format.item_names import ExpertId, ExpertOrder

__all__ = ["POLICIES", "ExpertGrid", "SelectionInput", "select_experts", "select_two_level", "bytes_per_ep_rank"]

POLICIES = ("sequential", "load-aware", "popularity")
TOKEN_BLIND = ("sequential",)  # policies that never read ``SelectionInput.unsaved_tokens``


@dataclass(frozen=True, slots=True)
class ExpertGrid:
    """Where the experts live; identical on every rank."""

    layers: tuple[int, ...]  # global 1-based numbers of ALL MoE layers, increasing
    num_experts: int  # experts per MoE layer
    ep_size: int  # EP rank r holds experts [r*E/ep, (r+1)*E/ep), as in Megatron
    expert_bytes: int  # checkpoint bytes per expert (param + exp_avg + exp_avg_sq)
    _experts: tuple[ExpertId, ...] = field(default=(), init=False, repr=False, compare=False)
    _index: dict = field(default=None, init=False, repr=False, compare=False)  # expert -> place in _experts
    order: ExpertOrder = field(default=None, init=False, repr=False, compare=False)  # the two of them

    def __post_init__(self) -> None:
        if not self.layers or any(b <= a for a, b in zip(self.layers, self.layers[1:])) or self.layers[0] < 1:
            raise ValueError(f"layers must be non-empty, 1-based and strictly increasing, got {self.layers}")
        if self.num_experts < 1 or self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be a positive multiple of "
                             f"ep_size ({self.ep_size})")
        if self.expert_bytes < 1:
            raise ValueError(f"expert_bytes must be positive, got {self.expert_bytes}")
        # Built once: every save's selection walks them (58 layers x 256 experts: 15k ids).
        object.__setattr__(self, "_experts", tuple(ExpertId(layer, e) for layer in self.layers
                                                   for e in range(self.num_experts)))
        object.__setattr__(self, "_index", {e: i for i, e in enumerate(self._experts)})
        object.__setattr__(self, "order", ExpertOrder(self._experts, self._index))

    def ep_rank_of(self, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} out of range [0, {self.num_experts})")
        return expert // (self.num_experts // self.ep_size)

    def all_experts(self) -> tuple[ExpertId, ...]:
        return self._experts

    def _interleaved_pos(self, expert: int) -> int:
        # Position in the order E0 of rank 0, E0 of rank 1, ..., E1 of rank 0, ...:
        # any K consecutive positions (cyclically) spread over EP ranks evenly.
        per_rank = self.num_experts // self.ep_size
        return (expert % per_rank) * self.ep_size + expert // per_rank


@dataclass(frozen=True, slots=True)
class SelectionInput:
    """Everything one selection at one level (snapshot or persist) depends on."""

    layout: ExpertGrid
    k: int  # experts per layer to save at this level, 1..num_experts
    unsaved_tokens: Mapping[ExpertId, int]  # tokens since the last saved version at this level; missing = 0
    last_saved: Mapping[ExpertId, int]  # iteration of the last saved version at this level; missing = never saved
    checkpoint_index: int  # 0, 1, 2, ... counts checkpoints at this level (round-robin position)
    budget_bytes: int | None = None  # popularity only (ignored otherwise); None -> k * layers * expert_bytes
    candidates: frozenset[ExpertId] | None = None  # choose only among these; None = all experts

    def __post_init__(self) -> None:
        lay = self.layout
        if not 1 <= self.k <= lay.num_experts:
            raise ValueError(f"k must be in 1..num_experts ({lay.num_experts}), got {self.k}")
        if self.checkpoint_index < 0:
            raise ValueError(f"checkpoint_index must be >= 0, got {self.checkpoint_index}")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.budget_bytes}")
        for name, keys in (("unsaved_tokens", self.unsaved_tokens), ("last_saved", self.last_saved),
                           ("candidates", self.candidates or ())):
            if _array(keys, lay) is None and not all(map(lay._index.__contains__, keys)):
                unknown = [e for e in keys if e not in lay._index]
                raise ValueError(f"{name} names experts outside the layout: {sorted(unknown)[:5]}")
        unsaved = _array(self.unsaved_tokens, lay)
        if (unsaved.min(initial=0) < -1 if unsaved is not None else min(self.unsaved_tokens.values(), default=0) < 0):
            negative = sorted(e for e, n in self.unsaved_tokens.items() if n < 0)
            raise ValueError(f"unsaved_tokens must be >= 0; negative for {negative[:5]}")


def _array(values, lay: ExpertGrid):
    """The int64 array of an ``expert_values.ExpertValues`` laid out in ``lay``'s order (-1: none), else
    None (a plain mapping, read expert by expert)."""
    aligned = getattr(values, "aligned", None)
    return aligned(lay.order) if aligned is not None else None


def bytes_per_ep_rank(layout: ExpertGrid, selected: frozenset[ExpertId] | set[ExpertId]) -> list[int]:
    """Expert bytes each EP rank writes for ``selected`` (its share of the save work)."""
    out = [0] * layout.ep_size
    for eid in selected:
        out[layout.ep_rank_of(eid.expert)] += layout.expert_bytes
    return out


def select_experts(policy: str, inp: SelectionInput) -> frozenset[ExpertId]:
    """The experts to save at one level. Same inputs give the same set on every rank.

    Never-saved candidates are always included and count against K (or the
    budget); the policy fills what is left. With ``candidates`` the per-layer K
    is capped at the candidates that layer has. Raises ``ValueError`` for an
    unknown policy (bad inputs are rejected when ``SelectionInput`` is built).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown selection policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy != "popularity":
        chosen = _vectorised(policy, inp)
        if chosen is not None:
            return chosen
    lay = inp.layout
    pool = inp.candidates if inp.candidates is not None else frozenset(lay.all_experts())
    chosen = {e for e in pool if e not in inp.last_saved}
    rest = [e for e in pool if e not in chosen]
    tokens = lambda e: inp.unsaved_tokens.get(e, 0)
    age = lambda e: inp.last_saved[e]  # noqa: E731  (only asked of saved experts)
    offset = _round_robin_offsets(inp)
    if policy == "popularity":
        budget = inp.budget_bytes if inp.budget_bytes is not None else inp.k * len(lay.layers) * lay.expert_bytes
        slots = max(0, budget // lay.expert_bytes - len(chosen))
        return frozenset(chosen | _popularity(lay, rest, slots, tokens, age, offset))
    if policy == "load-aware":
        key = lambda e: (-tokens(e), offset(e))
    elif inp.candidates is None:
        key = offset  # pure round-robin: guarantees coverage and balance from checkpoint_index alone
    else:
        # Inside a candidate set (persist ⊆ snapshot) our own round-robin window may
        # not be available; stalest-first is what round-robin converges to and keeps
        # every expert cycling through this level.
        key = lambda e: (age(e), offset(e))
    available = Counter(e.layer for e in pool)
    quota = {layer: min(inp.k, available[layer]) for layer in lay.layers}
    return frozenset(_greedy_with_capacity(lay, sorted(rest, key=key), quota, chosen))


NEVER = -(1 << 62)  # the age of a never-saved expert in ``_vectorised``'s arrays


def _vectorised(policy: str, inp: SelectionInput, pool=None) -> frozenset[ExpertId] | None:
    """``select_experts`` for sequential and load-aware with numpy, or None where the reference must
    decide. Each layer ranks its experts by the same (unique) key as the reference and takes its
    first ``quota - never-saved``; when no EP rank then exceeds its capacity, that is exactly the
    set the reference's greedy pass takes (walking the global order, it takes each such expert
    while its layer and rank are below their limits and skips every other), so no augmenting swap
    is needed. Otherwise None. ``pool``: the candidates as a boolean array over the layout's order
    (instead of ``inp.candidates``)."""
    import numpy  # (here: the node agent imports this package's config, and starts without numpy)

    lay, k = inp.layout, inp.k
    rows, width = len(lay.layers), lay.num_experts
    experts, index = lay.all_experts(), lay._index
    within = pool is not None or inp.candidates is not None
    if pool is None and inp.candidates is None:
        pool = numpy.ones(rows * width, dtype=bool)
    elif pool is None:
        pool = numpy.zeros(rows * width, dtype=bool)
        pool[numpy.fromiter(map(index.__getitem__, inp.candidates), dtype=numpy.int64,
                            count=len(inp.candidates))] = True
    pool = pool.reshape(rows, width)
    age = _ages(inp).reshape(rows, width)
    never = pool & (age == NEVER)
    rest = pool & ~never
    per_rank = width // lay.ep_size
    ids = numpy.arange(width)
    interleaved = (ids % per_rank) * lay.ep_size + ids // per_rank  # ExpertGrid._interleaved_pos of each
    starts = (inp.checkpoint_index + numpy.arange(rows, dtype=numpy.int64)) * k
    offset = (interleaved[None, :] - starts[:, None]) % width
    if policy == "load-aware":
        tokens = _array(inp.unsaved_tokens, lay)
        if tokens is None:
            tokens = numpy.fromiter(map(inp.unsaved_tokens.get, experts, repeat(0)), dtype=numpy.int64,
                                    count=len(experts))
        keys = (offset, -numpy.maximum(tokens, 0).reshape(rows, width))  # (-1 in an array: none, 0 tokens)
    elif not within:
        keys = (offset,)
    else:
        keys = (offset, age)  # stalest first inside a candidate set (see select_experts)
    order = numpy.lexsort((*keys, ~rest), axis=1)  # the layer's remaining experts first, best first
    quota = numpy.minimum(k, pool.sum(axis=1))
    never_per_layer = never.sum(axis=1)
    take = numpy.maximum(quota - never_per_layer, 0)
    picked = numpy.zeros_like(pool)
    numpy.put_along_axis(picked, order, numpy.arange(width)[None, :] < take[:, None], axis=1)
    chosen = never | picked
    capacity = -(-int(numpy.maximum(quota, never_per_layer).sum()) // lay.ep_size)
    if chosen.reshape(rows, lay.ep_size, per_rank).sum(axis=(0, 2)).max() > capacity:
        return None
    return frozenset(map(experts.__getitem__, numpy.flatnonzero(chosen).tolist()))


def _ages(inp: SelectionInput):
    """Each expert's last saved iteration at this level (``NEVER``: never saved), over the layout."""
    import numpy

    lay = inp.layout
    saved = _array(inp.last_saved, lay)
    if saved is None:
        return numpy.fromiter(map(inp.last_saved.get, lay.all_experts(), repeat(NEVER)), dtype=numpy.int64,
                              count=len(lay.all_experts()))
    return numpy.where(saved < 0, NEVER, saved)


def select_two_level(policy: str, snapshot: SelectionInput,
                     persist: SelectionInput) -> tuple[frozenset[ExpertId], frozenset[ExpertId]]:
    """(snapshot set, persist set) for a checkpoint that is also persisted (PEC §3.2).

    ``snapshot`` and ``persist`` carry each level's own K, unsaved tokens, last
    saved versions and checkpoint index. The persist set is chosen with the
    persist-level inputs among all experts (or ``persist.candidates``); choosing it
    only inside a snapshot set starves experts whenever the persist interval is a
    multiple of the snapshot set's period (sequential, K = E/2, every second
    snapshot persisted: half the experts would never be persisted again). The
    snapshot set is the persist set topped up with the snapshot level's choice of
    snapshot K - persist K others, so a snapshot still copies K experts per layer
    (plus never-snapshotted ones). For a snapshot-only checkpoint use ``select_experts``.
    """
    if persist.layout != snapshot.layout:
        raise ValueError("snapshot and persist inputs must share the same ExpertGrid")
    persisted = select_experts(policy, persist)
    lay = snapshot.layout
    if policy != "popularity" and _array(snapshot.last_saved, lay) is not None:
        chosen = _two_level_vectorised(policy, snapshot, persist, persisted)
        if chosen is not None:
            return chosen
    rest = (snapshot.candidates if snapshot.candidates is not None else frozenset(lay.all_experts())) - persisted
    never = rest.difference(snapshot.last_saved)
    if snapshot.k <= persist.k or not rest:
        return persisted | never, persisted
    budget = None if snapshot.budget_bytes is None else \
        max(0, snapshot.budget_bytes - len(persisted) * lay.expert_bytes)
    top_up = select_experts(policy, replace(snapshot, k=snapshot.k - persist.k, candidates=rest,
                                            budget_bytes=budget))
    return persisted | top_up, persisted


def _two_level_vectorised(policy: str, snapshot: SelectionInput, persist: SelectionInput,
                           persisted: frozenset[ExpertId]) -> tuple[frozenset, frozenset] | None:
    """``select_two_level`` after the persist set, with boolean arrays over the layout instead of sets
    of its 15k experts; None where ``_vectorised`` leaves the choice to the reference."""
    import numpy

    lay = snapshot.layout
    rest = numpy.ones(len(lay.all_experts()), dtype=bool)
    if snapshot.candidates is not None:
        rest[:] = False
        rest[lay.order.positions(list(snapshot.candidates))] = True
    rest[lay.order.positions(list(persisted))] = False
    if snapshot.k <= persist.k or not rest.any():
        never = numpy.flatnonzero(rest & (_ages(snapshot) == NEVER)).tolist()
        return persisted | frozenset(map(lay.all_experts().__getitem__, never)), persisted
    top_up = _vectorised(policy, replace(snapshot, k=snapshot.k - persist.k, candidates=None), pool=rest)
    return None if top_up is None else (persisted | top_up, persisted)


def _round_robin_offsets(inp: SelectionInput) -> Callable[[ExpertId], tuple[int, int]]:
    """Sort key giving each expert's place in this checkpoint's sequential order.

    Layer i's window starts at interleaved position (c + i) * K, so layer i+1
    continues where layer i stopped: the "extra" experts of K mod ep_size land on
    successive EP ranks across layers (balance), and successive checkpoints
    advance each layer by K (coverage within ceil(E/K) checkpoints).
    """
    lay, num = inp.layout, inp.layout.num_experts
    index = {layer: i for i, layer in enumerate(lay.layers)}

    def key(e: ExpertId) -> tuple[int, int]:
        i = index[e.layer]
        return (lay._interleaved_pos(e.expert) - (inp.checkpoint_index + i) * inp.k) % num, i

    return key


def _greedy_with_capacity(lay: ExpertGrid, ranked: list[ExpertId], quota: Mapping[int, int],
                          fixed: set[ExpertId]) -> set[ExpertId]:
    """PEC Algorithm 1 on top of the ``fixed`` experts: take experts in ``ranked`` order
    while their layer is below its quota and their EP rank below ceil(total quota / ep).

    Greedy order can strand a layer whose remaining experts sit on full ranks although
    a capacity-respecting choice exists; augmenting swaps (max-flow, layers -> ranks)
    find it. Only a layer that truly cannot be served is filled ignoring capacity, so
    every layer ends with exactly its quota.
    """
    choice = _CapacityChoice(lay, ranked, quota, fixed)
    for e in ranked:
        if choice.per_layer[e.layer] < quota[e.layer] and choice.per_rank[choice.rank_of(e)] < choice.capacity:
            choice.move(e, +1)
    for layer in lay.layers:
        while choice.per_layer[layer] < quota[layer] and choice.augment(layer):
            pass
    for e in ranked:
        if e not in choice.chosen and choice.per_layer[e.layer] < quota[e.layer]:
            choice.move(e, +1)
    return choice.chosen


class _CapacityChoice:
    """The experts chosen so far, counted per layer and per EP rank, and the moves between them."""

    def __init__(self, lay: ExpertGrid, ranked: list[ExpertId], quota: Mapping[int, int], fixed: set[ExpertId]):
        self.lay = lay
        self.cell: dict[tuple[int, int], list[ExpertId]] = {}  # (layer, rank) -> experts in priority order
        for e in ranked:
            self.cell.setdefault((e.layer, self.rank_of(e)), []).append(e)
        self.chosen = set(fixed)
        self.per_layer = Counter(e.layer for e in self.chosen)
        self.per_rank = Counter(self.rank_of(e) for e in self.chosen)
        # Never-saved experts beyond a layer's quota still take room, so count them in.
        self.capacity = -(-sum(max(q, self.per_layer[layer]) for layer, q in quota.items()) // lay.ep_size)

    def rank_of(self, e: ExpertId) -> int:
        return self.lay.ep_rank_of(e.expert)

    def move(self, e: ExpertId | None, sign: int) -> None:
        assert e is not None  # the search only walks edges that have an expert
        (self.chosen.add if sign > 0 else self.chosen.remove)(e)
        self.per_layer[e.layer] += sign
        self.per_rank[self.rank_of(e)] += sign

    def best_free(self, layer: int, rank: int) -> ExpertId | None:
        return next((e for e in self.cell.get((layer, rank), ()) if e not in self.chosen), None)

    def worst_taken(self, layer: int, rank: int) -> ExpertId | None:  # never a fixed expert
        return next((e for e in reversed(self.cell.get((layer, rank), ())) if e in self.chosen), None)

    def augment(self, start: int) -> bool:
        """BFS: ``start`` adds on rank r; if r is full, a layer with a movable expert on r moves it to another
        rank, and so on until a rank with spare capacity; then the path is applied. False: no such path."""
        enters: dict[int, int] = {}  # rank -> layer adding an expert there
        leaves: dict[int, int] = {start: -1}  # layer -> rank it gives an expert up on
        frontier = [start]
        while frontier:
            nxt = []
            for layer in frontier:
                for rank in range(self.lay.ep_size):
                    if rank in enters or self.best_free(layer, rank) is None:
                        continue
                    enters[rank] = layer
                    if self.per_rank[rank] < self.capacity:
                        self._apply(rank, enters, leaves)
                        return True
                    for other in self.lay.layers:
                        if other not in leaves and self.worst_taken(other, rank) is not None:
                            leaves[other] = rank
                            nxt.append(other)
            frontier = nxt
        return False

    def _apply(self, rank: int, enters: dict[int, int], leaves: dict[int, int]) -> None:
        """The augmenting path ending on ``rank``, applied backwards."""
        while rank != -1:
            layer = enters[rank]
            self.move(self.best_free(layer, rank), +1)
            rank = leaves[layer]
            if rank != -1:
                self.move(self.worst_taken(layer, rank), -1)


def _popularity(lay: ExpertGrid, rest: list[ExpertId], slots: int, tokens: Callable[[ExpertId], int],
                age: Callable[[ExpertId], int], offset: Callable[[ExpertId], tuple[int, int]]) -> set[ExpertId]:
    """MoEtion-style: ``slots`` whole experts split across layers in proportion to each
    layer's unsaved tokens (largest remainder, capped at the layer's experts that have
    tokens), most-unsaved first within a layer. A layer with no unsaved tokens gets
    nothing while others need slots — skipping it loses no tokens. Slots still left
    after every expert with tokens is chosen go to the stalest others, because their
    optimizer state still drifts (momentum, weight decay) and the budget is allowed."""
    busy: dict[int, list[ExpertId]] = {layer: [] for layer in lay.layers}
    for e in sorted((e for e in rest if tokens(e) > 0), key=lambda e: (-tokens(e), age(e), offset(e))):
        busy[e.layer].append(e)
    weight = {layer: sum(tokens(e) for e in busy[layer]) for layer in lay.layers}
    alloc = {layer: 0 for layer in lay.layers}
    open_layers = [layer for layer in lay.layers if busy[layer]]
    while slots > 0 and open_layers:
        total = sum(weight[layer] for layer in open_layers)
        give = {layer: slots * weight[layer] // total for layer in open_layers}
        # Largest remainder, ties by layer order; integer maths so every rank agrees.
        by_remainder = sorted(open_layers, key=lambda layer: -(slots * weight[layer] % total))
        for layer in by_remainder[: slots - sum(give.values())]:
            give[layer] += 1
        for layer in open_layers:
            got = min(give[layer], len(busy[layer]) - alloc[layer])
            alloc[layer] += got
            slots -= got
        # Each round either spends every slot or fills at least one layer, so it ends.
        open_layers = [layer for layer in open_layers if alloc[layer] < len(busy[layer])]
    chosen = {e for layer in lay.layers for e in busy[layer][: alloc[layer]]}
    if slots:
        chosen |= set(sorted((e for e in rest if e not in chosen), key=lambda e: (age(e), offset(e)))[:slots])
    return chosen
