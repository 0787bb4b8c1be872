"""A snapshot's device-to-host copies go out in waves, at most two queued on the copy stream, so
that the training step's own small device-to-host copies never wait behind a whole snapshot (the H200
measured +23% step time at K=all with the snapshot enqueued at once). CPU tensors and stand-in events: the
order and the bytes are what matter here; tests/gpu and benchmarks.gpu run it on a device."""

import pytest
import torch

from megatron_pec.save.copy_waves import copy_in_waves, waves

pytestmark = pytest.mark.megatron_free


def _pairs(sizes, dtype=torch.float32):
    src = [torch.arange(n, dtype=dtype) + i * 1000 for i, n in enumerate(sizes)]
    return [torch.zeros_like(s) for s in src], src


def test_waves_cover_every_byte_once_in_order_and_none_is_over_its_size():
    dst, src = _pairs([10, 300, 7, 64, 64, 1])
    wave_bytes = 64 * 4  # 64 floats
    grouped = waves(dst, src, wave_bytes)
    for wave_dst, wave_src in grouped:
        assert sum(t.numel() * 4 for t in wave_dst) <= wave_bytes
        assert all(d.data_ptr() != s.data_ptr() for d, s in zip(wave_dst, wave_src))
    flat_src = torch.cat([s for _, wave_src in grouped for s in wave_src])
    assert torch.equal(flat_src, torch.cat(src)), "the waves must read every element once, in order"
    pieces = iter((d.data_ptr(), d.numel() * 4) for wave_dst, _ in grouped for d in wave_dst)
    for whole in dst:  # the pieces tile each destination once, in order, and nothing else
        at, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * 4
        while at < end:
            start, nbytes = next(pieces)
            assert start == at, "a destination piece is missing, repeated or out of order"
            at += nbytes
        assert at == end
    assert next(pieces, None) is None
    assert len(grouped) >= 300 * 4 // wave_bytes + 1, "a run longer than a wave must be cut"


def test_a_run_that_cannot_be_cut_travels_whole_in_a_wave_of_its_own():
    src = [torch.arange(8.0), torch.arange(400.0).reshape(20, 20).t(), torch.arange(8.0)]  # (the middle: not flat)
    dst = [torch.zeros(8), torch.zeros(20, 20).t(), torch.zeros(8)]
    grouped = waves(dst, src, 64)
    assert [len(w[0]) for w in grouped] == [1, 1, 1]
    assert grouped[1][1][0] is src[1]


class _Events:
    """Stand-in events: which waves were issued, landed (synchronized) and the most queued at once."""

    def __init__(self):
        self.issued, self.landed, self.most_queued = 0, 0, 0

    def record(self):
        self.issued += 1
        self.most_queued = max(self.most_queued, self.issued - self.landed)
        events = self

        class Event:
            def synchronize(self):
                events.landed += 1
        return Event()


def test_no_more_than_two_waves_are_queued_and_the_copy_is_exact():
    dst, src = _pairs([1000, 5, 2500, 40, 700])
    events = _Events()
    count = copy_in_waves(dst, src, record=events.record, wave_bytes=256 * 4)
    assert count == events.issued > 8
    assert events.most_queued == 2, "a third wave was queued before the first landed"
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_a_snapshot_smaller_than_a_wave_is_one_copy_call():
    dst, src = _pairs([10, 20, 30])
    calls = []
    count = copy_in_waves(dst, src, record=_Events().record, copy=lambda d, s: calls.append(len(d)))
    assert count == 1 and calls == [3]
