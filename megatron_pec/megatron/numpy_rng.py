"""numpy's global RNG state at every save, read by numpy only when it changed (``numpy_state``).

``numpy.random.get_state()`` copies the Mersenne Twister's 624 key words one at a time: 30 us in a loop,
about 80 us at a save right after a training step. Megatron's training loop seldom draws from numpy, so a
save mostly reads the state the one before read. The key and position are read straight from the bit
generator (its C state through numpy's ``ctypes`` interface: one 2.5 KB copy) and compared with those of
the last state numpy gave; numpy reads again when they differ, when that state held a cached Gaussian
(drawing it moves neither key nor position), and always where the direct read did not match numpy's own
at the first save (another bit generator, another layout).

What this cannot see: ``numpy.random.set_state`` of a state with the same key and position as the last
one read but with a cached Gaussian (a program rewinding numpy's RNG to where it already is): the save
then keeps the state without that Gaussian.
"""

from __future__ import annotations

import ctypes
import struct

import numpy

_KEY_WORDS = 624  # (MT19937's state: uint32 key[624], then int pos)
_STATE_BYTES = 4 * _KEY_WORDS + 4

_direct = None     # whether the direct read matches numpy's (None: not checked yet)
_generator = None  # the bit generator the direct read and the last state are of
_c_state = None    # ... its C state, as a ctypes array over it
_raw = b""         # ... its key and position when numpy last read them
_state = None      # ... and what numpy's get_state() gave then


def numpy_state() -> tuple:
    """What ``numpy.random.get_state()`` returns now (the same tuple while nothing drew from numpy)."""
    global _generator, _c_state, _raw, _state
    legacy = getattr(getattr(numpy.random, "mtrand", None), "_rand", None)  # (what get_state reads)
    generator = getattr(legacy, "_bit_generator", None)
    if generator is not None and generator is _generator and _c_state.raw == _raw and not _state[3]:
        # (index 3: has_gauss)
        return _state
    state = numpy.random.get_state()
    if type(generator).__name__ != "MT19937" or not _checked(generator, state):
        return state  # (read by numpy at every save)
    if generator is not _generator:
        _generator = generator
        _c_state = (ctypes.c_char * _STATE_BYTES).from_address(generator.ctypes.state_address)
    state[1].setflags(write=False)  # (shared by the saves until it changes)
    _state, _raw = state, _c_state.raw
    return state


def _checked(generator, state: tuple) -> bool:
    """Whether the direct read gives what numpy gave (checked once: the layout is numpy's build's)."""
    global _direct
    if _direct is None:
        name, key, pos = state[:3]
        raw = ctypes.string_at(generator.ctypes.state_address, _STATE_BYTES)
        expected = numpy.asarray(key, dtype=numpy.uint32).tobytes() + struct.pack("=i", pos)
        _direct = name == "MT19937" and raw == expected
    return _direct
