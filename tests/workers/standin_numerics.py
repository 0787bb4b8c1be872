"""Loss of a megatron-core transformer MLP forward/backward in one process, with or without the CPU stand-ins.

Usage: python standin_numerics.py {with,without}; prints the loss and a gradient digest as JSON.
"""

import json
import os
import sys

import torch

if sys.argv[1] == "with":
    from megatron_pec.testing import cpu

    cpu.activate()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
from megatron.core import parallel_state  # noqa: E402 (after the set-up above)
from megatron.core.transformer import TransformerConfig  # noqa: E402 (after the set-up above)
from megatron.core.transformer.moe import moe_utils  # noqa: E402 (after the set-up above)

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # the 0.16.1 NameError without TE; not a CUDA call
parallel_state.initialize_model_parallel(1, 1)
torch.manual_seed(0)
config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                           moe_router_topk=2, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
                           params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                           bias_dropout_fusion=False, gradient_accumulation_fusion=False)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402 (after the set-up above)
from megatron.core.transformer.mlp import MLP, MLPSubmodules  # noqa: E402 (after the set-up above)

# A megatron-core transformer MLP runs on CPU without any CUDA call.
# (built from its parts: megatron-core 0.19's layer spec holds a factory where 0.16's holds a ModuleSpec)
layer = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
hidden = torch.randn(16, 2, 32, requires_grad=True)
output, bias = layer(hidden)
loss = (output if bias is None else output + bias).float().pow(2).mean()
loss.backward()
grad = sum(float(p.grad.double().sum()) for p in layer.parameters() if p.grad is not None)
print(json.dumps({"loss": loss.item(), "grad": grad}))
