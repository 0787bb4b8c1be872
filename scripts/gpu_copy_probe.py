"""Does a snapshot's device-to-host copy delay the training step's own small copies, and can the GPU's cores
copy instead of its copy engine? (GPU only, torch and Triton, no Megatron; ~40 s)

Measures, on 1.8 GB of device memory copied into page-locked node memory (a /dev/shm mapping registered
with cudaHostRegister, as the stager's slots are):

1. the copy engine: the copy's time, and how long a small ``.item()`` on the default stream takes while the
   copy runs on a side stream, enqueued at once or in waves of 32 MB (two queued);
2. a copy by a Triton kernel on a few of the GPU's cores (stores to the mapping's device address): its time
   by grid size, the ``.item()`` latency while it runs, and how much it slows a matmul loop beside it.

    python3 scripts/gpu_copy_probe.py      # on the GPU machine
"""
import ctypes
import mmap
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

TOTAL = int(os.environ.get("PROBE_BYTES", str(1822 << 20)))
WAVE = 32 << 20


@triton.jit
def copy_words(src, dst_addr, n_words, GRID: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    dst = dst_addr.to(tl.pointer_type(tl.int64))
    k = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(pid * BLOCK, n_words, GRID * BLOCK):
        at = start + k
        inside = at < n_words
        tl.store(dst + at, tl.load(src + at, mask=inside), mask=inside)


def registered_shm(nbytes: int):
    path = f"/dev/shm/pec_copy_probe_{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)
    host = torch.frombuffer(m, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0)
    assert int(getattr(err, "value", err)) == 0, err
    return m, host


def device_address(host_ptr: int) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64()
    rc = cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    assert rc == 0, f"cuMemHostGetDevicePointer rc {rc}"
    return out.value


def item_latency(samples: int, gap_s: float, during) -> list[float]:
    """ms of ``x.item()`` on the default stream, ``samples`` times, ``gap_s`` apart, while ``during()`` runs
    (started once before the first sample on its own stream)."""
    x = torch.ones(16, device="cuda")
    torch.cuda.synchronize()
    out = []
    during()
    for _ in range(samples):
        time.sleep(gap_s)
        t = time.perf_counter()
        (x * 2).sum().item()
        out.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return out


def main() -> int:
    torch.cuda.init()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    src = torch.randint(-2**62, 2**62, (TOTAL // 8,), dtype=torch.int64, device="cuda")
    m, host = registered_shm(TOTAL)
    dst64 = host.view(torch.int64)
    side = torch.cuda.Stream()
    print(f"{TOTAL / 2**20:.0f} MiB; can use host pointer: {device_address(host.data_ptr()) == host.data_ptr()}")

    def engine_copy(waves: bool):
        def go():
            with torch.cuda.stream(side):
                if not waves:
                    dst64.copy_(src, non_blocking=True)
                    return
                n = WAVE // 8
                for at in range(0, src.numel(), n):
                    dst64[at:at + n].copy_(src[at:at + n], non_blocking=True)
        return go

    def timed(fn, repeat=3):
        out = []
        for _ in range(repeat):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(side)
            fn()
            b.record(side)
            b.synchronize()
            out.append(a.elapsed_time(b))
        return statistics.median(out)

    idle = item_latency(20, 0.001, lambda: None)
    print(f"idle .item(): median {statistics.median(idle):.3f} ms, max {max(idle):.3f}")
    print(f"copy engine, one enqueue: {timed(engine_copy(False)):.1f} ms; in 32 MB waves (all enqueued): "
          f"{timed(engine_copy(True)):.1f} ms")
    for name, waves in (("one enqueue", False), ("32 MB waves all enqueued", True)):
        lat = item_latency(20, 0.0015, engine_copy(waves))
        print(f".item() during the copy engine's copy ({name}): first {lat[0]:.2f} ms, median "
              f"{statistics.median(lat):.3f}, max {max(lat):.2f}; samples {[round(v, 2) for v in lat[:12]]}",
              flush=True)
    dst_addr = device_address(host.data_ptr())
    for grid in (4, 8, 16, 32, 64, 132, 264):
        for block in (1024, 4096):
            def sm_copy(grid=grid, block=block):
                with torch.cuda.stream(side):
                    copy_words[(grid,)](src, dst_addr, src.numel(), GRID=grid, BLOCK=block)
            sm_copy()
            torch.cuda.synchronize()
            ms = timed(sm_copy)
            lat = item_latency(12, 0.0015, sm_copy)
            print(f"SM copy grid {grid:3d} block {block}: {ms:6.1f} ms ({TOTAL / ms / 1e6:5.1f} GB/s); .item() during "
                  f"it: median {statistics.median(lat):.3f} ms, max {max(lat):.2f}", flush=True)
    torch.cuda.synchronize()
    ok = torch.equal(dst64[:1 << 20], src[:1 << 20].cpu()) and torch.equal(dst64[-(1 << 20):], src[-(1 << 20):].cpu())
    print("SM copy bytes equal the source (first and last 8 MB):", ok)
    # a compute loop beside each copy: how much does the copy slow the step's kernels?
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def matmuls(n=60):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            a @ a
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    base = statistics.median(matmuls() for _ in range(3))
    print(f"60 bf16 4096^3 matmuls alone: {base:.1f} ms")
    runs = [("copy engine", engine_copy(False))] + [
        (f"SM copy grid {g}", lambda g=g: _launch(side, src, dst_addr, g)) for g in (8, 16, 32)]
    for name, go in runs:
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            go()
            times.append(matmuls())
        print(f"  beside {name}: {statistics.median(times):.1f} ms", flush=True)
    torch.cuda.cudart().cudaHostUnregister(host.data_ptr())

    return 0 if ok else 1


def _launch(stream, src, dst_addr, grid):
    with torch.cuda.stream(stream):
        copy_words[(grid,)](src, dst_addr, src.numel(), GRID=grid, BLOCK=4096)


if __name__ == "__main__":
    sys.exit(main())
