"""The GPU path, on a GPU (skipped without CUDA; the CPU suite tests the same code with stand-ins):
checksums computed on the device equal the CPU's bit for bit, a staged snapshot's copies land in pinned
slots with the device's sums, large mappings register in chunks, and the example trainer snapshots every
iteration, is killed and restores from node memory with its bytes checked on the device."""

import json
import os
import sys

import numpy
import pytest
import torch

from megatron_pec.testing import launch

from conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_device_sums_equal_the_cpu_sums_bit_for_bit():
    from megatron_pec.sum64 import DeviceSums, Sum64

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
    tests/test_fused_sums.py), and the stock-operation fallback, against numpy over the same bytes."""
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    from fused_sums import mixed_items

    from megatron_pec import sum64_kernel
    from megatron_pec.run_sums import FusedRunSums, HostRunSums, RunSums, StockRunSums

    host = mixed_items(11)
    device = {item: [(t.cuda(), offset) for t, offset in runs] for item, runs in host.items()}
    assert isinstance(RunSums.for_device(device, "cuda"), FusedRunSums)
    expected = HostRunSums(host, "cpu").start(list(host)).digests()
    for sums in (FusedRunSums(device, "cuda", sum64_kernel.chunk_sums), StockRunSums(device, "cuda")):
        for chosen in (list(host), ["L1.E2"]):
            pending = sums.start(chosen)
            torch.cuda.synchronize()
            assert pending.digests() == {item: expected[item] for item in chosen}, type(sums).__name__


def test_a_staged_snapshot_lands_in_pinned_slots_with_the_devices_sums(tmp_path):
    from megatron_pec.slots import SlotFiles
    from megatron_pec.stager import Stager
    from megatron_pec.stformat import layout
    from megatron_pec.sum64 import item_sums

    entries = layout([("dense/w.param", torch.float32, 1 << 20), ("L1.E0/w.param", torch.float32, 12345)])
    files = SlotFiles(str(tmp_path), 0, entries, 1)
    try:
        live = {e.name: torch.randn(e.numel, device="cuda") for e in entries}
        slices = [type("S", (), {"name": e.name, "item": e.item})() for e in entries]
        stager = Stager(files, slices, 0)
        stager.pin()
        assert stager.pinning is not None and not stager.pinning.failed
        staging = stager.begin(live)
        staging.copy({"dense": 1, "L1.E0": 1})
        staged = staging.finish()
        sums = staged.sums()
        assert staged.done()
        assert sums == item_sums(files.maps[1], files.header, {"dense", "L1.E0"})
        assert torch.equal(files.views[1]["dense/w.param"], live["dense/w.param"].cpu())
        stager.close()
    finally:
        files.close()


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
        return launch.run(job, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ, **(env or {})))

    killed = run("--metrics-file", str(tmp_path / "a.jsonl"), env={"MEGATRON_PEC_FAULT": "optimizer_step=kill@11"})
    assert killed.returncode != 0 and "fault injection: kill at optimizer_step" in killed.stdout + killed.stderr
    assert "skipped the snapshot" not in killed.stdout + killed.stderr
    resumed = run("--metrics-file", str(tmp_path / "b.jsonl"))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    assert "restored iteration 10 from memory" in out and "checking on the device" in out, out[-4000:]
    losses = [json.loads(line) for line in open(tmp_path / "b.jsonl") if "lm loss" in line]
    assert losses and losses[0]["iteration"] == 11
