"""State parity against Megatron itself with Transformer Engine and FP8 , on a GPU.

The check of ``tests/test_state_parity.py`` (save the same iteration through megatron-pec and through
Megatron-LM's own ``torch_dist`` save, restore each in a fresh process, dump the whole state right after the
load, compare key by key) with ``--transformer-impl transformer_engine --bf16 --fp8-format hybrid
--fp8-recipe delayed``: every TE module's ``_extra_state`` (its FP8 amax history and scales, TE's own pickle
in a uint8 tensor) is compared as bytes, besides the probe's frozen parameter and extra state. One rank per
GPU, at most two (EP = number of ranks). Skipped without CUDA, without Transformer Engine or without FP8
support on the device.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess

import pytest
import torch
from conftest import REPO

from megatron_pec.testing import megatron_lm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fp8_unsupported() -> str | None:
    try:
        importlib.import_module("transformer_engine.pytorch")
    except ImportError as exc:
        return f"needs Transformer Engine ({exc})"
    try:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    except ImportError:  # (moved in some release): FP8 needs compute capability 8.9 or newer
        capability = torch.cuda.get_device_capability()
        return None if capability >= (8, 9) else f"no FP8 on compute capability {capability}"
    supported, reason = check_fp8_support()
    return None if supported else f"no FP8 on this device: {reason}"


def moe_padding_flag(tree) -> list[str]:
    """The flag that pads each expert's tokens to what FP8 GEMMs need (renamed between releases)."""
    # (the flags are made from TransformerConfig's fields)
    text = (tree / "megatron" / "core" / "transformer" / "transformer_config.py").read_text()
    for field in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
        if f"{field}:" in text:
            return ["--" + field.replace("_", "-")]
    pytest.skip(f"{tree.name}: no MoE router padding flag for FP8")


@pytest.fixture(params=[megatron_lm.OLDEST, megatron_lm.NEWEST])
def trees(request, tmp_path):
    why = fp8_unsupported()
    if why:
        pytest.skip(why)
    tag = request.param
    pristine = megatron_lm.pristine_tree(tag)
    if pristine is None or shutil.which("git") is None:
        pytest.skip(f"needs git and the archive Megatron-LM-{tag}.tar.gz")
    patched = megatron_lm.copy_tree(tag, tmp_path / f"Megatron-LM-{tag}")
    applied = subprocess.run([str(REPO / "patches" / "apply.sh"), str(patched)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    return pristine, patched


def test_megatron_lm_restore_with_fp8_equals_megatrons_own(trees, tmp_path):
    import test_state_parity as parity

    pristine, patched = trees
    nproc = min(2, torch.cuda.device_count())
    model = []
    cpu_only = {"--transformer-impl", "--distributed-backend", "--expert-model-parallel-size", "--fp16",
                "--initial-loss-scale", "--loss-scale-window"}
    args = iter(parity.MODEL)
    for arg in args:
        if arg in cpu_only:
            if arg != "--fp16":
                next(args)
            continue
        model.append(arg)
    model += ["--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe",
              "delayed", "--expert-model-parallel-size", str(nproc), *moe_padding_flag(pristine)]
    micro_batches = 4 // (2 * nproc)  # --global-batch-size 4, --micro-batch-size 2, data parallel = nproc
    # TE >= 2.18 unpickles delayed-scaling extra state only when allowed (Megatron's own load asks the same)
    env = {"NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    found = parity.megatron_lm_parity(pristine, patched, tmp_path, model, steps=parity.ITERATION * micro_batches,
                                      nproc=nproc, env=env)
    extra = [k for k in parity.state_dump.read(tmp_path / "live", 0)[0] if k.endswith("._extra_state")]
    assert len(extra) > 1, extra  # TE's modules carry FP8 state, not only the probe
    assert not found, parity.report(found.get("", {}), "megatron-pec's restore (Transformer Engine, FP8) against "
                                                      "Megatron-LM's own")
