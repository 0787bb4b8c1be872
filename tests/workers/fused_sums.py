"""The one-launch checksum kernel on CPU tensors, in Triton's interpreter (the test sets
TRITON_INTERPRET=1 before anything imports Triton). argv: MODE OUT_JSON [SLOT_DIR].

* ``exact``:    item sums of runs of every kind (dtypes of 1-8 bytes, 8-aligned or not in memory and
  within the item, odd byte counts, runs longer than a chunk, empty items, subsets of items) by the
  kernel, by ``Sum64`` over the bytes (the reference) and by stock torch operations (``DeviceSums``);
* ``launches``: what one snapshot enqueues through the stager's device path (the CPU stand-ins for the
  streams), with 10 and with 10,000 runs: torch operations dispatched and kernel launches.
"""

import json
import os
import sys

import numpy
import torch

from megatron_pec import sum64_kernel  # (Triton imported here: interpreted under TRITON_INTERPRET=1)
from megatron_pec.chunks import CHUNK_BYTES
from megatron_pec.run_sums import FusedRunSums, HostRunSums


def mixed_items(seed: int) -> dict:
    """item -> [(tensor, byte offset within the item)]: consecutive runs of many shapes."""
    rng = numpy.random.default_rng(seed)
    base = torch.from_numpy(rng.standard_normal(CHUNK_BYTES // 4 * 3 + 77).astype(numpy.float32))
    kinds = [lambda: base[1:],                                                        # > 2 chunks, 4 off 8
             lambda: base[:1001],                                                     # odd count of fp32
             lambda: torch.from_numpy(rng.standard_normal(17)),                        # fp64
             lambda: torch.from_numpy(rng.integers(0, 2**31, 999).astype(numpy.int32))[3:],
             lambda: torch.randn(67).to(torch.bfloat16)[1:],                          # 2 off 4 in memory
             lambda: torch.randn(33).to(torch.float16),
             lambda: torch.from_numpy(rng.integers(0, 256, 13, dtype=numpy.uint8))[1:],  # 1 off in memory
             lambda: torch.from_numpy(rng.integers(-2**62, 2**62, 4099, dtype=numpy.int64))]
    items = {}
    for i in range(6):
        at, runs = int(rng.integers(0, 9)), []
        if at:
            runs.append((torch.from_numpy(rng.integers(0, 256, at, dtype=numpy.uint8)), 0))
        for k in rng.permutation(len(kinds)):
            run = kinds[k]()
            runs.append((run, at))
            at += run.numel() * run.element_size()
        items[f"L1.E{i}"] = runs
    items["empty"] = []
    return items


def exact(out: str) -> None:
    items = mixed_items(7)
    fused = FusedRunSums(items, "cpu", sum64_kernel.chunk_sums)
    reference = HostRunSums(items, "cpu")
    result = {"rows": len(fused.table), "unit_sizes": sorted({int(r[3]) for r in fused.table.rows}), "cases": []}
    for chosen in (list(items), ["L1.E3"], ["L1.E0", "empty", "L1.E5"]):
        result["cases"].append({"items": chosen, "fused": fused.start(chosen).digests(),
                                "reference": reference.start(chosen).digests(),
                                "stock": _stock_digests(items, chosen)})
    with open(out, "w") as f:
        json.dump(result, f)


def _stock_digests(items, chosen) -> dict:
    from megatron_pec.sum64 import DeviceSums

    sums = DeviceSums("cpu")
    for item in chosen:
        for tensor, offset in items[item]:
            sums.add(item, tensor, offset)
    digests = sums.digests(sums.result())
    return {item: digests.get(item, "s64:" + "0" * 32) for item in chosen}


def launches(out: str, slot_dir: str) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_pec.memlayout import POOL, MemoryLayout
    from megatron_pec.slots import SlotFiles
    from megatron_pec.stager import Stager
    from megatron_pec.stformat import layout
    from megatron_pec.testing import cpu

    cpu.activate()  # (torch.cuda.Stream / Event / stream(): the stager's device path on CPU tensors)
    kernel_launches = []
    sum64_kernel.launch = lambda *args: kernel_launches.append(args)  # counted, not run (``exact`` runs it)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    result = {}
    for runs in (10, 10_000):
        # ``runs`` slices of one dense item and one expert, each apart from the next in memory: none coalesce
        half = runs // 2
        specs = [(f"dense/p{i}.param", torch.float32, 3) for i in range(half)] + \
                [(f"L1.E0/p{i}.param", torch.float32, 3) for i in range(runs - half)]
        entries = layout(specs)
        files = SlotFiles(os.path.join(slot_dir, str(runs)), 0, MemoryLayout.of(entries, 2), 1)
        source = torch.randn(runs * 4)
        live = {e.name: source[4 * i:4 * i + 3] for i, e in enumerate(entries)}
        slices = [type("Slice", (), {"name": e.name, "item": e.item})() for e in entries]
        stager = Stager(files, slices, 0, asynchronous=True,
                        sums_for=lambda r: FusedRunSums(r, "cpu", sum64_kernel.chunk_sums))
        stager.prepare(live)  # (what the engine does once, after the first optimizer step)
        stager.runs(1, "dense", live), stager.runs(POOL, "L1.E0", live)
        count, before = Count(), len(kernel_launches)
        with count:
            staging = stager.begin(live)
            staging.copy({"dense": 1})
            staging.copy({"L1.E0": POOL})
            staging.finish()
        result[str(runs)] = {"torch_ops": count.ops, "kernel_launches": len(kernel_launches) - before,
                             "copy_runs": len(stager.runs_of("dense")) + len(stager.runs_of("L1.E0"))}
        stager.close()
        files.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (CPU tensors)"
    {"exact": lambda: exact(sys.argv[2]), "launches": lambda: launches(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
