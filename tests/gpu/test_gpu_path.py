"""The GPU path, on a GPU (skipped without CUDA; the CPU suite tests the same code with stand-ins and
Triton's interpreter: tests/test_fused_sums.py): checksums computed on the device equal the CPU's bit for
bit, a staged snapshot's copies land in pinned slots with the device's sums (host-memory tensors copied
and summed by the host), nothing on the copy stream's path synchronizes, a fresh process's restore
compiles nothing, and the example trainer snapshots every iteration, is killed and restores from node
memory with its bytes checked on the device."""

import json
import os
import subprocess
import sys

import numpy
import pytest
import torch
from conftest import REPO

from megatron_pec.testing import launch

sys.path.insert(0, str(REPO / "tests" / "workers"))
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_device_sums_equal_the_cpu_sums_bit_for_bit():
    from megatron_pec.integrity.sum64 import DeviceSums, Sum64

    rng = numpy.random.default_rng(0)
    host = torch.from_numpy(rng.standard_normal(3 << 20).astype(numpy.float32))
    device = host.cuda()
    sums = DeviceSums(torch.cuda.current_device())
    sums.add("x", device[:1000], 0)
    sums.add("x", device[1001:], 4000)  # (4 bytes off 8-alignment in memory, the rest of the item)
    expected = Sum64().update(host[:1000].numpy().tobytes()).update(host[1001:].numpy().tobytes()).hexdigest()
    assert sums.digests(sums.result().cpu()) == {"x": expected}


def test_the_one_launch_kernel_equals_the_cpu_sums_bit_for_bit():
    """The compiled Triton kernel over every kind of run (the interpreter runs the same cases on CPU:
    tests/test_fused_sums.py), and the stock-operation fallback, against numpy over the same bytes (items
    without runs included: zeros, as the reference); a binding with runs on both sides sums each where it is."""
    from fused_sums import mixed_items

    from megatron_pec.integrity import sum64_kernel
    from megatron_pec.integrity.run_sums import (
        FusedRunSums,
        HostRunSums,
        KernelLoad,
        RunSums,
        SplitRunSums,
        StockRunSums,
    )

    host = mixed_items(11)
    device = {item: [(t.cuda(), offset) for t, offset in runs] for item, runs in host.items()}
    load = KernelLoad(torch.cuda.current_device())
    assert load.kernel() is sum64_kernel.chunk_sums, load.failure
    assert isinstance(RunSums.for_runs(device, load), FusedRunSums)
    mixed = {item: [(t if k % 2 else t.cuda(), offset) for k, (t, offset) in enumerate(runs)]
             for item, runs in host.items()}
    split = RunSums.for_runs(mixed, load)
    assert isinstance(split, SplitRunSums) and [type(p) for p in split.parts] == [FusedRunSums, HostRunSums]
    expected = HostRunSums(host, "cpu").start(list(host)).digests()
    for sums in (FusedRunSums(device, "cuda", sum64_kernel.chunk_sums), StockRunSums(device, "cuda"), split):
        for chosen in (list(host), ["L1.E2"], ["empty", "L1.E4"]):
            pending = sums.start(chosen)
            torch.cuda.synchronize()
            assert pending.digests() == {item: expected[item] for item in chosen}, type(sums).__name__


def _slot_files(directory, specs, regions=2):
    """Slot files as the engine makes them, in ``directory`` (under /dev/shm: CUDA page-locks a file mapping
    of tmpfs, and refuses one of a disk file system with "invalid argument")."""
    from megatron_pec.format.stformat import layout
    from megatron_pec.memory.slot_map import SlotMap
    from megatron_pec.memory.slots import SlotFiles

    entries = layout(specs)
    os.makedirs(directory, exist_ok=True)
    return SlotFiles(str(directory), 0, SlotMap.of(entries, regions), 1), entries


def _landed_sums(files, placed):
    from megatron_pec.integrity.sum64 import item_sums

    out = {}
    for item, slot in placed.items():
        out.update(item_sums(files.mapping(slot), files.item_header(slot, item), {item}))
    return out


@pytest.mark.parametrize("path", ["kernel", "copy engine"])
@pytest.mark.parametrize("moments", ["cuda", "cpu"])
def test_a_staged_snapshot_lands_in_pinned_slots_with_the_devices_sums(shm_dir, moments, path):
    """The dense state to home slot 1, an expert to a pool region, copied into page-locked node memory with
    the device's sums, by the checksum kernel's launch (where the GPU addresses the slots as the host does:
    this machine must) or by the copy engine; with the moments in host memory (before the first optimizer
    step: ``collect.stateless_views``), those are copied and summed by the host and the kernel reads device
    memory only. Nothing on the path synchronizes with the device (a new binding's table included)."""
    from megatron_pec.memory.slot_map import POOL
    from megatron_pec.save.stager import Stager

    specs = [(f"{item}/w.{kind}", torch.float32, n) for item, n in (("dense", 1 << 20), ("L1.E0", 12345))
             for kind in ("param", "exp_avg", "exp_avg_sq")]
    files, entries = _slot_files(shm_dir, specs)
    try:
        live = {e.name: torch.randn(e.numel, device="cuda" if e.name.endswith("param") else moments)
                for e in entries}
        slices = [type("S", (), {"name": e.name, "item": e.item})() for e in entries]
        stager = Stager(files, slices, 0)
        stager.pin()
        assert stager.pinning is not None and not stager.pinning.failed
        assert stager.kernel_copies, "the GPU does not address the page-locked slots at their host addresses"
        stager.kernel_copies = path == "kernel"
        assert stager.kernel.kernel() is not None, stager.kernel.failure  # (loaded at start-up)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # (any synchronizing call on the path raises)
        try:
            staging = stager.begin(live)
            staging.copy({"dense": 1})
            staging.copy({"L1.E0": POOL})
            staged = staging.finish()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert [len(stager.host_runs(item)) for item in ("dense", "L1.E0")] == ([0, 0] if moments == "cuda" else [2, 2])
        sums = staged.sums()
        assert staged.done()
        assert sums == _landed_sums(files, staging.placed)
        for e in entries:
            slot = 1 if e.item == "dense" else POOL
            assert torch.equal(files.item_views(slot, e.item)[e.name], live[e.name].cpu()), e.name
        assert staging.by_kernel is (path == "kernel")
        skipped = stager.begin(live)
        skipped.copy({"dense": 0})  # (a save skipped after its dense copy: close waits for it)
        stager.close()
        # (the kernel copies at the save's finish: a skipped save copied nothing)
        landed = torch.equal(files.views[0]["dense/w.param"], live["dense/w.param"].cpu())
        assert landed is (path == "copy engine")
    finally:
        files.close()


def test_a_fresh_processs_restore_compiles_nothing(tmp_path):
    """A fresh process: the kernel compiles and loads at start-up in a thread; the restore's check (a new
    binding: its table, one launch) and the save after it compile nothing and take milliseconds, not the
    0.7 s of a first compile."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "gpu_fresh_restore.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compiles_at_start"] >= 1 and result["compiles_after"] == 0, result
    assert result["sums_equal"], result
    assert result["restore_check_s"] < 0.2, result


def test_the_example_snapshots_every_iteration_and_restores_from_memory_on_the_gpu(tmp_path):
    """One GPU, one rank: a snapshot every iteration for 12 iterations with no snapshot skipped, killed in
    the optimizer step of 11, resumed: restores 10 from node memory, checked on the device."""
    script = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
    model = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--num-experts", "8",
             "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "2", "--disable-bias-linear",
             "--log-interval", "1", "--eval-iters", "1", "--lr-warmup-iters", "2"]
    ckpt = ["--save", str(tmp_path / "ck"), "--load", str(tmp_path / "ck"), "--save-interval", "100",
            "--non-persistent-save-interval", "1", "--pec-shm-dir", "/dev/shm/pec-gpu-test",
            "--pec-job-id", f"gpu{os.getpid()}", "--pec-wait-for-slot"]

    def run(*extra, env=None):
        job = launch.Launch(script, (*model, *ckpt, "--train-iters", "12", *extra))
        return launch.run(job, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=dict(os.environ, **(env or {})))

    killed = run("--metrics-file", str(tmp_path / "a.jsonl"), env={"MEGATRON_PEC_FAULT": "optimizer_step=kill@11"})
    assert killed.returncode != 0 and "fault injection: kill at optimizer_step" in killed.stdout + killed.stderr
    assert "skipped the snapshot" not in killed.stdout + killed.stderr
    resumed = run("--metrics-file", str(tmp_path / "b.jsonl"))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert "restored iteration 10 from memory" in out and "checked where they landed" in out, out[-4000:]
    losses = [json.loads(line) for line in open(tmp_path / "b.jsonl") if "lm loss" in line]
    assert losses and losses[0]["iteration"] == 11


def test_token_counts_reach_the_host_without_the_training_thread_waiting():
    """``TokenCounter.take`` on a device table: a non-blocking copy into page-locked memory behind the step
    that counted (the training thread does not wait), the table reset after it, the counts exact."""
    from megatron_pec.megatron.tokens import TokenCounter

    counter = TokenCounter([])
    counter._table = torch.zeros(3, 4, dtype=torch.int64, device="cuda")
    counter._table += torch.arange(12, device="cuda").reshape(3, 4)
    taken = counter.take()
    counter._table += 1  # (the next step's counts: after the copy, on the same stream)
    counts = taken.wait()
    assert counts.is_pinned() and counts.device.type == "cpu"
    assert counts.tolist() == torch.arange(12).reshape(3, 4).tolist()  # (read before the next take refills it)
    assert counter.take().wait().tolist() == [[1] * 4] * 3
    assert counter.take().wait() is counts  # (one page-locked buffer, refilled: no allocation per save)


def test_a_rank_file_lands_on_the_device_through_page_locked_buffers(tmp_path):
    """A restore from storage on a GPU rank: the file's tensors reach the device tensors through the ring
    of page-locked buffers (several passes through it), bit for bit, its crc32 checked as it is read; a
    tensor on the host lands directly."""
    import zlib

    from megatron_pec.format.protocol import RankFile
    from megatron_pec.format.stformat import encode_header, layout, read_header
    from megatron_pec.restore.landing import land_rank_file
    from megatron_pec.restore.read_ring import DeviceReadRing
    from megatron_pec.store.storage import PosixStorage

    specs = [("dense/a", torch.float32, 3 << 20), ("dense/b", torch.bfloat16, 1001), ("L1.E0/w", torch.float32, 77)]
    saved = {name: torch.randn(n).to(dtype) for name, dtype, n in specs}
    entries = layout(specs)
    head = encode_header(entries, {"iteration": "1"})
    data = b"".join(bytes(saved[e.name].view(torch.uint8).numpy()) for e in entries)
    path = tmp_path / "rank.safetensors"
    path.write_bytes(head + data)
    entry = RankFile(file="rank.safetensors", size=len(head) + len(data), crc32=zlib.crc32(head + data),
                     items=["dense", "L1.E0"], header_crc32=zlib.crc32(head))
    _, header = read_header(lambda o, n: PosixStorage().read_range(str(path), o, n), entry.size)
    live = {"dense/a": torch.zeros(3 << 20, device="cuda"), "dense/b": torch.zeros(1001, dtype=torch.bfloat16,
                                                                                     device="cuda"),
            "L1.E0/w": torch.zeros(77)}
    staging = DeviceReadRing(torch.device("cuda", torch.cuda.current_device()), buffers=2, buffer_bytes=1 << 20)
    landed, kept = land_rank_file(str(path), entry, header, PosixStorage(), live, staging)
    assert set(landed) == set(live) and not kept and staging.copies > 12
    for name, tensor in live.items():
        assert torch.equal(tensor.cpu(), saved[name]), name
