"""Python's ``random`` state at every save, read by ``random.getstate()`` only when it changed (``python_state``).

``random.getstate()`` builds a tuple of 625 Python ints: about 50 us at a save right after a training step, and
Megatron's training loop seldom draws from ``random``. As numpy's (``numpy_rng.py``), the Mersenne Twister's
position and key are read straight from the generator object (CPython's ``_random.Random``: an int, then 624
uint32 words, right after the object header; one 2.5 KB copy) and compared with those of the last state read, and
its cached Gaussian (``gauss_next``, an attribute of ``random.Random``) with that state's; ``getstate()`` reads
again when either differs, and always where the direct read did not match its own at the first save (another
interpreter, another layout).
"""

from __future__ import annotations

import ctypes
import random
import struct

_KEY_WORDS = 624
_BYTES = 4 + 4 * _KEY_WORDS        # (int index, then uint32 state[624])
_AT = object.__basicsize__         # (the object header the generator's fields follow)

_direct = None  # whether the direct read matches getstate()'s (None: not checked yet)
_inst = None    # the generator the last state is of
_fields = None  # ... its position and key, as a ctypes array over them
_raw = b""      # ... its position and key when getstate() last read them
_state = None   # ... and what getstate() gave then


def python_state() -> tuple:
    """What ``random.getstate()`` returns now (the same tuple while nothing drew from ``random``)."""
    global _inst, _fields, _raw, _state
    inst = random._inst  # (what random.getstate reads)
    if inst is _inst and _fields.raw == _raw and inst.gauss_next == _state[2]:
        return _state
    state = random.getstate()
    if not _checked(inst, state):
        return state  # (read by getstate() at every save)
    if inst is not _inst:
        _inst, _fields = inst, (ctypes.c_char * _BYTES).from_address(id(inst) + _AT)
    _raw, _state = _fields.raw, state
    return state


def _read(inst) -> bytes:
    return ctypes.string_at(id(inst) + _AT, _BYTES)


def _checked(inst, state: tuple) -> bool:
    """Whether the direct read gives what ``getstate()`` gave (checked once: the layout is the interpreter's)."""
    global _direct
    if _direct is None:
        _, words, _ = state
        _direct = (type(inst).__mro__[1].__module__ == "_random" and len(words) == _KEY_WORDS + 1
                   and _read(inst) == struct.pack(f"=i{_KEY_WORDS}I", words[-1], *words[:-1]))
    return _direct


__all__ = ["python_state"]
