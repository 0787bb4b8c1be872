"""Issue 14: restore a persisted iteration onto another data-parallel size (real processes, real
megatron-core): 4 ranks (EP=2, DP=2) -> 2 ranks (EP=2) and 2 -> 4. Every restored optimizer shard equals
the saved one bit for bit in global coordinates; the weights equal ``export`` of the source iteration."""

import json
import shutil

import pytest
import torch

from conftest import torchrun
from megatron_pec.testing.cluster import run_megatron_pec
from test_export import read_safetensors

pytestmark = pytest.mark.multiprocess


def global_state(files) -> dict[tuple[str, str], torch.Tensor]:
    """(parameter, kind) -> its elements as the given ranks' shards hold them (gaps are an error)."""
    parts: dict[tuple[str, str], list] = {}
    for path in files:
        for key, tensor in read_safetensors(path).items():
            name, kind, lo = key.split("#")
            parts.setdefault((name, kind), []).append((int(lo), tensor))
    out = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        position, chunks = 0, []
        for lo, tensor in pieces:
            if lo < position:
                continue  # dense state: every data-parallel group holds it (a replica)
            assert lo == position, (key, lo, position)
            chunks.append(tensor)
            position += tensor.numel()
        out[key] = torch.cat(chunks)
    return out


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)], ids=["4to2", "2to4"])
def test_restore_onto_another_data_parallel_size(tmp_path, shm_dir, before, after):
    ckpt = tmp_path / "ckpt"
    env = {"PEC_TEST_OUT": str(tmp_path)}
    torchrun("reshard_state.py", str(ckpt), shm_dir, "a", "save", nproc=before, env=env, timeout=400)
    exported = run_megatron_pec("export", ckpt, tmp_path / "source")
    assert exported.returncode == 0, exported.stderr
    shutil.rmtree(shm_dir, ignore_errors=True)
    proc = torchrun("reshard_state.py", str(ckpt), shm_dir, "b", "restore", nproc=after, env=env, timeout=400)
    ranks = f"world {before} → {after}, EP 2 → 2, DP {before} → {after}"
    for rank in range(after):
        assert f"rank {rank}: restored iteration 4 from storage (resharded: {ranks})" in proc.stdout, proc.stdout

    saved = global_state(tmp_path / f"a.rank{r}.safetensors" for r in range(before))
    restored = global_state(tmp_path / f"b.rank{r}.safetensors" for r in range(after))
    assert sorted(saved) == sorted(restored)
    for key in saved:
        assert torch.equal(saved[key], restored[key]), key
    weights = read_safetensors(tmp_path / "source" / "model.safetensors")
    for (name, kind), tensor in restored.items():
        if kind == "param":
            assert torch.equal(weights[name].reshape(-1), tensor), name

    # Training continues where it stopped; the losses match the uninterrupted run up to the order of
    # the gradient reduction (another data-parallel size sums the micro-batches in another order).
    a = json.loads((tmp_path / "a.rank0.json").read_text())
    b = json.loads((tmp_path / "b.rank0.json").read_text())
    assert b["loaded"][0] == 4 and b["consumed"] == a["consumed"]
    for x, y in zip(a["losses"], b["losses"]):
        assert abs(x - y) < 1e-3 * abs(x), (a["losses"], b["losses"])
    print(f"losses after the resume: uninterrupted {a['losses']}, resharded {b['losses']}")
    # The new layout saves on and its commit stands alone (no reference into the old layout's files).
    verified = run_megatron_pec("verify", ckpt, "--iteration", "6")
    assert verified.returncode == 0, verified.stdout
