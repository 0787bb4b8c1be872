"""Where the time of each profiled step goes, from a trace of the example trainer's ``--profile`` (a Chrome
trace written by torch.profiler): per ProfilerStep, the training thread's waits for the GPU (synchronising
CUDA runtime calls, with the operator that made each), megatron-pec's ranges, the other threads' CUDA calls,
and per GPU stream its kernels' and copies' busy time.

    python3 scripts/gpu_trace_summary.py trace_rank0.json.gz [...]
"""
import gzip
import json
import sys
from collections import defaultdict

WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy", "cudaStreamWaitEvent")


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def inside(e: dict, start: float, end: float) -> bool:
    return start <= e["ts"] < end


def innermost_op(ops: list[dict], e: dict) -> str:
    best = None
    for op in ops:
        if op["ts"] <= e["ts"] and e["ts"] + e["dur"] <= op["ts"] + op["dur"] + 1:
            if best is None or op["dur"] < best["dur"]:
                best = op
    return best["name"] if best else "-"


def summary(events: list[dict]) -> list[str]:
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    out = []
    for step in steps:
        start, end, tid = step["ts"], step["ts"] + step["dur"], step["tid"]
        mine = [e for e in events if inside(e, start, end)]
        ops = [e for e in mine if e.get("tid") == tid and e.get("cat") in ("cpu_op", "user_annotation")]
        out.append(f"{step['name']}: {step['dur'] / 1e3:.1f} ms")
        waits = [e for e in mine if e.get("tid") == tid and e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and any(w in e["name"] for w in WAITS)]
        total = sum(e["dur"] for e in waits) / 1e3
        out.append(f"  training thread waits in CUDA calls: {total:.1f} ms in {len(waits)} calls; longest:")
        for e in sorted(waits, key=lambda e: -e["dur"])[:8]:
            out.append(f"    {e['dur'] / 1e3:7.2f} ms {e['name']} in {innermost_op(ops, e)} "
                       f"at +{(e['ts'] - start) / 1e3:.1f} ms")
        pec = defaultdict(float)
        for e in mine:
            if e["name"].startswith("megatron-pec"):
                pec[(e["name"], e.get("tid") == tid)] += e["dur"] / 1e3
        for (name, on_training), ms in sorted(pec.items(), key=lambda kv: -kv[1]):
            out.append(f"  {name}: {ms:.2f} ms ({'training thread' if on_training else 'another thread'})")
        threads = defaultdict(lambda: [0, 0.0])
        for e in mine:
            if e.get("tid") != tid and e.get("cat") in ("cuda_runtime", "cuda_driver"):
                threads[(e["tid"], e["name"])][0] += 1
                threads[(e["tid"], e["name"])][1] += e["dur"] / 1e3
        for (other, name), (n, ms) in sorted(threads.items(), key=lambda kv: -kv[1][1])[:6]:
            out.append(f"  thread {other}: {n} x {name}, {ms:.2f} ms")
        streams = defaultdict(lambda: {"kernel": 0.0, "memcpy": 0.0, "bytes": 0, "first": None, "last": 0.0})
        for e in mine:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                s = streams[e.get("args", {}).get("stream", e.get("tid"))]
                s["kernel" if e["cat"] == "kernel" else "memcpy"] += e["dur"] / 1e3
                s["bytes"] += e.get("args", {}).get("bytes", 0) if e["cat"] == "gpu_memcpy" else 0
                at = (e["ts"] - start) / 1e3
                s["first"] = at if s["first"] is None else min(s["first"], at)
                s["last"] = max(s["last"], at + e["dur"] / 1e3)
        for stream, s in sorted(streams.items(), key=lambda kv: str(kv[0])):
            out.append(f"  GPU stream {stream}: kernels {s['kernel']:.1f} ms, copies {s['memcpy']:.1f} ms "
                       f"({s['bytes'] / 2**20:.0f} MiB), busy from +{s['first']:.1f} to +{s['last']:.1f} ms")
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"== {path}")
        print("\n".join(summary(load(path))))
