"""The restore's copy in two parts (``megatron/slice_copy.py``): the main params first, the rest once the
optimizer's state exists; each slice lands once, in the tensor the restore ends up with. The GPU run of it
(copies that run while the CPU goes on) is timed in ``benchmarks.gpu``; the restores through it on CPU ranks
are ``tests/test_faults.py``'s device-path cases."""

import torch

from megatron_pec.integrity.summed_copy import summed_copy
from megatron_pec.megatron.slice_copy import SliceCopy


def _saved():
    return {"p0": torch.arange(8, dtype=torch.float32), "p1": torch.arange(8, 16, dtype=torch.float32),
            "m0": torch.arange(16, 24, dtype=torch.float32)}


def test_each_slice_lands_once_in_the_targets_the_restore_ends_with():
    saved = _saved()
    params = {"p0": torch.zeros(8), "p1": torch.zeros(8)}
    copy = SliceCopy(["p0", "p1", "m0"])
    copy.first(params, saved)
    assert torch.equal(params["p0"], saved["p0"]) and torch.equal(params["p1"], saved["p1"])
    saved["p0"] += 100  # (a slice copied first is not copied again: the rest leaves it as it landed)
    targets = {**params, "m0": torch.zeros(8)}
    assert copy.rest(targets, saved, None) is None
    copy.wait()
    assert torch.equal(targets["p0"], torch.arange(8, dtype=torch.float32))
    assert torch.equal(targets["m0"], saved["m0"])


def test_a_param_whose_tensor_moved_while_the_state_loaded_is_copied_again():
    saved = _saved()
    first = {"p0": torch.zeros(8), "p1": torch.zeros(8)}
    copy = SliceCopy(["p0", "p1", "m0"])
    copy.first(first, saved)
    moved = {"p0": first["p0"], "p1": torch.zeros(8), "m0": torch.zeros(8)}  # p1 replaced by the optimizer
    copy.rest(moved, saved, None)
    assert all(torch.equal(moved[n], saved[n]) for n in saved)


def test_the_rest_sums_what_it_copies_where_places_are_given():
    saved = _saved()
    targets = {n: torch.zeros(8) for n in saved}
    places = {"p0": ("dense", 0), "p1": ("dense", 32), "m0": ("dense", 64)}
    summed = SliceCopy(list(saved)).rest(targets, saved, places)
    expected = summed_copy([torch.zeros(8) for _ in saved], list(saved.values()), list(places.values()))
    assert summed == expected
    assert all(torch.equal(targets[n], saved[n]) for n in saved)
