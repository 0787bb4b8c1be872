"""Phases: a block inside another counts only for its own phase, so the phases add up to the whole."""

import time

from megatron_pec.phases import Phases


def test_nested_phases_add_up_to_the_whole():
    phases = Phases()
    started = time.perf_counter()
    with phases("outer"):
        time.sleep(0.02)
        with phases("inner"):
            time.sleep(0.03)
        with phases("inner"):  # the same phase twice: summed
            time.sleep(0.01)
    whole = time.perf_counter() - started
    assert list(phases.seconds) == ["inner", "outer"]  # (in the order they ended)
    assert 0.04 <= phases.seconds["inner"] < 0.04 + 0.02
    assert 0.02 <= phases.seconds["outer"] < 0.02 + 0.02
    assert abs(phases.total() - whole) < 0.005
    assert phases.describe() == f"inner {phases.seconds['inner']:.3f} s, outer {phases.seconds['outer']:.3f} s"
    phases.add("tiny", 0.0001)
    assert phases.describe().endswith("outer %.3f s, the rest 0.000 s" % phases.seconds["outer"])


def test_a_phase_that_raises_is_still_timed():
    phases = Phases()
    try:
        with phases("failing"):
            raise ValueError("x")
    except ValueError:
        pass
    assert phases.seconds["failing"] >= 0 and phases._inner == []
