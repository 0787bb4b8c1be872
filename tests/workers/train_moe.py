"""Train the real megatron-core GPT-MoE (EP=2, DP=2) a few iterations; report losses and buffers."""

import torch
from common import example, report, setup


def main():
    args, model, optimizer, scheduler, data_from = setup(["--train-iters", "6"])
    data = data_from(0)
    losses = [example.train_step(args, model, optimizer, scheduler, data)[0] for _ in range(args.train_iters)]
    ddp = model[0]
    names = {p: n for n, p in ddp.named_parameters()}
    dense = sorted(names[p] for b in ddp.buffers for p in b.params)
    expert = sorted(names[p] for b in ddp.expert_parallel_buffers for p in b.params)
    digest = lambda ns: float(sum(dict(ddp.named_parameters())[n].double().sum() for n in ns))
    report("train", {"losses": losses, "dense_buffer_params": dense, "expert_buffer_params": expert,
                     "dense_sum": digest(dense), "expert_sum": digest(expert),
                     "chained": [type(o).__name__ for o in optimizer.chained_optimizers]})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
