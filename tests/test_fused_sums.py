"""Issue 33: a snapshot's item checksums in one kernel launch. The Triton kernel (``sum64_kernel.py``)
over the chunk table (``chunks.py``) gives ``Sum64``'s values bit for bit, run here on CPU tensors by
Triton's interpreter (a fresh process with TRITON_INTERPRET=1: the interpreter must be chosen before
Triton is first imported); ``tests/gpu/`` runs the compiled kernel on CUDA. And what a snapshot
enqueues on the device does not grow with its runs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, WORKERS
from megatron_pec.chunks import CHUNK_BYTES, run_rows, unit_log2

pytest.importorskip("triton")


def interpreted(mode: str, *args: str) -> dict:
    out = args[0]
    proc = subprocess.run([sys.executable, str(WORKERS / "fused_sums.py"), mode, *args], capture_output=True,
                          text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_the_kernel_gives_sum64_bit_for_bit_in_the_interpreter(tmp_path):
    result = interpreted("exact", str(tmp_path / "exact.json"))
    assert result["unit_sizes"] == [0, 1, 2, 3], "every unit size (1, 2, 4, 8 bytes) must be exercised"
    for case in result["cases"]:
        assert case["fused"] == case["reference"], case["items"]
        assert case["stock"] == case["reference"], case["items"]
        assert set(case["fused"]) == set(case["items"])


def test_a_snapshot_enqueues_as_much_with_10_runs_as_with_10000(tmp_path):
    result = interpreted("launches", str(tmp_path / "launches.json"), str(tmp_path / "slots"))
    few, many = result["10"], result["10000"]
    assert few["copy_runs"] == 10 and many["copy_runs"] == 10_000, "the runs did not stay apart"
    assert few["kernel_launches"] == many["kernel_launches"] == 1
    assert few["torch_ops"] == many["torch_ops"], (few["torch_ops"], many["torch_ops"])
    assert sum("_foreach_copy_" in op for op in many["torch_ops"]) == 2  # (the dense state, then the experts)


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
    from megatron_pec.chunks import ChunkTable

    a, b = torch.zeros(4), torch.zeros(5, dtype=torch.float64)  # (whole words: a row each)
    table = ChunkTable({"x": [(a, 0)], "none": [], "y": [(b, 0), (a, 40)]})
    assert table.first_row == [0, 1, 1, 3]
    import numpy
    partials = numpy.array([[1, 2], [3, 4], [5, -1]], dtype=numpy.int64)
    assert table.item_totals(partials).tolist() == [[1, 2], [0, 0], [8, 3]]


def test_the_kernel_compiles_for_the_gpus_users_train_on():
    """No GPU needed: Triton compiles the kernel to a cubin for an A100, an H100/H200 and a B200 (what a
    first snapshot on those GPUs would do), so a syntax or typing error cannot wait for a GPU to show."""
    import triton
    from triton.backends.compiler import GPUTarget

    from megatron_pec import sum64_kernel

    source = triton.compiler.ASTSource(
        fn=sum64_kernel.chunk_sums, signature={"table": "*i64", "partials": "*i64", "selected": "*u8",
                                               "BLOCK": "constexpr"}, constexprs={"BLOCK": sum64_kernel.BLOCK})
    for capability in (80, 90, 100):
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
        assert compiled.asm["cubin"], capability
