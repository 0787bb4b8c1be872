"""A fresh process on a GPU: the stager starts the checksum kernel's load at start-up (the engine's
``_start_memory_tier``); then a restore's check on the device (``Stager.checked``: a new
binding, its table, one launch) and a save. Prints one JSON line: Triton compiles at start-up and after,
how long the restore's check took, whether the sums equal the reference. argv: SLOT_DIR."""

import json
import sys
import time

import torch
import triton.compiler

compiles = []
original_compile = triton.compiler.compile


def counting_compile(*args, **kwargs):  # (JITFunction binds triton.compiler.compile at its first launch)
    compiles.append(time.perf_counter())
    return original_compile(*args, **kwargs)


triton.compiler.compile = counting_compile
import triton.runtime.jit  # noqa: E402 (after the set-up above)

if hasattr(triton.runtime.jit, "compile"):  # (Triton versions that bind it when the module is imported)
    triton.runtime.jit.compile = counting_compile

from megatron_pec.format.stformat import layout  # noqa: E402 (after the set-up above)
from megatron_pec.integrity.sum64 import item_sums  # noqa: E402 (after the set-up above)
from megatron_pec.memory.slot_map import POOL, SlotMap  # noqa: E402 (after the set-up above)
from megatron_pec.memory.slots import SlotFiles  # noqa: E402 (after the set-up above)
from megatron_pec.save.stager import Stager  # noqa: E402 (after the set-up above)


def main():
    specs = [(f"{item}/w.{kind}", torch.float32, n) for item, n in (("dense", 1 << 20), ("L1.E0", 12345))
             for kind in ("param", "exp_avg", "exp_avg_sq")]
    entries = layout(specs)
    files = SlotFiles(sys.argv[1], 0, SlotMap.of(entries, 2), 1)
    slices = [type("S", (), {"name": e.name, "item": e.item})() for e in entries]
    stager = Stager(files, slices, 0)  # (start-up: the load begins in its thread)
    stager.pin()
    stager.kernel.kernel()  # (Megatron's start-up takes longer than the load)
    at_start = len(compiles)
    live = {e.name: torch.randn(e.numel, device="cuda") for e in entries}  # (what the restore allocated)
    torch.cuda.synchronize()
    started = time.perf_counter()
    pending = stager.sums(live).start(["dense", "L1.E0"])
    torch.cuda.current_stream().synchronize()
    restored = pending.digests()
    took = time.perf_counter() - started
    staging = stager.begin(live)
    staging.copy({"dense": 1})
    staging.copy({"L1.E0": POOL})
    staged = staging.finish()
    saved = staged.sums()
    want = {}
    for item, slot in staging.placed.items():
        want.update(item_sums(files.mapping(slot), files.item_header(slot, item), {item}))
    stager.close()
    files.close()
    print(json.dumps({"compiles_at_start": at_start, "compiles_after": len(compiles) - at_start,
                      "restore_check_s": took, "sums_equal": restored == saved == want}))


if __name__ == "__main__":
    main()
