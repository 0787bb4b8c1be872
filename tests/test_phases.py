"""Phases: a block inside another counts only for its own phase, so the phases add up to the whole."""

import pytest

from megatron_pec.common.phases import Phases

pytestmark = pytest.mark.megatron_free


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_add_up_to_the_whole():
    clock = Clock()
    phases = Phases(clock)
    with phases("outer"):
        clock.now += 2
        with phases("inner"):
            clock.now += 3
        with phases("inner"):  # the same phase twice: summed
            clock.now += 1
        clock.now += 0.5
    assert phases.seconds == pytest.approx({"inner": 4, "outer": 2.5})
    assert list(phases.seconds) == ["inner", "outer"]  # (in the order they first ended)
    assert phases.total() == pytest.approx(6.5)  # what the outer block took in all
    assert phases.describe() == "inner 4.000 s, outer 2.500 s"
    phases.add("tiny", 0.0001)
    phases.add("small", 0.0002)
    assert phases.describe() == "inner 4.000 s, outer 2.500 s, the rest 0.000 s"


def test_a_phase_that_raises_is_still_timed_and_closed():
    clock = Clock()
    phases = Phases(clock)
    with pytest.raises(ValueError):
        with phases("outer"):
            with phases("failing"):
                clock.now += 1
                raise ValueError("x")
    with phases("after"):
        clock.now += 2
    assert phases.seconds == pytest.approx({"failing": 1, "outer": 0, "after": 2})


def test_each_phase_is_a_range_in_the_profilers_trace_while_it_records():
    """A trace of a training step (the example's --profile) shows the save's phases beside the step's
    operators; without the profiler the blocks add nothing to it."""
    import torch

    phases = Phases()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with phases("copy"):
            with phases("plan"):
                torch.ones(4).sum()
    names = [e.name for e in prof.events()]
    assert "megatron-pec copy" in names and "megatron-pec plan" in names
    with phases("metadata"):
        pass
    assert set(phases.seconds) == {"copy", "plan", "metadata"}
