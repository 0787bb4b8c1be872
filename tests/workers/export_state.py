"""Trains the small EP=2 model, commits iteration N, and writes this rank's live model state under
global names (computed here independently of megatron-pec) as safetensors, for the export test.

argv: SAVE_DIR SHM_DIR [extra example flags...]. With ``PEC_TEST_END=exit`` the save of N is a memory
snapshot and training then ends (what commits N is the planned exit).
"""

import re
import sys

import torch
from common import report, setup, train, write_safetensors

import megatron_pec
from megatron_pec import api

N = 4


def global_state(model) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, experts numbered by global id (EP rank * local experts + j)."""
    from megatron.core import parallel_state

    module = model[0]
    while hasattr(module, "module"):
        module = module.module
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    out = {}
    for name, tensor in module.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        match = re.search(r"local_experts\.(\d+)\.", name)
        if match:
            local = int(match.group(1))
            experts = module.decoder.layers[0].mlp.experts.num_local_experts
            name = name.replace(match.group(0), f"local_experts.{ep_rank * experts + local}.")
        out[name] = tensor.detach().cpu().contiguous()
    return out


def main():
    import os

    save, shm = sys.argv[1], sys.argv[2]
    args, model, optimizer, scheduler, data_from = setup(
        ["--train-iters", "20", "--save", save, "--load", save, "--pec-shm-dir", shm, "--pec-job-id", "export"]
        + sys.argv[3:])
    megatron_pec.load_checkpoint(model, optimizer, scheduler)
    data = data_from(0)
    at_exit = os.environ.get("PEC_TEST_END") == "exit"
    for i in range(1, N + 1):
        train(args, model, optimizer, scheduler, data, 1)
        megatron_pec.save_checkpoint(i, model, optimizer, scheduler, 0.0, non_persistent_ckpt=i != N or at_exit)
    if at_exit:
        api.reset()  # the end of training (atexit): returns once the agent has committed what it saved
    else:
        api.current_engine().flush()  # iteration N persisted and committed
    torch.distributed.barrier()
    rank = torch.distributed.get_rank()
    state = global_state(model)
    write_safetensors(os.path.join(os.environ["PEC_TEST_OUT"], f"live.rank{rank}.safetensors"), state)
    report("export_state", {"names": sorted(state)})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
