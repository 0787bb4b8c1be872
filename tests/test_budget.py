"""Node memory sized by what snapshots write, and a hard budget's implied K (pure: ``memory/budget.py``,
``memory/slot_map.py``, ``regions.RegionBook``)."""

import json

import pytest
import torch

from megatron_pec.format.stformat import layout
from megatron_pec.memory import budget
from megatron_pec.memory.budget import Budget, BudgetError
from megatron_pec.memory.regions import RegionBook
from megatron_pec.memory.slot_map import POOL, SlotMap
from megatron_pec.pec.policy import ExpertGrid

pytestmark = pytest.mark.megatron_free

LAYOUT = ExpertGrid(layers=(1, 2), num_experts=8, ep_size=2, expert_bytes=1000)


@pytest.mark.parametrize("text,expected", [("1.5x", Budget(ratio=1.5)), ("2X", Budget(ratio=2.0)),
                                           ("24", Budget(node_bytes=24 << 30)), ("0.5GiB", Budget(node_bytes=1 << 29)),
                                           (None, None), ("", None)])
def test_the_budget_is_a_multiple_of_the_state_or_gib_for_the_node(text, expected):
    assert Budget.parse(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1x", "0", "1.5y"])
def test_a_malformed_budget_says_what_to_give(text):
    with pytest.raises(ValueError, match="--pec-node-memory .*a multiple of the node's state .* or GiB"):
        Budget.parse(text)


def test_a_snapshot_writes_its_share_of_k_per_layer_on_each_ep_rank():
    """Sequential interleaves K over the EP ranks: at K = 2 of 8 with EP = 2 each rank writes one expert of
    each of its 2 layers per snapshot; K = all writes all it holds; other policies are bounded by K."""
    assert budget.per_snapshot(LAYOUT, "sequential", 2, ep_rank=0, held=8) == 2
    assert budget.per_snapshot(LAYOUT, "sequential", 3, ep_rank=1, held=8) == 3      # (6 a snapshot, balanced)
    assert budget.per_snapshot(LAYOUT, "sequential", 8, ep_rank=0, held=8) == 8
    assert budget.per_snapshot(LAYOUT, "load-aware", 2, ep_rank=0, held=8) == 4
    assert budget.per_snapshot(None, "sequential", 2, ep_rank=0, held=0) == 0


def plan(asked_k, budget_text=None, replicas=0):
    """A rank of 8 experts of 1000 bytes and a 2000-byte home slot: a state of 10,000 bytes."""
    demand = lambda k: budget.per_snapshot(LAYOUT, "sequential", k, ep_rank=0, held=8)
    return budget.plan(10_000, 2000, 2, 0, 1000, 8, demand, asked_k, Budget.parse(budget_text), 10_000, 1,
                       replicas * 10_000)


def test_node_memory_follows_what_snapshots_write():
    every = plan(8)
    assert every.regions == 16 and every.own == 2 * 10_000 and every.k == 8     # 2x the state at K = all
    two = plan(2)
    assert two.regions == 10 and two.own / two.state == pytest.approx(1.4)     # 8 experts + 2 spares
    assert plan(8, replicas=1).total == 3 * 10_000                              # (a replica: the state's size)


def test_a_budget_implies_the_k_it_holds():
    fits = plan(8, "1.5x")
    assert fits.regions == 11 and fits.k == 3 and fits.own <= 15_000            # 3 spares: snapshot-K 3 (4 > 3)
    assert "needs" in fits.describe(1, False, (1 << 30, None)) and fits.needed_for_asked == 20_000
    assert plan(2, "1.5x").k == 2 and plan(2, "1.5x").regions == 10            # (no more than the asked K takes)


def test_the_tightest_budget_is_the_pool_a_k1_run_gets_and_below_it_is_refused_with_the_smallest():
    """With no spare region every region holds its expert's newest version, so no save can write a
    new one (the rounds of a persistent save waited 120 s and gave up). The least a budget must leave is the
    spares of a K = 1 pool: what one snapshot at K = 1 writes, at least a quarter of the experts (a save of
    every expert in at most ROUNDS rounds) - here 2 spares, 1.4x; a hundredth below it is refused."""
    demand = lambda k: budget.per_snapshot(LAYOUT, "sequential", k, ep_rank=0, held=8)
    assert budget.least_spares(8, demand) == 2 and budget.least_spares(0, demand) == 0
    assert budget.least_bytes(2000, 2, 0, 1000, 8, demand, 0) == plan(1).own == 14_000
    tightest = plan(8, "1.4x")
    assert tightest.regions == 10 and tightest.k == 2 and tightest.own == 14_000
    for below in ("1.39x", "1.25x", "1.1x"):
        with pytest.raises(BudgetError, match=r"(?s)leaves .* per rank .* needs at least .*8 experts and 2 spare "
                                              r"expert region.*The smallest budget that works is 1\.4x"):
            plan(8, below)
    assert budget.smallest_ratio(14_001, 10_000) == 1.41 and budget.smallest_ratio(14_000, 10_000) == 1.4


def test_the_pool_places_any_expert_in_any_region_and_readers_find_it():
    entries = layout([("dense/w.param", torch.float32, 4), ("L1.E0/w.param", torch.float32, 3),
                      ("L1.E0/w.exp_avg", torch.float32, 3), ("L1.E1/w.param", torch.float32, 5)])
    memory = SlotMap.of(entries, 3)
    assert memory.region_bytes == 64 and memory.state_bytes == 16 + 24 + 20   # (regions aligned to 64 bytes)
    assert [e.name for e in memory.full_entries()] == [e.name for e in entries]
    from megatron_pec.format.stformat import Header, decode_header, encode_header
    pool = decode_header(encode_header(memory.pool_entries(), memory.pool_metadata()))
    again = SlotMap.from_headers(Header(memory.dense, {}, 0), pool)
    assert again == memory
    placed = again.item_header(POOL + 2, "L1.E0", None, pool)
    assert [(e.begin, e.end) for e in placed.tensors] == [(128, 140), (140, 152)]


def test_the_pool_header_keeps_each_list_of_expert_tensors_once_whatever_their_numbers():
    """Thousands of experts differ only in the numbers of their tensor names: the header grows by the
    experts' names, not by their tensor lists; names of other forms round-trip too."""
    from megatron_pec.format.stformat import TensorEntry, decode_header, encode_header

    def expert(item, first, kinds=("param", "exp_avg")):
        names = [f"{item}/o1.g0.b0.p{first + j}.x0.{kind}" for kind in kinds for j in range(2)]
        return tuple(TensorEntry(n, "F32", 8, 32 * i, 32 * i + 32) for i, n in enumerate(names))

    experts = {f"L{layer}.E{e}": expert(f"L{layer}.E{e}", 2 * (16 * layer + e))
               for layer in range(8) for e in range(16)}
    experts["L9.E0"] = (TensorEntry("L9.E0/w007.a3", "BF16", 3, 0, 6), TensorEntry("L9.E0/b", "F32", 1, 6, 10))
    memory = SlotMap((), experts, 4)
    metadata = memory.pool_metadata()
    assert len(json.loads(metadata["shapes"])) == 2
    assert len(metadata["shapes"]) + len(metadata["experts"]) < 40 * len(experts)
    again = SlotMap.from_headers(None, decode_header(encode_header(memory.pool_entries(), metadata)))
    assert again.experts == experts


def test_a_book_of_one_spare_takes_as_many_experts_as_regions_are_free():
    """Two experts, one spare: after the first snapshot (every expert), each later one can take one expert
    while the other's region holds its newest version."""
    book = RegionBook(["dense", "L1.E0", "L1.E1"], pool=3)
    first = book.place(0, ["dense", "L1.E0", "L1.E1"])
    book.writing(1, first)
    book.announced(1, first)
    book.released(1, True)
    assert book.capacity() == 1 and book.home() == 1
    second = book.place(1, ["dense", "L1.E1"])
    assert second["L1.E1"] not in first.values()
    book.writing(2, second)
    book.announced(2, second)
    book.released(2, True)
    assert book.capacity() == 1 and book.newest[2] == second["L1.E1"]          # E1's old region is free again


def test_a_save_waits_for_regions_only_while_the_agent_holds_one_it_will_free():
    """The rounds of a persistent save waited 120 s for regions no wait could free (every region
    held its expert's newest version). A wait is worth it only while a snapshot is in flight or a persist /
    push pins a region that is not its expert's newest; it then ends when the pin is handed back."""
    from megatron_pec.format.protocol import Pin

    def snapshot(book, iteration, items, home):
        placed = book.place(home, ["dense", *items])
        book.writing(iteration, placed)
        book.announced(iteration, placed)
        return placed

    full = RegionBook(["dense", "L1.E0", "L1.E1"], pool=2)                     # no spare
    snapshot(full, 1, ["L1.E0", "L1.E1"], 0)
    assert full.may_free() and full.capacity() == 0                            # (in flight: recording frees)
    full.released(1, True)
    assert full.capacity() == 0 and not full.may_free()                        # never frees: do not wait

    book = RegionBook(["dense", "L1.E0", "L1.E1"], pool=3)                     # one spare
    first = snapshot(book, 4, ["L1.E0", "L1.E1"], 0)
    book.released(4, True)
    book.pin([Pin(4, slots=sorted(first.values()))])                           # the persist of 4 reads them
    snapshot(book, 5, ["L1.E0"], 1)
    book.released(5, True)
    assert book.capacity() == 0 and book.may_free()                            # E0's version 4: read, not newest
    book.pin([Pin(4, slots=[first["L1.E1"]])])                                 # ... handed back
    assert book.capacity() == 1 and book.writable()[first["L1.E0"]]
