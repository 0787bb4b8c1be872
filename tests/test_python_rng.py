"""Python's RNG state as a save keeps it (``megatron.python_rng.python_state``): what ``random.getstate()`` gives
at that moment, whatever drew from ``random`` in between, read by ``getstate()`` again only when it changed."""

import random

import pytest

from megatron_pec.megatron import python_rng
from megatron_pec.megatron.python_rng import python_state

pytestmark = pytest.mark.megatron_free


@pytest.fixture(autouse=True)
def random_put_back():
    state = random.getstate()
    yield
    random.setstate(state)


def test_the_state_is_getstates_after_every_kind_of_draw():
    """Draws move the key or the position; a Gaussian caches its pair's second value (``gauss_next``) and the
    next one uses it without moving either; seeding and setstate replace the state."""
    random.seed(11)
    earlier = random.getstate()
    draws = [lambda: None, random.random, lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
             lambda: random.gauss(0, 1), lambda: [random.getrandbits(64) for _ in range(700)],
             lambda: random.seed(12), lambda: random.gauss(0, 1), lambda: random.setstate(earlier), lambda: None,
             lambda: random.shuffle(list(range(50)))]
    for draw in draws:
        draw()
        assert python_state() == random.getstate()
    assert python_rng._direct, "the direct read did not match getstate(): every save reads it the slow way"


def test_an_unchanged_state_is_not_read_again():
    random.seed(3)
    random.random()
    first = python_state()
    assert python_state() is first
    random.random()
    assert python_state() is not first and python_state() == random.getstate()


def test_a_cached_gaussian_drawn_is_seen_though_the_key_did_not_move():
    random.seed(5)
    random.gauss(0, 1)
    held = python_state()
    assert held[2] is not None
    random.gauss(0, 1)  # (returns the cached value: key and position stay)
    after = python_state()
    assert after[2] is None and after == random.getstate()


def test_a_layout_that_does_not_match_is_read_by_getstate_every_time(monkeypatch):
    monkeypatch.setattr(python_rng, "_direct", None)
    monkeypatch.setattr(python_rng, "_AT", python_rng._AT + 8)  # (as if the header were another size)
    random.seed(7)
    first = python_state()
    assert python_rng._direct is False
    assert python_state() is not first and python_state() == random.getstate()
