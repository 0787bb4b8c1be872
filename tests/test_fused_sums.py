"""A snapshot's item checksums in one kernel launch. The Triton kernel (``integrity/sum64_kernel.py``)
over the chunk table (``integrity/chunk_table.py``) gives ``Sum64``'s values bit for bit, run here on CPU tensors by
Triton's interpreter (a fresh process with TRITON_INTERPRET=1: the interpreter must be chosen before
Triton is first imported); ``tests/gpu/`` runs the compiled kernel on CUDA. And what a snapshot
enqueues on the device does not grow with its runs.

The branches of the GPU path that need no device: the kernel is compiled and loaded at
start-up in a thread, so a fresh process's restore compiles nothing; a Triton that cannot compile falls
back to the stock operations with one log line, before any save; only device memory goes to the kernel
(tensors in host memory are copied and summed by the host, a mixed snapshot is bit-exact); close waits
for every copy it enqueued, on blocking events."""

import json
import os
import subprocess
import sys

import numpy
import pytest
import torch
from conftest import REPO, WORKERS

from megatron_pec.integrity.chunk_table import CHUNK_BYTES, run_rows, table_rows, unit_log2

pytestmark = pytest.mark.megatron_free

pytest.importorskip("triton")


def interpreted(mode: str, *args: str, stderr: list | None = None) -> dict:
    out = args[0]
    proc = subprocess.run([sys.executable, str(WORKERS / "fused_sums.py"), mode, *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    with open(out) as f:
        return json.load(f)


def test_the_kernel_gives_sum64_bit_for_bit_in_the_interpreter(tmp_path):
    result = interpreted("exact", str(tmp_path / "exact.json"))
    assert result["unit_sizes"] == [0, 1, 2, 3], "every unit size (1, 2, 4, 8 bytes) must be exercised"
    for case in result["cases"]:
        assert case["fused"] == case["reference"], case["items"]
        assert case["stock"] == case["reference"], case["items"]
        assert set(case["fused"]) == set(case["items"])


def test_the_kernels_copy_lands_every_selected_byte_and_nothing_else_with_the_same_sums(tmp_path):
    """A snapshot's launch also copies (the copy engine then carries none of it): every unit it sums
    is stored at its destination, for runs of every alignment and unit size; items not selected are not
    copied; the sums equal those of the launch that only sums; a destination misaligned for its run's units
    is refused (None), nothing launched."""
    result = interpreted("copy", str(tmp_path / "copy.json"))
    assert result["unit_sizes"] == [0, 1, 2, 3]
    for case in result["cases"]:
        assert case["copied"] == case["items"], case
        assert case["untouched"], case
        assert case["sums"] == case["reference"], case
    assert result["misaligned"] is None and result["misaligned_launches"] == 0


def test_a_snapshot_enqueues_as_much_with_10_runs_as_with_10000(tmp_path):
    result = interpreted("launches", str(tmp_path / "launches.json"), str(tmp_path / "slots"))
    for path in ("", " by kernel"):
        few, many = result[f"10{path}"], result[f"10000{path}"]
        assert few["copy_runs"] == 10 and many["copy_runs"] == 10_000, "the runs did not stay apart"
        assert few["kernel_launches"] == many["kernel_launches"] == 1
        for thread in ("training_thread_ops", "enqueue_thread_ops"):
            assert few[thread] == many[thread], (path, thread, few[thread], many[thread])
        assert not any("_foreach_copy_" in op for op in many["training_thread_ops"])
    # the copy engine's copies (the dense state, then the experts) are issued off the training thread (one
    # cudaMemcpyAsync per run: 1.8 ms at the example's 229 runs on an H200); by the kernel, none: its launch
    # copies them
    assert sum("_foreach_copy_" in op for op in result["10000"]["enqueue_thread_ops"]) == 2
    assert not any("_foreach_copy_" in op for op in result["10000 by kernel"]["enqueue_thread_ops"])
    # nor does the training thread pair the runs the kernel copies (their views are the enqueue thread's)
    assert result["10000 by kernel"]["training_thread_views"] == 0
    assert result["10000"]["training_thread_views"] == 2


@pytest.mark.parametrize("addr,pos,log2", [(0, 0, 3), (4, 0, 2), (8, 4, 2), (2, 0, 1), (6, 4, 1), (1, 0, 0),
                                           (16, 13, 0)])
def test_the_unit_is_the_widest_aligned_in_memory_and_in_the_item(addr, pos, log2):
    assert unit_log2(addr, pos) == log2


def test_a_run_is_cut_into_a_head_chunks_and_a_tail_that_cover_it_once():
    addr, nbytes, pos = 1000, 3 * CHUNK_BYTES + 13, 5  # (addr - pos) % 8 == 3: single bytes
    rows = run_rows(addr, nbytes, pos, 7)
    assert [r[3] for r in rows] == [0] * len(rows) and all(r[4] == 7 for r in rows)
    rows = run_rows(4096 + 4, nbytes, 4, 2)  # whole words after a 4-byte head
    assert rows[0][1:4] == (4, 4, 0) and rows[1][3] == 3 and rows[1][2] % 8 == 0
    covered = [(r[0] - (4096 + 4), r[1]) for r in rows]
    assert covered[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:]))
    assert sum(n for _, n in covered) == nbytes and max(n for _, n in covered) <= CHUNK_BYTES


def test_rows_group_by_item_and_partials_add_up_per_item():
    from megatron_pec.integrity.chunk_table import ChunkTable

    a, b = torch.zeros(4), torch.zeros(5, dtype=torch.float64)  # (whole words: a row each)
    table = ChunkTable({"x": [(a, 0)], "none": [], "y": [(b, 0), (a, 40)]})
    assert table.first_row == [0, 1, 1, 3]
    import numpy
    partials = numpy.array([[1, 2], [3, 4], [5, -1]], dtype=numpy.int64)
    assert table.item_totals(partials).tolist() == [[1, 2], [0, 0], [8, 3]]


def test_the_kernel_compiles_for_the_gpus_users_train_on():
    """No GPU needed: Triton compiles the kernel, both kinds of launch, to a cubin for an A100, an H100/H200
    and a B200 (what a first snapshot on those GPUs would do), so a syntax or typing error cannot wait for a
    GPU to show."""
    import triton
    from triton.backends.compiler import GPUTarget

    from megatron_pec.integrity import sum64_kernel

    signature = {"table": "*i64", "partials": "*i64", "selected": "*u8", "deltas": "*i64", "rows": "i32",
                 "step": "i32", "BLOCK": "constexpr", "COPY": "constexpr"}
    for copy in (False, True):  # (the sums alone, a restore's check; the sums and a snapshot's copy)
        source = triton.compiler.ASTSource(fn=sum64_kernel.chunk_sums, signature=signature,
                                           constexprs={"BLOCK": sum64_kernel.BLOCK, "COPY": copy})
        for capability in (80, 90, 100):
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
            assert compiled.asm["cubin"], (copy, capability)


def test_the_table_of_every_run_at_once_equals_the_rows_run_by_run():
    """The binding's table is built with numpy over every run (ms at 10^5 runs): the same rows as ``run_rows``
    one run at a time, over runs of every alignment, size (head, chunks, tail) and item."""
    rng = numpy.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 25))
        addrs = rng.integers(0, 1 << 40, n)
        sizes = rng.integers(1, 3 * CHUNK_BYTES + 50, n) * (rng.random(n) < 0.5) + rng.integers(1, 40, n)
        positions, owners = rng.integers(0, 1 << 20, n), numpy.sort(rng.integers(0, 5, n))
        expected = [list(r) for a, b, p, o in zip(addrs, sizes, positions, owners)
                    for r in run_rows(int(a), int(b), int(p), int(o))]
        assert table_rows(addrs, sizes, positions, owners).tolist() == expected


class _Marked:
    def __init__(self, *tensors):
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}

    def __call__(self, tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.storages


def _items():
    sys.path.insert(0, str(WORKERS))
    from fused_sums import mixed_items

    return mixed_items(5)


def test_runs_are_summed_where_each_tensor_is_and_add_up_to_the_reference():
    """Item 4 without the interpreter: the kernel is chosen by each tensor's device, not the caller's. A
    binding with runs in device and host memory sums each part on its side (the device part here by the stock
    operations: no kernel loaded), and every item's sums equal numpy's over all its bytes; a binding with no
    device memory at all never touches a device path."""
    from megatron_pec.integrity.run_sums import HostRunSums, RunSums, SplitRunSums, StockRunSums, split_runs

    items = _items()
    marked = _Marked(*[t for runs in items.values() for k, (t, _) in enumerate(runs) if k % 3 == 0])
    device, host = split_runs(items, marked)
    assert all(marked(t) for runs in device.values() for t, _ in runs)
    assert not any(marked(t) for runs in host.values() for t, _ in runs)
    sums = RunSums.for_runs(items, None, marked)
    assert isinstance(sums, SplitRunSums) and [type(p) for p in sums.parts] == [StockRunSums, HostRunSums]
    reference = HostRunSums(items, "cpu")
    for chosen in (list(items), ["L1.E2"], ["empty", "L1.E4"]):
        assert sums.start(chosen).digests() == reference.start(chosen).digests()
    assert isinstance(RunSums.for_runs(items, None), HostRunSums)  # (CPU tensors: host memory)


def test_the_stock_fallback_gives_items_without_runs_the_references_sums():
    from megatron_pec.integrity.run_sums import HostRunSums, StockRunSums

    items = _items()
    chosen = ["empty", "L1.E1"]
    assert StockRunSums(items, "cpu").start(chosen).digests() == HostRunSums(items, "cpu").start(chosen).digests()


def test_a_kernel_that_cannot_be_compiled_leaves_the_stock_sums_and_never_raises():
    from megatron_pec.integrity.run_sums import KernelLoad, RunSums, StockRunSums

    def no_compiler(device):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    load = KernelLoad("cpu", load=no_compiler)
    assert load.kernel() is None and load.failure.startswith("RuntimeError: Failed to find C compiler")
    items = _items()
    assert isinstance(RunSums.for_runs(items, load, lambda t: True), StockRunSums)


def test_the_kernel_is_loaded_by_a_thread_at_start_up():
    import threading

    from megatron_pec.integrity.run_sums import KernelLoad

    seen, release = [], threading.Event()

    def load(device):
        seen.append(threading.current_thread().name)
        release.wait(10)
        return "kernel"

    started = KernelLoad("cpu", load=load)  # (returns at once: the caller's start-up goes on)
    release.set()
    assert started.kernel() == "kernel" and seen == ["megatron-pec kernel load"]


def test_importing_the_entry_points_starts_the_load_on_this_ranks_device_once():
    """A relaunched trainer restores right after Megatron's start-up: the load starts when training.py imports
    the entry points, on the device Megatron will pick (LOCAL_RANK modulo the devices), and the engine's ask
    later is the same load, not a second compile. Without CUDA nothing starts. (A fresh process with a
    stand-in for CUDA and for the load.)"""
    probe = """
import json, sys, torch
from megatron_pec.integrity import run_sums
started = []
run_sums.KernelLoad = lambda device: started.append(device) or object()
torch.cuda.is_available = lambda: sys.argv[1] == "cuda"
torch.cuda.device_count = lambda: 4
from megatron_pec import load_checkpoint  # (what training.py's patched import runs)
same = run_sums.kernel_load(2) is run_sums.kernel_load(2) if started else None
print(json.dumps({"started": started, "same": same}))
"""
    runs = {}
    for cuda in ("cuda", "cpu"):
        proc = subprocess.run([sys.executable, "-c", probe, cuda], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, LOCAL_RANK="6"), cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        runs[cuda] = json.loads(proc.stdout.splitlines()[-1])
    assert runs == {"cuda": {"started": [2], "same": True}, "cpu": {"started": [], "same": None}}


def test_a_fresh_processs_restore_compiles_nothing(tmp_path):
    """Item 2: in a fresh process the kernel's load (its compile on a GPU) starts when the stager is built (the
    engine's start-up), in its own thread; the restore's check on the device and the save after it start
    none, one launch each, with the right sums."""
    result = interpreted("startup", str(tmp_path / "startup.json"), str(tmp_path / "slots"))
    assert result["loads"] == [{"phase": "start", "thread": "megatron-pec kernel load"}]
    # (the load launches each kind once: the sums, the sums with a copy)
    assert result["launches"] == {"megatron-pec kernel load": 2, "restore in MainThread": 1,
                                  "megatron-pec copy enqueue_0": 1}  # (the save's: behind its copies)
    assert result["restored"] == result["saved"] == result["reference"]


@pytest.mark.parametrize("error", ["RuntimeError", "ImportError"])
def test_a_triton_that_cannot_compile_falls_back_at_start_up_with_one_line(tmp_path, error):
    """Item 3: the kernel's load raises (no C compiler; or no Triton): two engines (one rebuilt), each with a
    restore check and two saves: the stock-operation sums, right, no launch of the kernel, no exception, and
    one log line in all."""
    stderr = []
    result = interpreted("nocompile", str(tmp_path / "nocompile.json"), str(tmp_path / "slots"), error,
                         stderr=stderr)
    assert result["kinds"] == ["StockRunSums", "StockRunSums"] and result["launches"] == 0
    assert all(f.startswith(error) for f in result["failures"]) and result["restored"] == [True, True]
    assert len(result["saves"]) == 4 and all(s["sums"] == s["reference"] for s in result["saves"])
    assert stderr[0].count("the checksum kernel cannot be compiled here") == 1, stderr[0][-2000:]


def test_host_memory_is_copied_and_summed_by_the_host_and_a_mixed_snapshot_is_exact(tmp_path):
    """Item 4 through the interpreter: runs marked as device memory go to the kernel, the others (host tensors,
    as the moments before the first optimizer step) never do; a binding's digests and a staged snapshot of a
    mix (its bytes in node memory and its sums) equal the reference bit for bit."""
    result = interpreted("mixed", str(tmp_path / "mixed.json"), str(tmp_path / "slots"))
    split = result["split"]
    assert (split["kind"], split["parts"]) == ("SplitRunSums", ["FusedRunSums", "HostRunSums"])
    assert split["device_runs_marked"] and split["host_runs_unmarked"] and split["every_run_once"]
    assert split["both_sides"] and split["kernel_read_device"] and not split["kernel_read_host"]
    for case in split["cases"]:
        assert case["mixed"] == case["reference"], case["items"]
    for key, by_kernel in (("snapshot", False), ("snapshot_by_kernel", True)):
        snapshot = result[key]
        assert snapshot["by_kernel"] is by_kernel
        assert snapshot["host_runs"] == {"dense": 2, "L1.E0": 2, "L1.E1": 2}  # (each item's two moments)
        assert snapshot["landed"] and snapshot["sums"] == snapshot["reference"], key
        assert snapshot["launches"] == 1 and snapshot["kernel_read_device"] and not snapshot["kernel_read_host"]


class _Recorder:
    """torch.cuda's streams and events on CPU, recording what waits for what."""

    def __init__(self):
        self.log = []
        recorder = self

        class Event:
            count = 0

            def __init__(self, blocking=False, **kwargs):
                Event.count += 1
                self.name, self.blocking, self.recorded = f"event{Event.count}", blocking, False

            def record(self, stream=None):
                self.recorded = True
                recorder.log.append(("record", self.name, self.blocking))

            def synchronize(self):
                recorder.log.append(("wait", self.name, self.blocking))

            def query(self):
                return True

        class Stream:
            def __init__(self, *args, **kwargs):
                pass

            def wait_stream(self, other):
                pass

            def wait_event(self, event):
                pass

            def synchronize(self):
                recorder.log.append(("stream synchronize",))

        self.Event, self.Stream = Event, Stream


def test_close_waits_for_a_skipped_saves_copy_on_a_blocking_event_before_unpinning(tmp_path, monkeypatch):
    """Item 5: a save copies its dense state and is then skipped (no snapshot, no event of its own to wait
    for); closing the stager waits for that copy before it unregisters the page-locked memory (and the engine
    unmaps the slots after). Every wait is on a blocking event: the waiting thread sleeps, no core spins
    (the hand-over's wait for a snapshot's copies included)."""
    import contextlib

    from megatron_pec.format.stformat import layout
    from megatron_pec.integrity.run_sums import HostRunSums
    from megatron_pec.memory.slot_map import POOL, SlotMap
    from megatron_pec.memory.slots import SlotFiles
    from megatron_pec.save.stager import Stager

    recorder = _Recorder()
    monkeypatch.setattr(torch.cuda, "Event", recorder.Event)
    monkeypatch.setattr(torch.cuda, "Stream", recorder.Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: recorder.Stream())
    entries = layout([("dense/w.param", torch.float32, 100), ("L1.E0/w.param", torch.float32, 50)])
    files = SlotFiles(str(tmp_path), 0, SlotMap.of(entries, 2), 1)
    live = {e.name: torch.randn(e.numel) for e in entries}
    slices = [type("S", (), {"name": e.name, "item": e.item})() for e in entries]
    stager = Stager(files, slices, 0, asynchronous=True, is_device=lambda t: True,
                    sums_for=lambda runs: HostRunSums(runs, "cpu"))

    class Pinning:
        def unpin_all(self):
            recorder.log.append(("unpin",))

    stager.pinning = Pinning()
    staged = stager.begin(live)
    staged.copy({"dense": 1})
    staged.copy({"L1.E0": POOL})
    snapshot = staged.finish()
    snapshot.wait()  # (what the hand-over thread does)
    assert recorder.log[-1] == ("wait", recorder.log[-2][1], True)
    skipped = stager.begin(live)
    skipped.copy({"dense": 0})  # (the save is skipped now: no finish, no snapshot)
    stager.close()
    files.close()
    # the skipped copy: an event on the training stream (what the copy stream waits for), then, from the
    # enqueue thread, blocking events after its wave and after the copy: close waits for the last, then unpins
    produced = max(i for i, entry in enumerate(recorder.log) if entry[0] == "record" and not entry[2])
    after = recorder.log[produced + 1:-2]
    assert after and all(entry[0] == "record" and entry[2] for entry in after), recorder.log
    assert recorder.log[-2:] == [("wait", after[-1][1], True), ("unpin",)], recorder.log
    assert all(entry[2] for entry in recorder.log if entry[0] == "wait")
    assert ("stream synchronize",) not in recorder.log
