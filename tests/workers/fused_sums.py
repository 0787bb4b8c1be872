"""The one-launch checksum kernel on CPU tensors, in Triton's interpreter (the test sets
TRITON_INTERPRET=1 before anything imports Triton). argv: MODE OUT_JSON [SLOT_DIR].

* ``exact``:    item sums of runs of every kind (dtypes of 1-8 bytes, 8-aligned or not in memory and
  within the item, odd byte counts, runs longer than a chunk, empty items, subsets of items) by the
  kernel, by ``Sum64`` over the bytes (the reference) and by stock torch operations (``DeviceSums``);
* ``launches``: what one snapshot enqueues through the stager's device path (the CPU stand-ins for the
  streams), with 10 and with 10,000 runs, copied by the copy engine and by the kernel: torch operations
  dispatched and kernel launches;
* ``mixed``:    runs of "device" tensors (CPU tensors the test marks as device memory) and of host tensors:
  the partition by each tensor, the digests of a mixed binding, and a staged snapshot of a mix (params on
  the "device", moments on the host, as before the first optimizer step) in node memory, bit for bit, with
  the device kernel reading device memory only, copied by the copy engine's path and by the kernel;
* ``startup``:  a fresh process: the stager starts the kernel's load (its compile) at start-up, in a
  thread; a restore's check and a save after it load nothing;
* ``nocompile``: the kernel's load raises as a Triton without a C compiler does: the stock-operation sums,
  one log line, saves and restores without an exception (argv: MODE OUT SLOT_DIR EXCEPTION).
"""

import json
import os
import sys
import threading

import numpy
import torch

from megatron_pec.integrity import sum64_kernel  # (Triton imported here: interpreted under TRITON_INTERPRET=1)
from megatron_pec.integrity.chunk_table import CHUNK_BYTES
from megatron_pec.integrity.run_sums import FusedRunSums, HostRunSums, StockRunSums
from megatron_pec.memory.slot_map import POOL


def landed_sums(files, staging) -> dict[str, str]:
    """The reference: each item a staging placed, summed where it landed in node memory (numpy)."""
    from megatron_pec.integrity.sum64 import item_sums

    want = {}
    for item, slot in staging.placed.items():
        want.update(item_sums(files.mapping(slot), files.item_header(slot, item), {item}))
    return want

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
                                "stock": StockRunSums(items, "cpu").start(chosen).digests()})
    with open(out, "w") as f:
        json.dump(result, f)


def copy(out: str) -> None:
    """The kernel's copy: each item of ``mixed_items`` gets a destination in one byte buffer (8-aligned, as the
    items of a slot are), the launch copies the selected ones there; the bytes, the untouched rest and the
    sums are checked here against the sources and the sums-only launch."""
    items = mixed_items(11)
    fused = FusedRunSums(items, "cpu", sum64_kernel.chunk_sums)
    sizes = {item: sum(t.numel() * t.element_size() for t, _ in runs) + (runs[0][1] if runs else 0)
             for item, runs in items.items()}
    starts, at = {}, 0
    for item, size in sizes.items():
        starts[item], at = at, at + -(-size // 64) * 64
    result = {"unit_sizes": sorted({int(r[3]) for r in fused.table.rows}), "cases": []}
    for chosen in (list(items), ["L1.E3"], ["L1.E0", "empty", "L1.E5"]):
        buffer = torch.full((at + 64,), 0xA5, dtype=torch.uint8)
        base = buffer.data_ptr() + (-buffer.data_ptr()) % 64
        destinations = {item: [base + starts[item] + offset for _, offset in items[item]] for item in chosen}
        programs = 3 if len(chosen) == 1 else None  # (a count that divides no other: every chunk once still)
        sums = fused.start(chosen, destinations=destinations, programs=programs).digests()
        view = buffer.numpy()[(base - buffer.data_ptr()):]
        copied, untouched = [], True
        for item, runs in items.items():
            expect = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t, _ in runs)
            first = runs[0][1] if runs else 0
            got = view[starts[item] + first:starts[item] + first + len(expect)].tobytes()
            if item in chosen and got == expect:
                copied.append(item)
            if item not in chosen and set(got) - {0xA5}:
                untouched = False
        result["cases"].append({"items": sorted(chosen), "copied": sorted(copied), "untouched": untouched,
                                "sums": sums, "reference": fused.start(chosen).digests()})
    launched = []
    original = sum64_kernel.launch
    sum64_kernel.launch = lambda *args: launched.append(args)
    misaligned = {"L1.E0": [t.data_ptr() + 1 for t, _ in items["L1.E0"]]}  # (one byte off its runs of 2-8 byte units)
    result["misaligned"] = fused.start(["L1.E0"], destinations=misaligned)
    result["misaligned_launches"] = len(launched)
    sum64_kernel.launch = original
    with open(out, "w") as f:
        json.dump(result, f)


def launches(out: str, slot_dir: str) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_pec.format.stformat import layout
    from megatron_pec.memory.slot_map import SlotMap
    from megatron_pec.memory.slots import SlotFiles
    from megatron_pec.save.stager import Stager
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
    for runs, by_kernel in ((10, False), (10_000, False), (10, True), (10_000, True)):
        # ``runs`` slices of one dense item and one expert, each apart from the next in memory: none coalesce
        half = runs // 2
        specs = [(f"dense/p{i}.param", torch.float32, 3) for i in range(half)] + \
                [(f"L1.E0/p{i}.param", torch.float32, 3) for i in range(runs - half)]
        entries = layout(specs)
        files = SlotFiles(os.path.join(slot_dir, f"{runs}{by_kernel}"), 0, SlotMap.of(entries, 2), 1)
        source = torch.randn(runs * 4)
        live = {e.name: source[4 * i:4 * i + 3] for i, e in enumerate(entries)}
        slices = [type("Slice", (), {"name": e.name, "item": e.item})() for e in entries]
        stager = Stager(files, slices, 0, asynchronous=True, is_device=lambda t: True, kernel_copies=by_kernel,
                        sums_for=lambda r: FusedRunSums(r, "cpu", sum64_kernel.chunk_sums))
        stager.prepare(live)  # (what the engine does once, after the first optimizer step)
        stager.runs(1, "dense", live), stager.runs(POOL, "L1.E0", live)
        count, enqueued, before = Count(), Count(), len(kernel_launches)  # (the training thread's, the enqueue's)

        def counted(work, enqueue=stager.enqueue, enqueued=enqueued):
            def run():
                with enqueued:
                    return work()
            return enqueue(run)

        stager.enqueue = counted
        runs_views, views_of = [], stager.runs  # (the runs' views each copy pairs, by thread)

        def viewed(*args, runs_views=runs_views, views_of=views_of):
            runs_views.append(threading.get_ident())
            return views_of(*args)

        stager.runs = viewed
        with count:
            staging = stager.begin(live)
            staging.copy({"dense": 1})
            staging.copy({"L1.E0": POOL})
            staging.finish()
        stager.synchronize()
        result[f"{runs}{' by kernel' if by_kernel else ''}"] = {"training_thread_ops": count.ops,
                             "enqueue_thread_ops": enqueued.ops,
                             "training_thread_views": runs_views.count(threading.get_ident()),
                             "kernel_launches": len(kernel_launches) - before,
                             "copy_runs": len(stager.runs_of("dense")) + len(stager.runs_of("L1.E0"))}
        stager.close()
        files.close()
    with open(out, "w") as f:
        json.dump(result, f)


class Marked:
    """``is_device`` for the tests: a tensor is "device memory" when its storage is one of the marked ones."""

    def __init__(self, *tensors):
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}

    def __call__(self, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.storages


def mixed(out: str, slot_dir: str) -> None:
    from megatron_pec.integrity.run_sums import KernelLoad, RunSums, SplitRunSums, split_runs
    from megatron_pec.testing import cpu

    cpu.activate()
    launched = []  # the [start, end) byte ranges each kernel launch's table reads
    original = sum64_kernel.launch

    def launch(kernel, table, partials, selected, *rest):
        if threading.current_thread().name != "megatron-pec kernel load":  # (not the start-up load's own launch)
            launched.append([(r[0], r[0] + r[1]) for r in table.tolist()])
        original(kernel, table, partials, selected, *rest)

    sum64_kernel.launch = launch
    result = {}
    # 1. A binding's runs, some in "device" memory: split by each tensor, the digests equal the reference.
    items = mixed_items(7)
    device_tensors = [t for runs in items.values() for k, (t, _) in enumerate(runs) if k % 2 == 0]
    marked = Marked(*device_tensors)
    device_runs, host_runs = split_runs(items, marked)
    sums = RunSums.for_runs(items, KernelLoad("cpu"), marked)
    reference = HostRunSums(items, "cpu")
    result["split"] = {
        "kind": type(sums).__name__, "parts": [type(p).__name__ for p in getattr(sums, "parts", [])],
        "device_runs_marked": all(marked(t) for runs in device_runs.values() for t, _ in runs),
        "host_runs_unmarked": not any(marked(t) for runs in host_runs.values() for t, _ in runs),
        "every_run_once": all(len(items[i]) == len(device_runs[i]) + len(host_runs[i]) for i in items),
        "both_sides": sum(map(len, device_runs.values())) > 0 and sum(map(len, host_runs.values())) > 0,
        "cases": []}
    assert isinstance(sums, SplitRunSums)
    for chosen in (list(items), ["L1.E3"], ["L1.E0", "empty", "L1.E5"]):
        result["split"]["cases"].append({"items": chosen, "mixed": sums.start(chosen).digests(),
                                         "reference": reference.start(chosen).digests()})
    result["split"]["kernel_read_host"] = _reads_any(launched, [t for runs in host_runs.values() for t, _ in runs])
    result["split"]["kernel_read_device"] = _reads_any(launched, device_tensors)
    launched.clear()
    # 2. A staged snapshot of a mix: params in "device" memory, moments host zeros (collect.stateless_views),
    # copied by the copy engine's path and by the kernel's (``kernel_copies``)
    for key, by_kernel in (("snapshot", False), ("snapshot_by_kernel", True)):
        files, slices, live, device_base = _mixed_state(os.path.join(slot_dir, key))
        marked = Marked(device_base)
        stager = Stager_(files, slices, marked, kernel_copies=by_kernel)
        stager.prepare(live)
        staging, staged = staged_mixed(stager, live)
        got = staged.sums()
        want = landed_sums(files, staging)
        landed = all(bytes(files.item_views(slot, name.split("/", 1)[0])[name].numpy().tobytes())
                     == live[name].numpy().tobytes() for name in live
                     for slot in [staging.placed[name.split("/", 1)[0]]])
        host_live = [t for name, t in live.items() if not marked(t)]
        result[key] = {"sums": got, "reference": want, "landed": landed, "by_kernel": staging.by_kernel,
                       "host_runs": {item: len(stager.host_runs(item)) for item in staging.placed},
                       "launches": len(launched), "kernel_read_host": _reads_any(launched, host_live),
                       "kernel_read_device": _reads_any(launched, [device_base])}
        launched.clear()
        stager.close()
        files.close()
    with open(out, "w") as f:
        json.dump(result, f)


def staged_mixed(stager, live):
    """A save of ``_mixed_state``'s items as the engine stages one: the dense state to home slot 1, the two
    experts to pool regions; (the staging, its ``StagedCopy``)."""
    staging = stager.begin(live)
    staging.copy({"dense": 1})
    staging.copy({"L1.E0": POOL, "L1.E1": POOL + 1})
    return staging, staging.finish()


def _reads_any(launched, tensors) -> bool:
    """Whether a launch's table reads a byte of ``tensors``."""
    ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()]
    return any(a < e and s < b for rows in launched for a, b in rows for s, e in ranges)


def _mixed_state(slot_dir: str):
    """A rank's slot files and live views: dense and two experts, each a param (in one "device" tensor) and
    two moments (host zeros of their own, as ``collect.stateless_views`` gives before the first step)."""
    from megatron_pec.format.stformat import layout
    from megatron_pec.memory.slot_map import SlotMap
    from megatron_pec.memory.slots import SlotFiles

    sizes = {"dense": 3001, "L1.E0": 777, "L1.E1": 1024}
    specs = [(f"{item}/w.{kind}", torch.float32, n) for item, n in sizes.items()
             for kind in ("param", "exp_avg", "exp_avg_sq")]
    entries = layout(specs)
    files = SlotFiles(slot_dir, 0, SlotMap.of(entries, 4), 1)
    device_base = torch.randn(sum(sizes.values()) + 8)
    live, at = {}, 1  # (one element in: runs 4 bytes off 8-alignment)
    for item, n in sizes.items():
        live[f"{item}/w.param"] = device_base[at:at + n]
        at += n
        live[f"{item}/w.exp_avg"] = torch.randn(n)  # (not zeros: a misplaced byte must show)
        live[f"{item}/w.exp_avg_sq"] = torch.rand(n)
    slices = [type("Slice", (), {"name": e.name, "item": e.item})() for e in entries]
    return files, slices, live, device_base


def Stager_(files, slices, marked, **kwargs):
    """The stager the engine builds on a GPU (copy stream, the kernel loaded at start-up), on CPU."""
    from megatron_pec.save.stager import Stager

    return Stager(files, slices, 0, asynchronous=True, is_device=marked, **kwargs)


def startup(out: str, slot_dir: str) -> None:
    """What a relaunched trainer does: the engine starts (the stager, the kernel's load in a thread), then a
    restore checks what it copied (``Stager.checked``), then saves. Every load of the kernel
    (its compile, on a GPU) is recorded with the phase it started in and its thread."""
    from megatron_pec.testing import cpu

    cpu.activate()
    phase, loads, launches_in = ["start"], [], {}
    original_load, original_launch = sum64_kernel.load, sum64_kernel.launch

    def load(device):
        loads.append({"phase": phase[0], "thread": threading.current_thread().name})
        original_load(device)

    def launch(*args):
        thread = threading.current_thread()  # (the load's own launch: whichever phase the main thread is in)
        key = f"{phase[0]} in {thread.name}" if thread is threading.main_thread() else thread.name
        launches_in[key] = launches_in.get(key, 0) + 1
        original_launch(*args)

    sum64_kernel.load, sum64_kernel.launch = load, launch
    files, slices, live, device_base = _mixed_state(slot_dir)
    marked = Marked(*live.values())  # (after a restore every tensor is the optimizer's, on the device)
    stager = Stager_(files, slices, marked)  # (``Engine._start_memory_tier``)
    phase[0] = "restore"
    items = ["dense", "L1.E0", "L1.E1"]
    restored = stager.sums(live).start(items).digests()  # (``Stager.checked``)
    phase[0] = "save"
    staging, staged = staged_mixed(stager, live)
    saved = staged.sums()
    want = landed_sums(files, staging)
    stager.close()
    files.close()
    with open(out, "w") as f:
        json.dump({"loads": loads, "launches": launches_in, "restored": restored, "saved": saved,
                   "reference": want}, f)


def nocompile(out: str, slot_dir: str, error: str) -> None:
    """Triton imports but cannot compile (``error``: what the kernel's load raises)."""
    from megatron_pec.testing import cpu

    cpu.activate()

    def load(device):
        if error == "ImportError":
            raise ImportError("No module named 'triton'")
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    sum64_kernel.load = load
    launches = []
    sum64_kernel.launch = lambda *args: launches.append(args)
    result = {"saves": []}
    for engine in range(2):  # (an engine rebuilt for another optimizer loads again: said once all the same)
        files, slices, live, device_base = _mixed_state(os.path.join(slot_dir, str(engine)))
        marked = Marked(*live.values())
        stager = Stager_(files, slices, marked)
        stager.prepare(live)  # (``Engine._warm_up``, after the first optimizer step)
        sums = stager.sums(live)
        restored = sums.start(["dense", "L1.E0"]).digests()
        for _ in range(2):
            staging, staged = staged_mixed(stager, live)
            saved = staged.sums()  # (first: it waits for the copies the reference reads)
            want = landed_sums(files, staging)
            result["saves"].append({"sums": saved, "reference": want})
        result.setdefault("kinds", []).append(type(sums).__name__)
        result.setdefault("failures", []).append(stager.kernel.failure)
        result.setdefault("restored", []).append(restored == {k: want[k] for k in restored})
        stager.close()
        files.close()
    result["launches"] = len(launches)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (CPU tensors)"
    {"exact": lambda: exact(sys.argv[2]), "copy": lambda: copy(sys.argv[2]),
     "launches": lambda: launches(sys.argv[2], sys.argv[3]),
     "mixed": lambda: mixed(sys.argv[2], sys.argv[3]), "startup": lambda: startup(sys.argv[2], sys.argv[3]),
     "nocompile": lambda: nocompile(sys.argv[2], sys.argv[3], sys.argv[4])}[sys.argv[1]]()
