"""Router token counts over a few training steps, as the engine takes them; argv: [example flags].
Reports this rank's counts per MoE layer and the tokens it routed."""

import sys

import torch
from common import report, setup
from roundtrip import train

from megatron_pec.megatron.tokens import TokenCounter

STEPS = 2


def main():
    args, model, optimizer, scheduler, data_from = setup(["--train-iters", "20"] + sys.argv[1:])
    counter = TokenCounter(model)
    train(args, model, optimizer, scheduler, data_from(0), STEPS)
    counts = counter.take().wait().tolist()
    routed = STEPS * args.global_batch_size // args.data_parallel_size * args.seq_length * args.moe_router_topk
    report("token_counts", {"counts": counts, "routed_per_layer": routed})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
