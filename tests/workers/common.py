"""Helpers for worker scripts that run under torchrun inside the tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt_moe"))
sys.path.insert(0, str(REPO))

import pretrain_gpt_moe as example  # noqa: E402 (after the set-up above)

SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-experts", "8",
               "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--seq-length", "64",
               "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "2"]


def setup(extra: list[str]):
    """Megatron + model + optimizer + data, exactly as the example trainer builds them."""
    from byte_data import batches, build_datasets, default_data_prefix, ensure_stdlib_dataset
    from megatron.core import parallel_state

    import megatron_pec

    args = example.parse_args(SMALL_MODEL + extra)
    example.initialize(args)
    megatron_pec.use_args(args)
    args.data_path = default_data_prefix()
    if args.rank == 0:
        ensure_stdlib_dataset(args.data_path)
    import torch

    torch.distributed.barrier()
    model, optimizer, scheduler = example.setup_model_and_optimizer(args)
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    train_ds, _ = build_datasets(args.data_path, args.seq_length, args.seed, args.train_iters * args.global_batch_size,
                                 args.global_batch_size, args.split)

    def data_from(consumed: int):
        return batches(train_ds, consumed, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                       args.data_parallel_size)

    return args, model, optimizer, scheduler, data_from


def checkpoints(save: str):
    """The checkpoint directory ``save`` (a ``CheckpointDir`` on POSIX storage)."""
    from megatron_pec.store.checkpoint_dir import CheckpointDir
    from megatron_pec.store.storage import PosixStorage

    return CheckpointDir(save, PosixStorage())


def report(name: str, payload: dict) -> None:
    """Write this rank's results for the test to read."""
    import torch

    out = Path(os.environ["PEC_TEST_OUT"]) / f"{name}.rank{torch.distributed.get_rank()}.json"
    out.write_text(json.dumps(payload))


def train(args, model, optimizer, scheduler, data, n: int) -> list[float]:
    """``n`` training steps as the example trainer takes them; returns their losses."""
    losses = []
    for _ in range(n):
        losses.append(example.train_step(args, model, optimizer, scheduler, data)[0])
        args.consumed_train_samples += args.global_batch_size
    return losses


def write_safetensors(path, tensors: dict) -> None:
    """Tensors as a plain safetensors file (the tests read it back with their own reader)."""
    import torch

    codes = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
    body, offset, blobs = {}, 0, []
    for name, t in sorted(tensors.items()):
        raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        body[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(body).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
