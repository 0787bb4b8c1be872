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
from megatron_pec.agent.client import AgentClient, agent_pid, ensure_agent
from megatron_pec.slots import SlotFiles, node_dir
from megatron_pec.stformat import layout

ENTRIES = layout([("dense/w.param", torch.float32, 256)]
                 + [(f"L1.E{e}/w.{k}", torch.float32, 128) for e in range(4) for k in ("param", "exp_avg")])


def snapshot(files, client, slot, iteration, persist_items, root, node, nodes=2, keep=0):
    for name, view in files.views[slot].items():
        view.fill_(iteration + 0.5)
    items = {"dense": iteration, **{f"L1.E{e}": iteration for e in range(4)}}
    files.write_header(slot, {"state": "complete", "iteration": str(iteration), "items": json.dumps(items),
                              "format": manifest.FORMAT})
    assert client.send({"type": "snapshot", "rank": node, "slot": slot, "iteration": iteration, "persist": True,
                        "persist_items": persist_items, "save": root, "local_world_size": 1, "node_rank": node,
                        "num_nodes": nodes, "job_id": "t", "fingerprint": "f", "topology": {"ep": 2},
                        "keep": keep})
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
