"""The node agent as a real process: persist, two-node commit, retention, inspect and verify.

No Megatron here: slots are filled with known bytes through the same SlotFiles the trainer uses.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from megatron_pec import manifest
from megatron_pec.agent.client import AgentClient, AgentUnavailable, agent_pid, check_socket_path, ensure_agent
from megatron_pec.agent.persist import item_checksums
from megatron_pec.slots import SlotFiles, node_dir, open_slot, read_index
from megatron_pec.sources import SourceError, storage_source
from megatron_pec.stformat import decode_header, layout
from megatron_pec.storage import PosixStorage

ENTRIES = layout([("dense/w.param", torch.float32, 256)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(4) for k in ("param", "exp_avg")])


def snapshot(files, client, slot, iteration, persist_items, root, node, nodes=2, keep=0,
             written=("dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3"), carry=None, persist=True, extra=None):
    for name, view in files.views[slot].items():
        if name.split("/")[0] in written:
            view.fill_(iteration + 0.5)
    items = {i: iteration for i in written}
    tokens = {f"L1.E{e}": 100 * iteration + e for e in range(4)}
    files.write_header(slot, {"state": "complete", "iteration": str(iteration), "items": json.dumps(items),
                              "format": manifest.FORMAT, "tokens": json.dumps(tokens), **(extra or {})})
    assert client.send({"type": "snapshot", "rank": node, "slot": slot, "iteration": iteration, "persist": persist,
                        "persist_items": persist_items, "save": root, "local_world_size": 1, "node_rank": node,
                        "num_nodes": nodes, "job_id": "t", "fingerprint": "f", "topology": {"ep": 2},
                        "keep": keep, "carry": carry})
    for _ in range(100):
        for msg in client.poll(block_s=0.2):
            if msg["type"] == "released" and msg["iteration"] == iteration:
                return msg
    raise AssertionError("no release from the agent")


@pytest.fixture
def nodes(shm_dir, tmp_path):
    out = []
    for node in (0, 1):
        directory = node_dir(shm_dir, "t", node)
        ensure_agent(directory, node, idle_timeout=60, keep_shm=False)
        client = AgentClient(directory, node)
        client.connect()
        out.append((SlotFiles(directory, node, ENTRIES, 1), client, directory))
    yield out
    for files, client, directory in out:
        files.close()
        client.send({"type": "stop"})


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_pec", *args], capture_output=True, text=True, cwd=REPO)


def test_two_nodes_commit_persist_subset_and_verify(nodes, tmp_path):
    root = str(tmp_path / "ckpt")
    (f0, c0, _), (f1, c1, _) = nodes
    snapshot(f0, c0, 0, 10, None, root, 0)
    assert not manifest.committed_iterations(root), "one node's marker must not commit"
    snapshot(f1, c1, 0, 10, None, root, 1)
    assert manifest.committed_iterations(root) == [10]
    for (f, c, _), node in ((nodes[0], 0), (nodes[1], 1)):
        assert "error" not in snapshot(f, c, 1, 20, ["L1.E1"], root, node)
    m = manifest.read_manifest(root, 20)
    assert m["ranks"]["0"]["items"] == ["L1.E1", "dense"]
    assert m["experts"] == {"L1.E0": 10, "L1.E1": 20, "L1.E2": 10, "L1.E3": 10}
    assert set(m["sources"]) == {"10"}
    full, partial = (os.path.getsize(manifest.rank_file(root, i, 0)) for i in (10, 20))
    assert partial < full / 2
    assert manifest.read_tracker(root) == "20"

    report = json.loads(cli("inspect", root, "--json").stdout)
    assert [it["committed"] for it in report["iterations"]] == [True, True]
    assert cli("verify", root).returncode == 0
    # A flipped byte in an older file that iteration 20 still references is caught.
    path = manifest.rank_file(root, 10, 1)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = cli("verify", root)
    assert result.returncode == 1 and "corrupt" in result.stdout


def test_partial_restore_reads_and_checks_only_the_experts_it_needs(nodes, tmp_path):
    """An older version's file is read for a few experts: the header and their byte ranges only,
    each against its own crc32 recorded in the manifest; damage elsewhere does not matter,
    damage in them is caught."""
    root = str(tmp_path / "ckpt")
    for (f, c, _), node in ((nodes[0], 0), (nodes[1], 1)):
        snapshot(f, c, 0, 10, None, root, node)
    entry = manifest.read_manifest(root, 10)["ranks"]["0"]
    assert set(entry["item_crc32"]) == {"dense", "L1.E0", "L1.E1", "L1.E2", "L1.E3"}
    path = os.path.join(root, entry["file"])
    with open(path, "rb") as f:
        header = decode_header(f.read(1 << 20), file_len=os.path.getsize(path))
    ranges = {e.item: (header.data_start + e.begin, header.data_start + e.end) for e in header.tensors}

    source = storage_source(root, 10, 0, entry)
    source.open(PosixStorage(), {"L1.E2"})
    assert source._buffer is None, "the whole file was read"
    assert all(float(t[0]) == 10.5 for t in source.tensors({"L1.E2/w.param", "L1.E2/w.exp_avg"}).values())
    with pytest.raises(SourceError, match="before being read"):
        source.tensors({"L1.E3/w.param"})

    def flip(offset):
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))

    flip(ranges["L1.E1"][0] + 5)
    fresh = storage_source(root, 10, 0, entry)
    fresh.open(PosixStorage(), {"L1.E2"})                       # untouched expert: still restorable
    with pytest.raises(SourceError, match="fails its checksum for L1.E1"):
        fresh.open(PosixStorage(), {"L1.E1"})
    with pytest.raises(SourceError, match="fails its checksum"):
        storage_source(root, 10, 0, entry).open(PosixStorage())  # a full read checks the whole file
    flip(ranges["L1.E1"][0] + 5)
    flip(20)                                                   # inside the header's JSON
    with pytest.raises(SourceError, match="header checksum"):
        storage_source(root, 10, 0, entry).open(PosixStorage(), {"L1.E2"})


def test_retention_keeps_referenced_versions(nodes, tmp_path):
    root = str(tmp_path / "ckpt")
    (f0, c0, _), (f1, c1, _) = nodes
    for slot, iteration in enumerate((10, 20, 30)):
        for (f, c, _), node in ((nodes[0], 0), (nodes[1], 1)):
            snapshot(f, c, slot, iteration, ["L1.E1"] if iteration > 10 else None, root, node, keep=1)
    # keep=1 retains 30, and 10 because experts E0/E2/E3 are still at version 10; 20 goes.
    assert manifest.iterations_on_disk(root) == [10, 30]
    assert cli("verify", root).returncode == 0


def test_agent_reports_failed_persist_and_keeps_serving(shm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_PEC_FAULT", "persist_write=enospc")  # the agent inherits it
    directory = node_dir(shm_dir, "t", 0)
    ensure_agent(directory, 0, idle_timeout=60, keep_shm=False)
    client = AgentClient(directory, 0)
    client.connect()
    files = SlotFiles(directory, 0, ENTRIES, 1)
    root = str(tmp_path / "ckpt")
    try:
        msg = snapshot(files, client, 0, 10, None, root, 0, nodes=1)
        assert "ENOSPC" in msg["error"] or "No space" in msg["error"]
        assert not manifest.committed_iterations(root)
        assert not [n for _, _, fs in os.walk(root) for n in fs if n.endswith(".safetensors")], "partial file left"
        assert agent_pid(directory) is not None
        assert "error" not in snapshot(files, client, 1, 20, None, root, 0, nodes=1)
        assert manifest.committed_iterations(root) == [20]
    finally:
        files.close()
        client.send({"type": "stop"})


def test_agent_carries_unwritten_experts_forward_at_the_expected_version(nodes, tmp_path):
    files, client, directory = nodes[0]
    root = str(tmp_path / "ckpt")
    snapshot(files, client, 0, 1, None, root, 0, persist=False)                  # every expert at 1
    carry = {"slot": 0, "iteration": 1, "items": {"L1.E1": 1, "L1.E2": 1, "L1.E3": 0}}
    assert "error" not in snapshot(files, client, 1, 2, None, root, 0, written=("dense", "L1.E0"), carry=carry,
                                   persist=False)
    record = read_index(directory)["0"]["1"]
    # E3 was expected at version 0, the base holds 1: never mix versions, leave it out.
    assert record["items"] == {"dense": 2, "L1.E0": 2, "L1.E1": 1, "L1.E2": 1}
    assert record["tokens"] == {"L1.E1": 101, "L1.E2": 102}
    views = files.views[1]
    assert float(views["L1.E1/w.param"][0]) == 1.5 and float(views["L1.E2/w.exp_avg"][-1]) == 1.5
    assert float(views["L1.E0/w.param"][0]) == 2.5
    mapping, header = open_slot(os.path.join(directory, "rank0.slot1"))
    try:
        assert item_checksums(mapping, header, set(record["items"])) == record["crcs"]
    finally:
        mapping.close()
    # Carried a second time, the tokens still name the version's counts, not the base's.
    carry = {"slot": 1, "iteration": 2, "items": {"L1.E1": 1, "L1.E2": 1}}
    snapshot(files, client, 2, 3, None, root, 0, written=("dense", "L1.E0"), carry=carry, persist=False)
    assert read_index(directory)["0"]["2"]["tokens"] == {"L1.E1": 101, "L1.E2": 102}
    # A base written for another --save (or job, or configuration) is never carried from.
    carry = {"slot": 2, "iteration": 3, "items": {"L1.E1": 1, "L1.E2": 1}}
    snapshot(files, client, 0, 4, None, root, 0, written=("dense", "L1.E0"), carry=carry, persist=False,
             extra={"save": "/elsewhere"})
    assert read_index(directory)["0"]["0"]["items"] == {"dense": 4, "L1.E0": 4}


def test_retire_removes_half_written_files_of_killed_agents(tmp_path):
    root = str(tmp_path)
    for i in (4, 8):
        d = tmp_path / f"iter_{i:07d}" / "pec"
        d.mkdir(parents=True)
        (d / "rank_00000.safetensors.tmp4242").write_bytes(b"half")
        (d / "rank_00001.safetensors").write_bytes(b"whole")
    manifest.retire_after(root, 4)
    left = sorted(p.name for p in tmp_path.rglob("rank_*"))
    assert left == ["rank_00001.safetensors", "rank_00001.safetensors"]


def test_too_long_socket_path_is_refused_with_the_fix():
    with pytest.raises(AgentUnavailable, match="use a shorter --pec-shm-dir or --pec-job-id"):
        check_socket_path("/dev/shm/" + "x" * 100)
    check_socket_path("/dev/shm/megatron_pec/job/node0")
