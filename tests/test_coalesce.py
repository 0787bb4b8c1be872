"""Copies coalesced into runs contiguous on both sides, copying exactly the same bytes."""

import pytest
import torch

from megatron_pec.common.coalesce import coalesced

pytestmark = pytest.mark.megatron_free


def test_runs_contiguous_on_both_sides_become_one_copy_and_copy_the_same_bytes():
    src_flat, other = torch.arange(100, dtype=torch.float32), torch.arange(100, 140, dtype=torch.float32)
    dst_flat = torch.zeros(85)
    # src: [0:10) [10:30) [30:35) continue each other; then a gap; then another storage; dst packed
    src = [src_flat[0:10], src_flat[10:30], src_flat[30:35], src_flat[40:50], other[0:40]]
    dst, offset = [], 0
    for t in src:
        dst.append(dst_flat[offset:offset + t.numel()])
        offset += t.numel()
    out_dst, out_src = coalesced(dst, src)
    assert [t.numel() for t in out_src] == [35, 10, 40]
    assert [t.numel() for t in out_dst] == [35, 10, 40]
    torch._foreach_copy_(out_dst, out_src)
    assert torch.equal(dst_flat, torch.cat([src_flat[0:35], src_flat[40:50], other]))


def test_separate_storages_and_dtypes_are_never_merged():
    a, b = torch.zeros(8), torch.zeros(8)
    buf = torch.zeros(16)
    same_bytes_other_dtype = buf.view(torch.int32)
    # two storages (even were b's memory to follow a's), and another dtype of the same bytes
    out_dst, _ = coalesced([buf[0:8], buf[8:16]], [a, b])
    assert len(out_dst) == 2
    out_dst, _ = coalesced([buf[0:8], same_bytes_other_dtype[8:16]], [torch.zeros(16)[0:8], torch.zeros(16)[8:16]])
    assert len(out_dst) == 2
    assert coalesced([], []) == ([], [])


def test_another_slot_of_the_same_layout_takes_the_first_slots_runs():
    """The engine coalesces the first slot's slices and gives every other slot (same layout, its own
    mapping) the same runs from each run's first slice: the copies are the ones coalescing that slot
    would give, and copy the same bytes."""
    from megatron_pec.common.coalesce import coalesced_with_starts, run_view

    src_flat = torch.arange(60, dtype=torch.float32)
    src = [src_flat[0:10], src_flat[10:30], src_flat[35:40], src_flat[40:60]]
    slots = [torch.zeros(55), torch.zeros(55)]
    views = [[flat[0:10], flat[10:30], flat[30:35], flat[35:55]] for flat in slots]
    first_dst, first_src, starts = coalesced_with_starts(views[0], src)
    assert starts == [0, 2] and [t.numel() for t in first_dst] == [30, 25]
    other = [run_view(views[1][i], t.numel()) for i, t in zip(starts, first_dst)]
    direct, _ = coalesced(views[1], src)
    assert [(t.data_ptr(), t.numel()) for t in other] == [(t.data_ptr(), t.numel()) for t in direct]
    torch._foreach_copy_(other, first_src)
    assert torch.equal(slots[1], torch.cat([src_flat[0:30], src_flat[35:60]]))
