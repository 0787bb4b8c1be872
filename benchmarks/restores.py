"""A method's restores, measured the same way for every method and every benchmark: from node memory (if
it has that tier), then from storage, cold; medians and the phases of the slowest rank. Runs in the
benchmark worker on every rank (collective), after a method's saves: a restore changes the training state.
"""

from __future__ import annotations

import os
import time

from benchmarks.collective import gather_objects
from benchmarks.common import median
from benchmarks.floors import cold_read_floor

# (a cold read's time varies by tens of ms on a shared disk: the median of several, every method alike;
# and it takes 2-3x as long while the disk still flushes the method's own saves just before, which
# would charge the methods that persisted the most bytes: each starts after a sync and a pause. The disk's
# own rate swings 2x within a minute here: each restore's floor is a cold read of its files right before it)
STORAGE_SETTLE_S = 3.0


def measure_restores(ctx, method, memory_restores: int, storage_restores: int) -> dict:
    """``memory_restores`` restores from node memory and ``storage_restores`` from storage."""
    out = {}
    memory, restore_phases = [], []
    for _ in range(memory_restores if method.has_memory else 0):
        memory.append(method.restore_memory())
        restore_phases.append(slowest_phases(method.phases("restore")))
    out["restore_memory_phases_s"] = median_phases(restore_phases)
    out["restore_memory_s_all"] = memory
    out["restore_memory_s"] = median(memory) if memory else None
    ctx.invalidate()
    os.sync()
    time.sleep(STORAGE_SETTLE_S)
    storage, storage_phases, floors = [], [], []
    for _ in range(storage_restores):
        floors.append(cold_read_floor(method.restored_files(), ctx.rank))
        storage.append(method.restore_storage())
        storage_phases.append(slowest_phases(method.phases("storage restore")))
        ctx.invalidate()
    out["restore_storage_phases_s"] = median_phases(storage_phases)
    out["restore_storage_s_all"] = storage
    out["restore_storage_s"] = median(storage)
    if floors and all(f is not None for f in floors):
        out["restore_storage_floor_s_all"] = floors
        out["restore_storage_floor_s"] = median(floors)
    return out


def slowest_phases(mine: dict | None) -> dict | None:
    """The phases of the rank whose total was largest (the one the others waited for)."""
    every = [p for p in gather_objects(mine) if p]
    return max(every, key=lambda p: sum(p.values())) if every else None


def median_phases(measured: list) -> dict | None:
    """Per phase, the median over the measurements (a phase a measurement lacks counts as 0)."""
    measured = [p for p in measured if p]
    if not measured:
        return None
    names = list(dict.fromkeys(name for p in measured for name in p))
    return {name: median([p.get(name, 0.0) for p in measured]) for name in names}
