"""Coalesced snapshot copies (megatron_pec.copyruns): neighbours joined only where both sides continue."""

import torch

from megatron_pec.copyruns import coalesce


def slot_views(buffer: bytearray, spans, dtype=torch.float32):
    return [torch.frombuffer(buffer, dtype=dtype, count=n, offset=4 * start) for start, n in spans]


def test_runs_join_where_both_sides_are_contiguous_and_copy_the_same_bytes():
    live = torch.arange(100, dtype=torch.float32)
    other = torch.arange(100, 120, dtype=torch.float32)        # another storage
    src = [live[0:10], live[10:30], live[40:50], live[50:55], other[0:5]]
    slot = bytearray(4 * 60)
    dst = slot_views(slot, [(0, 10), (10, 20), (30, 10), (40, 5), (45, 5)])

    def join(first, numel):
        start = torch.frombuffer(slot, dtype=torch.uint8, count=1).data_ptr()
        return torch.frombuffer(slot, dtype=first.dtype, count=numel, offset=first.data_ptr() - start)

    runs_dst, runs_src = coalesce(dst, src, join)
    # 0-10 and 10-30 join; 30-40 in the slot follows, but the live side jumps to 40: a new run,
    # which 50-55 continues; the last source lives in another tensor: never joined across.
    assert [t.numel() for t in runs_dst] == [30, 15, 5]
    assert [t.numel() for t in runs_src] == [30, 15, 5]
    torch._foreach_copy_(runs_dst, runs_src)
    got = torch.frombuffer(slot, dtype=torch.float32)
    expected = torch.cat([live[0:30], live[40:55], other[0:5]])
    assert torch.equal(got[:50], expected)


def test_nothing_joins_across_dtypes_or_a_gap_in_the_slot():
    live = torch.zeros(40, dtype=torch.float32)
    half = torch.zeros(10, dtype=torch.bfloat16)
    slot = bytearray(4 * 60)
    dst = slot_views(slot, [(0, 10), (20, 10)]) + [torch.frombuffer(slot, dtype=torch.bfloat16, count=10, offset=200)]
    runs_dst, _ = coalesce(dst, [live[0:10], live[10:20], half], lambda first, n: None)
    assert [t.numel() for t in runs_dst] == [10, 10, 10]
