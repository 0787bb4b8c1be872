"""Saves and restores run with Python's cyclic garbage collector paused.

They allocate tens of thousands of short-lived objects (tensor views, header entries, per-expert
dicts), none of them in reference cycles, and every generation-2 pass that many allocations trigger
walks the whole heap, which in a Megatron process holds millions of objects (docs/design.md, "Measurements
behind the code"). Reference counting still frees everything at once; the collector runs again afterwards.
"""

from __future__ import annotations

import functools
import gc


def without_gc(method):
    """Decorator: run ``method`` with the collector paused (nested calls leave it paused)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return run
