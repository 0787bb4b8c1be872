"""RNG tracker states that are torch.Generator objects (CUDA-graph-safe trackers, --te-rng-tracker /
--cuda-graph-impl) are saved as their state and restored into the same generators."""

import pytest
import torch

from megatron_pec.format import small_state


def test_generator_tracker_states_round_trip_through_small_state():
    pytest.importorskip("megatron.core")
    from megatron.core import tensor_parallel

    from megatron_pec.megatron import collect, restore

    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = tracker.get_states()
    try:
        generator = torch.Generator().manual_seed(7)
        tracker.set_states({"graph-safe": generator, "plain": torch.Generator().manual_seed(3).get_state()})
        saved = small_state.loads(small_state.dumps(collect.rng_state()))  # no TypeError, no pickle
        expected = torch.rand(4, generator=generator)  # what the next draw gives after the save
        torch.rand(4, generator=generator)  # the run moves on
        restore.restore_rng(saved)
        restored = tracker.get_states()
        assert restored["graph-safe"] is generator  # the tracker keeps its generator object
        assert torch.equal(torch.rand(4, generator=generator), expected)
        assert torch.equal(restored["plain"], torch.Generator().manual_seed(3).get_state())
    finally:
        tracker.set_states(before)
