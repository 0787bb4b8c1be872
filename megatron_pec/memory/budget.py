"""How much node memory a rank takes, and the snapshot K that fits in it: the expert pool's size.

A rank's node memory (``memory/slot_map.py``) is two home slots (header + dense state each) and a pool of
expert regions: one per expert the rank holds (each expert's newest version) plus spares for what one
snapshot writes. The spares follow the snapshot K: at K = all, one per expert (twice the state); at
snapshot-K k, as many as the policy ever gives this rank in one snapshot - not three regions of every
expert, most of them idle - but at least a quarter of its experts: a save of every expert (the first
persist, a planned exit) goes through the spares in rounds (``save.Save.write_in_rounds``), at most
``ROUNDS`` of them.

``--pec-node-memory`` sets a hard budget for the node (a multiple of the node's state, ``1.5x``, or
GiB): its local ranks' files plus the replicas it keeps of peer nodes. Under it the pool takes the
spares the budget leaves; when they cannot hold what a snapshot at the asked K writes, snapshots
take the K they can hold (the *implied K*, said once with the memory the asked K needs); persistent
saves keep the asked persist-K (they go through the spares in rounds). A budget is admitted only if it
works: two dense states, one version of every expert, and the spares a K = 1 pool has (``least_spares``:
what a snapshot at snapshot-K 1 writes while the newest versions stay, and enough that a save of every
expert takes at most ``ROUNDS`` rounds). With fewer, no region could take a new version of an expert -
every one holds its expert's newest - and every save would wait for regions that are never freed. A
budget below that is refused at start-up with what it holds and the smallest that works. Pure: the
agreement on the implied K (every rank must take the same) is the engine's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_pec.pec import policy

GIB = 1 << 30
ROUNDS = 4  # the most rounds a save of every expert takes through the spares, unless a budget leaves fewer


class BudgetError(ValueError):
    """A budget too small to hold what any snapshot needs (the message says how much more)."""


@dataclass(frozen=True)
class Budget:
    """``--pec-node-memory``: a multiple of the node's state, or bytes for the whole node."""

    ratio: float | None = None
    node_bytes: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Budget | None":
        """``None``/"" (no budget), ``"1.5x"`` or ``"24"`` (GiB); raises ValueError naming the flag."""
        if text is None or str(text).strip() == "":
            return None
        value = str(text).strip().lower()
        found = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(x|gib|g)?", value)
        if found is None or float(found.group(1)) <= 0:
            raise ValueError(f"--pec-node-memory {text!r}: give a multiple of the node's state (e.g. 1.5x) or "
                             "GiB for the node (e.g. 24)")
        number = float(found.group(1))
        return cls(ratio=number) if found.group(2) == "x" else cls(node_bytes=int(number * GIB))

    def bytes_for(self, node_state: int) -> int:
        """The budget in bytes for a node whose ranks' state is ``node_state``."""
        return self.node_bytes if self.node_bytes is not None else int(self.ratio * node_state)

    def __str__(self) -> str:
        return f"{self.ratio:g}x" if self.ratio is not None else f"{self.node_bytes / GIB:.4g} GiB"


@dataclass(frozen=True)
class MemorySizing:
    """One rank's node memory: its files, its share of the node's replica store, what they hold."""

    state: int          # one complete snapshot of the rank (header, dense state, every expert)
    home_file: int      # one home slot file (header + dense state)
    homes: int          # home slots
    pool_header: int    # the pool file's header
    region_bytes: int
    experts: int        # experts the rank holds
    regions: int        # pool regions
    replica_share: int  # the node's replica store over its local ranks
    asked_k: int        # snapshot K asked (experts per layer; the layer's experts: all)
    k: int              # snapshot K the pool holds (``asked_k`` unless a budget implies less)
    budget: Budget | None = None
    needed_for_asked: int = 0  # what the asked K needs, where the budget implies less

    @property
    def own(self) -> int:
        """Bytes of the rank's own files."""
        return self.homes * self.home_file + self.pool_header + self.regions * self.region_bytes

    @property
    def total(self) -> int:
        return self.own + self.replica_share

    def record(self) -> dict:
        """What ``inspect`` reads back (``<node dir>/rank<r>.memory.json``)."""
        return {"state_bytes": self.state, "own_bytes": self.own, "replica_bytes": self.replica_share,
                "homes": self.homes, "regions": self.regions, "region_bytes": self.region_bytes,
                "experts": self.experts, "asked_k": self.asked_k, "snapshot_k": self.k,
                "budget": str(self.budget) if self.budget is not None else None}

    def describe(self, local_ranks: int, page_locked: bool, room: tuple[int, int | None]) -> str:
        """The start-up line: memory planned against the state, the tmpfs and the cgroup (``room``:
        free tmpfs bytes, the cgroup's limit or None)."""
        gib = lambda b: f"{b / GIB:.2f} GiB"
        text = (f"node memory planned per rank: {gib(self.own)} own ({self.own / self.state:.2f}x its state of "
                f"{gib(self.state)}: {self.homes} dense states, {self.regions} expert regions for {self.experts} "
                "experts)")
        if self.replica_share:
            text += f" + {gib(self.replica_share)} of replicas of peer nodes"
        text += (f"; {gib(self.total * local_ranks)} for the node's {local_ranks} rank(s) "
                 f"({self.total / self.state:.2f}x its state), {gib(self.own * local_ranks if page_locked else 0)} "
                 f"of it page-locked; the tmpfs has {gib(room[0])} free"
                 + (f", the container may use {gib(room[1])}" if room[1] is not None else ""))
        if self.budget is not None:
            text += f" (--pec-node-memory {self.budget})"
        if self.k < self.asked_k:
            text += (f"; the budget holds snapshot-K {self.k} of the asked {self.asked_k} (snapshot-K {self.asked_k} "
                     f"needs {gib(self.needed_for_asked * local_ranks)} for the node)")
        return text


def per_snapshot(layout: policy.ExpertGrid | None, selection: str, k: int, ep_rank: int, held: int) -> int:
    """The most experts of ``ep_rank`` one snapshot at snapshot-K ``k`` writes (``held``: all it holds).
    Sequential: counted over its schedule's period; other policies: every layer's k, up to the rank's
    experts of a layer."""
    if layout is None or held == 0:
        return 0
    per_rank = layout.num_experts // layout.ep_size
    if k >= layout.num_experts:
        return held
    if selection != "sequential":
        return min(held, len(layout.layers) * min(k, per_rank))
    saved = {e: 0 for e in layout.all_experts()}
    most = 0
    for index in range(layout.num_experts):  # (the schedule repeats within E checkpoints)
        chosen = policy.select_experts("sequential", policy.SelectionInput(layout, k, {}, saved, index))
        most = max(most, sum(1 for e in chosen if layout.ep_rank_of(e.expert) == ep_rank))
    return min(held, most)


def least_spares(experts: int, demand) -> int:
    """The fewest spare regions a pool works with: what one snapshot at snapshot-K 1 writes (``demand(1)``),
    and at least a ``ROUNDS``-th of the experts, so a save of every expert takes at most ``ROUNDS`` rounds
    and blocks training for that many short copies, not for hundreds (the pool a K = 1 run gets unasked)."""
    return min(experts, max(demand(1), -(-experts // ROUNDS))) if experts else 0


def least_bytes(home_file: int, homes: int, pool_header: int, region_bytes: int, experts: int, demand,
                replica_share: int) -> int:
    """The smallest node memory a rank works with under a budget (its share of the replicas included)."""
    regions = experts + least_spares(experts, demand)
    return homes * home_file + pool_header + regions * region_bytes + replica_share


def plan(state: int, home_file: int, homes: int, pool_header: int, region_bytes: int, experts: int, demand,
         asked_k: int, budget: Budget | None, node_state: int, local_ranks: int, replica_share: int,
         node_least: int | None = None) -> MemorySizing:
    """The pool's regions for the asked snapshot-K, or under ``budget`` the largest K that fits.

    ``demand(k)``: experts one snapshot at snapshot-K k writes (``per_snapshot``); ``node_state``: the
    node's state (all its ranks); ``replica_share``: the replica store over the local ranks;
    ``node_least``: the smallest budget every rank of the node works with (bytes for the node; default:
    this rank's ``least_bytes`` times the local ranks). Raises BudgetError below this rank's least."""
    def regions_for(k: int) -> int:
        return experts + min(experts, max(demand(k), -(-experts // ROUNDS)))

    def bytes_for(k: int) -> int:
        return homes * home_file + pool_header + regions_for(k) * region_bytes + replica_share

    if budget is None:
        return MemorySizing(state, home_file, homes, pool_header, region_bytes, experts, regions_for(asked_k),
                            replica_share, asked_k, asked_k)
    room = budget.bytes_for(node_state) // local_ranks
    least = least_bytes(home_file, homes, pool_header, region_bytes, experts, demand, replica_share)
    if room < least:
        raise BudgetError(_refusal(budget, room, least, experts, least_spares(experts, demand), node_state,
                                   local_ranks, node_least or least * local_ranks, replica_share))
    spares = (room - homes * home_file - pool_header - experts * region_bytes - replica_share) // max(1, region_bytes)
    k = asked_k
    while k > 1 and demand(k) > spares:
        k -= 1
    regions = min(experts + spares, regions_for(asked_k))
    return MemorySizing(state, home_file, homes, pool_header, region_bytes, experts, regions, replica_share, asked_k,
                        k, budget, bytes_for(asked_k))


def smallest_ratio(node_least: int, node_state: int) -> float:
    """The smallest ``Nx`` budget, to the hundredth and rounded up, that gives the node ``node_least``."""
    return math.ceil(node_least * 100 / max(1, node_state)) / 100


def _refusal(budget: Budget, room: int, least: int, experts: int, spares: int, node_state: int, local_ranks: int,
             node_least: int, replica_share: int) -> str:
    gib = lambda b: f"{b / GIB:.2f} GiB" if b >= GIB // 10 else f"{b / 2**20:.2f} MiB"
    smallest = smallest_ratio(node_least, node_state)
    replicas = ", and its share of peers' replicas" if replica_share else ""
    return (f"--pec-node-memory {budget} leaves {gib(room)} of node memory per rank "
            f"({room * local_ranks / node_state:.2f}x the node's state); a rank needs at least {gib(least)}: two "
            f"dense states, one version of each of its {experts} experts and {spares} spare expert region(s){replicas}"
            f": what a snapshot at snapshot-K 1 writes while the newest versions stay, and enough that a persistent "
            f"save of every expert goes through node memory in at most {ROUNDS} rounds (fewer spares, more rounds, "
            "each holding training; none, and no save could write a new version of any expert). The smallest "
            "budget that works is "
            f"{smallest:g}x ({gib(node_least)} for the node); raise --pec-node-memory to at least that, or leave it "
            "out (2x the state at K=all, less at a smaller --pec-snapshot-k)")


__all__ = ["Budget", "BudgetError", "MemorySizing", "least_bytes", "least_spares", "per_snapshot", "plan",
           "smallest_ratio"]
