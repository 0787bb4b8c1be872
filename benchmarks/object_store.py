"""Persists and restores on an S3 object store against what the store itself allows -
``benchmarks/results/object_store.md``.

    python -m benchmarks.object_store              # a 256 MB state, 3 rounds, ~2 minutes on 2 CPU cores
    python -m benchmarks.object_store --mb 64 --rounds 1

A SeaweedFS started by ``megatron_pec.testing.s3_server`` (the tests' server, on this machine's disk),
reached through the MSC profile the tests use. For one state of random bytes:

* put floor: a plain multipart upload of the bytes through the boto3 client of the MSC profile (the one
  ``msc_storage`` uses), parts of ``PART`` bytes ``IN_FLIGHT`` at a time, the parts sliced beforehand;
* get floor: plain ranged GETs of the object, as many at once, into one buffer;
* persist: ``MscStorage.write`` of the bytes streamed in the persist's chunks (``agent/persist.CHUNK``
  memoryviews: the copy into parts and the crc32 as a persist pays them);
* restore: ``MscStorage.read_checked`` of the object (ranged reads and the crc32 a restore checks).

The target: a persist of at least 80% of the put floor and a restore of at least 80% of the get floor.
One unmeasured upload first (SeaweedFS grows its volumes at the first writes); then rounds alternate the
methods (a slow moment of the shared machine hits each alike); the best round counts.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import object_store_e2e
from benchmarks.common import RESULTS, loadavg, machine
from megatron_pec.agent.persist import CHUNK
from megatron_pec.store import msc_storage
from megatron_pec.store.msc_storage import MscStorage
from megatron_pec.testing import s3_server

TARGET = 0.80  # of the floor: what a checkpointer that streams its bytes should keep


def put_floor(s3, bucket: str, key: str, parts: list[bytes]) -> None:
    """The store's own multipart upload: nothing summed, nothing copied (``parts`` sliced before)."""
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

    def one(number: int) -> dict:
        r = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=parts[number - 1])
        return {"PartNumber": number, "ETag": r["ETag"]}

    with ThreadPoolExecutor(msc_storage.IN_FLIGHT) as pool:
        done = list(pool.map(one, range(1, len(parts) + 1)))
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": done})


def get_floor(s3, bucket: str, key: str, size: int) -> memoryview:
    """The store's own ranged GETs, ``IN_FLIGHT`` at once, each straight into its place in one buffer."""
    import numpy

    buf = memoryview(numpy.empty(size, dtype=numpy.uint8))
    part = msc_storage.PART

    def one(o: int) -> None:
        body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={o}-{min(o + part, size) - 1}")["Body"]
        at = o
        while at < min(o + part, size):
            got = body.readinto(buf[at:min(o + part, size)]) if hasattr(body, "readinto") else None
            if got is None:  # (botocore's StreamingBody has no readinto: read and place)
                data = body.read()
                buf[at:at + len(data)] = data
                got = len(data)
            if not got:
                raise OSError(f"{key}: short range at {o}")
            at += got

    with ThreadPoolExecutor(msc_storage.IN_FLIGHT) as pool:
        list(pool.map(one, range(0, size, part)))
    return buf


def persist(storage: MscStorage, url: str, state: memoryview) -> None:
    """As a persist writes a rank file: ``CHUNK``-byte memoryviews of node memory, handed one by one."""
    storage.write(url, (state[o:o + CHUNK] for o in range(0, len(state), CHUNK)))


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(mb: int, rounds: int, end_to_end: bool = False, log=print) -> tuple[dict, dict | None]:
    """Every method ``rounds`` times against one fresh SeaweedFS: seconds per round of each; and, asked,
    the example trainer's persist and restore on the same server (``object_store_e2e``)."""
    import numpy

    why = s3_server.missing()
    if why:
        raise SystemExit(f"no S3 server: {why}")
    size = mb << 20
    state = memoryview(numpy.random.default_rng(0).integers(0, 256, size, dtype=numpy.uint8)).cast("B")
    parts = [bytes(state[o:o + msc_storage.PART]) for o in range(0, size, msc_storage.PART)]
    with tempfile.TemporaryDirectory(prefix="bench-s3-", dir="/tmp") as tmp:
        server = s3_server.S3Server(Path(tmp) / "data").start()
        previous = os.environ.get("MSC_CONFIG")
        try:
            os.environ["MSC_CONFIG"] = str(server.msc_config(Path(tmp) / "msc.yaml"))  # (the trainers' too)
            storage = MscStorage(f"msc://{s3_server.PROFILE}")
            seconds = _rounds(storage, state, parts, rounds, log)
            del state, parts  # (the trainers' memory)
            e2e = object_store_e2e.run(f"msc://{s3_server.PROFILE}/e2e", storage, log) if end_to_end else None
            if e2e is not None:
                e2e["rank_files_get_floor_s"] = min(_files_get_floor(storage, e2e["rank_files"]) for _ in range(3))
            return seconds, e2e
        finally:
            server.stop()
            os.environ.pop("MSC_CONFIG", None)
            if previous is not None:
                os.environ["MSC_CONFIG"] = previous


def _rounds(storage: MscStorage, state: memoryview, parts: list[bytes], rounds: int, log) -> dict:
    url = f"msc://{s3_server.PROFILE}/bench/state"
    provider, key = storage._provider(url)
    s3 = provider._s3_client  # (the profile's boto3 client, as msc_storage reaches it)
    bucket, full = storage._bucket_key(provider, key)
    floor_key = full + ".floor"
    size = len(state)
    expected = msc_storage.crc32(state)
    seconds: dict[str, list[float]] = {"put floor": [], "persist (MscStorage.write)": [], "get floor": [],
                                       "restore (MscStorage.read_checked)": []}
    put_floor(s3, bucket, floor_key, parts)  # (warm-up: SeaweedFS grows its volumes at the first writes)
    s3.delete_object(Bucket=bucket, Key=floor_key)
    for r in range(rounds):
        seconds["put floor"].append(timed(lambda: put_floor(s3, bucket, floor_key, parts)))
        seconds["persist (MscStorage.write)"].append(timed(lambda: persist(storage, url, state)))
        got = {}
        seconds["get floor"].append(timed(lambda got=got: got.update(floor=get_floor(s3, bucket, floor_key, size))))
        seconds["restore (MscStorage.read_checked)"].append(
            timed(lambda got=got: got.update(restore=storage.read_checked(url))))
        assert bytes(got["floor"]) == bytes(state) and got["restore"][1] == expected, "bytes read back differ"
        s3.delete_object(Bucket=bucket, Key=floor_key)
        storage.delete(url)
        log(f"[bench] round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in seconds.items()))
    return seconds


def _files_get_floor(storage: MscStorage, urls: list[str]) -> float:
    """Seconds of the get floor of every file in ``urls``, one after the other (a restore's own files)."""
    start = time.perf_counter()
    for url in urls:
        provider, key = storage._provider(url)
        get_floor(provider._s3_client, *storage._bucket_key(provider, key), storage.size(url))
    return time.perf_counter() - start


def summarize(seconds: dict[str, list[float]], size: int) -> dict:
    """MB/s of each method's best round, and each megatron-pec path against its floor."""
    best = {k: min(v) for k, v in seconds.items()}
    mbs = {k: size / 1e6 / s for k, s in best.items()}
    ratios = {"persist / put floor": mbs["persist (MscStorage.write)"] / mbs["put floor"],
              "restore / get floor": mbs["restore (MscStorage.read_checked)"] / mbs["get floor"]}
    return {"best_s": best, "mb_per_s": mbs, "ratios": ratios,
            "meets_target": all(v >= TARGET for v in ratios.values())}


def markdown(result: dict) -> str:
    s = result["summary"]
    floors = {"persist (MscStorage.write)": "put floor", "restore (MscStorage.read_checked)": "get floor"}
    lines = ["# megatron-pec on an S3 object store (SeaweedFS) against the store's floors", "",
             f"State: {result['mb']} MiB of random bytes; parts of {result['part_mib']} MiB, {result['in_flight']} "
             f"at once; best of {result['rounds']} rounds. Command: `{result['command']}`.", "",
             "| method | best s | MB/s | % of its floor |", "|---|---|---|---|"]
    for name, mb in s["mb_per_s"].items():
        floor = floors.get(name)
        share = f"{100 * mb / s['mb_per_s'][floor]:.0f}% of the {floor}" if floor else "(floor)"
        lines.append(f"| {name} | {s['best_s'][name]:.2f} | {mb:.0f} | {share} |")
    lines += ["", f"The target: at least {TARGET:.0%} of each floor: "
              f"{'met' if s['meets_target'] else 'NOT met'}.", "",
              f"Every round (s): `{json.dumps({k: [round(x, 3) for x in v] for k, v in result['seconds'].items()})}`",
              *_e2e_lines(result.get("end_to_end")),
              "", f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores; 1-min load before "
              f"{result['load_before']:.2f}. SeaweedFS on this machine's disk, over loopback.", ""]
    return "\n".join(lines)


def _e2e_lines(e2e: dict | None) -> list[str]:
    if e2e is None:
        return []
    return ["", "## End to end: the example trainer (2 CPU ranks, EP 2) persisting to msc:// and restoring from "
            "the store alone", "",
            f"Rank files {e2e['rank_file_bytes'] / 1e6:.0f} MB; the restore's \"reading and checking\" "
            f"{e2e['reading_and_checking_s']} s per rank: {e2e['restore_reading_mb_per_s']:.0f} MB/s over both ranks "
            f"= {e2e['of_get_floor']:.0%} of the get floor above, {e2e['of_rank_files_get_floor']:.0%} of the get "
            f"floor of these rank files ({e2e['rank_files_get_floor_s']:.3f} s for both, one after the other; the "
            "phase also checks every item's checksum, two ranks on the machine's cores beside the server). "
            f"Whole restore: {e2e['restore_s']} s per rank. Train {object_store_e2e.ITERS} iterations and commit: "
            f"{e2e['train_and_persist_s']} s.", "", *[f"    {line}" for line in e2e["restore_lines"]]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "object_store"), help="results path without suffix")
    parser.add_argument("--end-to-end", action="store_true", help="also the example trainer's persist and "
                        "restore from the store alone (a ~290 MB state; a few more minutes)")
    args = parser.parse_args(argv)
    load = loadavg()
    seconds, e2e = measure(args.mb, args.rounds, args.end_to_end)
    command = "python -m benchmarks.object_store" + "".join(
        f" --{k} {v}" for k, v in (("mb", args.mb), ("rounds", args.rounds)) if v != parser.get_default(k))
    summary = summarize(seconds, args.mb << 20)
    if e2e is not None:
        command += " --end-to-end"
        slowest = max(e2e["reading_and_checking_s"])
        e2e["restore_reading_mb_per_s"] = e2e["rank_file_bytes"] / 1e6 / slowest
        e2e["of_get_floor"] = e2e["restore_reading_mb_per_s"] / summary["mb_per_s"]["get floor"]
        e2e["of_rank_files_get_floor"] = e2e["rank_files_get_floor_s"] / slowest
    result = {"mb": args.mb, "rounds": args.rounds, "part_mib": msc_storage.PART >> 20,
              "in_flight": msc_storage.IN_FLIGHT, "chunk_bytes": CHUNK, "seconds": seconds, "summary": summary,
              "end_to_end": e2e, "load_before": load, "machine": machine(), "command": command}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
