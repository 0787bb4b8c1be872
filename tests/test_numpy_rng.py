"""numpy's RNG state as a save keeps it (``megatron.numpy_rng.numpy_state``): what ``numpy.random.get_state()``
gives at that moment, whatever drew from numpy in between, read by numpy again only when it changed."""

import warnings

import numpy
import pytest

from megatron_pec.megatron import numpy_rng
from megatron_pec.megatron.numpy_rng import numpy_state

pytestmark = pytest.mark.megatron_free


@pytest.fixture(autouse=True)
def numpy_rng_put_back():
    generator, state = numpy.random.get_bit_generator(), numpy.random.get_state()
    yield
    numpy.random.set_bit_generator(generator)
    numpy.random.set_state(state)


def same(a, b) -> bool:
    return a[0] == b[0] and numpy.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def test_the_state_is_numpys_after_every_kind_of_draw():
    """Uniform draws move the key; a Gaussian draw caches its pair's second value (has_gauss 1) and the next
    one uses it without moving key or position (has_gauss 0 again); seeding and set_state replace it."""
    numpy.random.seed(11)
    draws = [lambda: None, numpy.random.random, numpy.random.randn, numpy.random.randn, numpy.random.randn,
             lambda: numpy.random.randint(0, 9, 700), lambda: numpy.random.seed(12), numpy.random.randn,
             lambda: numpy.random.set_state(earlier), lambda: None, numpy.random.randn]
    earlier = numpy.random.get_state()
    for draw in draws:
        draw()
        assert same(numpy_state(), numpy.random.get_state())


def test_an_unchanged_state_is_not_read_again_and_cannot_be_changed_by_whoever_holds_it():
    numpy.random.seed(3)
    numpy.random.random()
    first = numpy_state()
    assert numpy_state() is first
    with pytest.raises(ValueError):
        first[1][0] = 0  # (shared by every save until numpy's state moves)
    numpy.random.random()
    assert numpy_state() is not first


def test_a_cached_gaussian_is_read_by_numpy_every_time():
    """Drawing the cached Gaussian moves neither key nor position: a state holding one is never reused."""
    numpy.random.seed(5)
    numpy.random.randn()
    held = numpy_state()
    assert held[3] == 1
    numpy.random.randn()
    after = numpy_state()
    assert after[3] == 0 and same(after, numpy.random.get_state())


def test_another_bit_generator_is_read_by_numpy():
    numpy.random.set_bit_generator(numpy.random.MT19937(1))
    assert same(numpy_state(), numpy.random.get_state())
    numpy.random.set_bit_generator(numpy.random.PCG64(1))  # (legacy get_state gives its dict, and warns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert numpy_state() == numpy.random.get_state()


def test_a_direct_read_that_does_not_match_numpys_is_not_used(monkeypatch):
    """Where the C state's layout is not the one expected, every save reads through numpy."""
    monkeypatch.setattr(numpy_rng, "_direct", False)
    monkeypatch.setattr(numpy_rng, "_generator", None)
    numpy.random.seed(7)
    first = numpy_state()
    assert same(first, numpy.random.get_state()) and numpy_state() is not first
