"""A restore from node memory into host tensors checks its bytes as it copies them (``copy_slices`` with places,
``integrity/summed_copy.py``): the copy is exact, a slice without a place is copied unsummed, and each item's
sums are the definition's over the item's bytes, however its slices coalesce into runs across items, in
whatever order, cut into pieces at any byte."""

import numpy
import pytest
import torch
from test_sum64 import reference

from megatron_pec.integrity import summed_copy as module
from megatron_pec.megatron.restore import copy_slices


def slot_and_live():
    """A slot's bytes holding dense = d0 d1 d2 and expert E = e0 e1 (header order), laid out d0 d1 e0 e1 p d2
    so that the run d0 d1 e0 e1 is contiguous on both sides across the two items, and a plain slice p."""
    rng = numpy.random.default_rng(5)
    sizes = {"d0": (1000, torch.float32), "d1": (333, torch.float32), "e0": (5000, torch.float32),
             "e1": (1, torch.float32), "d2": (77, torch.bfloat16), "p": (10, torch.float32)}
    order = ["d0", "d1", "e0", "e1", "p", "d2"]
    nbytes = {n: numel * torch.empty(0, dtype=dtype).element_size() for n, (numel, dtype) in sizes.items()}
    slot = bytearray(rng.integers(0, 256, sum(nbytes.values()), dtype=numpy.uint8).tobytes())
    flat, at, saved = torch.frombuffer(slot, dtype=torch.uint8), 0, {}
    for n in order:
        saved[n] = flat[at:at + nbytes[n]].view(sizes[n][1])
        at += nbytes[n]
    big = torch.zeros(sum(nbytes[n] for n in order[:4]) // 4, dtype=torch.float32)
    live, at = {}, 0
    for n in order[:4]:
        live[n] = big[at:at + sizes[n][0]]
        at += sizes[n][0]
    live["d2"] = torch.zeros(77, dtype=torch.bfloat16)
    live["p"] = torch.zeros(10, dtype=torch.float32)
    places = {"d0": ("dense", 0), "d1": ("dense", 4000), "d2": ("dense", 5332), "e0": ("E", 0), "e1": ("E", 20000),
              "p": None}
    item_bytes = {"dense": b"".join(bytes(saved[n].view(torch.uint8).numpy()) for n in ("d0", "d1", "d2")),
                  "E": b"".join(bytes(saved[n].view(torch.uint8).numpy()) for n in ("e0", "e1"))}
    return order, saved, live, places, item_bytes


@pytest.mark.parametrize("piece", [module.PIECE, 1004, 8, 4])
def test_the_copy_is_exact_and_its_sums_are_the_items(monkeypatch, piece, summed_by):
    monkeypatch.setattr(module, "PIECE", piece)
    monkeypatch.setattr(module, "PIECE_IN_ONE_PASS", piece)
    order, saved, live, places, item_bytes = slot_and_live()
    sums = copy_slices([live[n] for n in order], [saved[n] for n in order], [places[n] for n in order])
    for n in order:
        assert torch.equal(live[n].view(torch.uint8), saved[n].view(torch.uint8)), n
    assert sums == {item: reference(data) for item, data in item_bytes.items()}


def test_pairs_in_any_order_give_the_same_sums():
    order, saved, live, places, item_bytes = slot_and_live()
    shuffled = ["e1", "d2", "d0", "p", "e0", "d1"]
    sums = copy_slices([live[n] for n in shuffled], [saved[n] for n in shuffled], [places[n] for n in shuffled])
    assert sums == {item: reference(data) for item, data in item_bytes.items()}


def test_a_flipped_byte_changes_the_sum_of_its_item_only(summed_by):
    order, saved, live, places, item_bytes = slot_and_live()
    clean = copy_slices([live[n] for n in order], [saved[n] for n in order], [places[n] for n in order])
    saved["d1"].view(torch.uint8)[17] ^= 0x04
    flipped = copy_slices([live[n] for n in order], [saved[n] for n in order], [places[n] for n in order])
    assert flipped["E"] == clean["E"] and flipped["dense"] != clean["dense"]
    assert live["d1"].view(torch.uint8)[17] == saved["d1"].view(torch.uint8)[17]


def test_pieces_of_whole_rows_sum_as_the_definition(summed_by):
    """Pieces long enough for rows of the two reductions (torch sums the rows here, numpy elsewhere): words
    with their high bits set wrap mod 2**64 alike, from an offset that is not a whole word."""
    rng = numpy.random.default_rng(7)
    nbytes = 3 * 8 * 4096 + 36
    source = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=numpy.uint8))
    live = torch.zeros(nbytes, dtype=torch.uint8)
    sums = copy_slices([live], [source], [("E", 4)])
    assert torch.equal(live, source)
    assert sums == {"E": reference(bytes(4) + bytes(source.numpy()))}

