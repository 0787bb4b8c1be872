"""Real megatron-core GPT-MoE + DDP + DistributedOptimizer trains on 2 gloo processes."""

import json

import pytest
from conftest import torchrun

pytestmark = pytest.mark.multiprocess


def test_gpt_moe_trains_with_separate_expert_buffers(tmp_path):
    torchrun("train_moe.py", env={"PEC_TEST_OUT": str(tmp_path)})
    ranks = [json.loads((tmp_path / f"train.rank{r}.json").read_text()) for r in (0, 1)]
    r0, r1 = ranks
    assert r0["losses"] == r1["losses"], "the data-parallel mean loss must agree on both ranks"
    assert r0["losses"][-1] < r0["losses"][0] - 0.3, f"loss did not fall: {r0['losses']}"
    # Experts and dense parameters live in separate DDP buffers.
    assert r0["expert_buffer_params"] and all("experts" in n for n in r0["expert_buffer_params"])
    assert not any("experts" in n for n in r0["dense_buffer_params"])
    # Distributed optimizer: a dense optimizer and an expert one, chained.
    assert r0["chained"] == ["DistributedOptimizer", "DistributedOptimizer"]
    # After the param all-gather every rank holds identical dense weights; each EP rank its own experts.
    assert r0["dense_sum"] == r1["dense_sum"]
    assert r0["expert_sum"] != r1["expert_sum"]


def test_megatron_cores_biased_expert_failure_is_a_message_with_the_fix(tmp_path):
    """The example with biased experts at EP = 1 hits megatron-core's in-place bias update on an
    autograd view (0.16.1 on CPU, 0.19.2 on GPU); the user reads what to pass, not a traceback."""
    from conftest import REPO

    script = str(REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py")
    proc = torchrun(script, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
                    "--num-experts", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size",
                    "4", "--train-iters", "2", "--expert-model-parallel-size", "1", check=False, timeout=180)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:  # a megatron-core release that trains biased experts: nothing to explain
        pytest.skip("this megatron-core trains biased experts at EP = 1")
    assert "pass --disable-bias-linear" in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
