"""Train a small GPT-MoE with real megatron-core, shaped like Megatron-LM's pretrain_gpt.py.

Run under torchrun. On a machine without a GPU the CPU stand-ins are activated
and the gloo backend is used. Checkpointing goes through exactly two functions
with Megatron-LM's ``save_checkpoint`` / ``load_checkpoint`` signatures, taken
from ``megatron_pec`` (the same swap the Megatron-LM patch makes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import megatron_pec  # noqa: E402 (after the set-up above)
from megatron_pec import load_checkpoint, save_checkpoint  # noqa: E402 (after the set-up above)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    g = p.add_argument_group("model (Megatron flag names)")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-experts", type=int, default=8)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in linear layers (megatron-core fails in the expert MLP's bias update with EP = 1 "
                        "otherwise: 0.16.1 on CPU, 0.19.2 on GPU)")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=2e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-style", default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=0, help="0 = validate only at the end")
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="activation recompute of whole layers (Megatron's flag; uniform, 1 layer per chunk)")
    g.add_argument("--data-path", default=None,
                   help="indexed dataset prefix; default: the standard library's text, built once")
    g.add_argument("--split", default="98,2,0")
    g.add_argument("--metrics-file", default=None,
                   help="append one JSON object per iteration (iteration, lm loss, save blocking s, PLT)")
    g = p.add_argument_group("checkpointing (Megatron flag names)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--non-persistent-save-interval", type=int, default=None)
    g.add_argument("--enable-msc", action="store_true",
                   help="(Megatron's flag, opt-in since core_v0.19.0) --save/--load may be msc://<profile>/<path>: "
                   "checkpoints on that object store through the Multi-Storage Client (profiles: MSC_CONFIG)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="exit when --load holds no checkpoint instead of starting from random weights")
    g.add_argument("--override-ckpt-iteration", type=int, default=None,
                   help="resume as if the loaded checkpoint were this iteration (consumed samples recomputed)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="fine-tune from this checkpoint when --load holds none (as Megatron does)")
    g = p.add_argument_group("profiling (Megatron flag names; the PyTorch profiler)")
    g.add_argument("--profile", action="store_true",
                   help="trace iterations [--profile-step-start, --profile-step-end) with torch.profiler, the saves "
                        "included, into --tensorboard-dir/trace_rank<r>.json.gz (Chrome trace format)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--tensorboard-dir", default=None, help="where --profile writes its traces (default: .)")
    megatron_pec.add_pec_args(p)
    args = p.parse_args(argv)
    if args.profile and not 0 <= args.profile_step_start < args.profile_step_end:
        p.error("--profile needs 0 <= --profile-step-start < --profile-step-end")
    if args.global_batch_size % args.micro_batch_size:
        p.error("--global-batch-size must be a multiple of --micro-batch-size")
    try:
        megatron_pec.config.PecConfig.from_args(args)
    except megatron_pec.config.PecConfigError as exc:
        p.error(str(exc))
    return args


def initialize(args) -> None:
    """Process group, model parallel groups, seeds (Megatron's initialize_megatron)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        from megatron_pec.testing import cpu

        cpu.activate()
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl"
    torch.distributed.init_process_group(backend=backend)
    world = torch.distributed.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=args.expert_model_parallel_size)
    args.rank, args.world_size = torch.distributed.get_rank(), world
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        raise SystemExit("error: --global-batch-size must be a multiple of micro batch size x data parallel size "
                         f"({args.micro_batch_size} x {args.data_parallel_size})")
    init_num_microbatches_calculator(args.rank, None, args.global_batch_size, args.micro_batch_size,
                                     args.data_parallel_size)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def transformer_config(args):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size or 4 * args.hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_pre_softmax=args.moe_router_topk == 1,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_token_dispatcher_type="allgather",  # alltoall's all_to_all_single fails on gloo
        expert_model_parallel_size=args.expert_model_parallel_size,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        recompute_granularity=args.recompute_granularity,
        recompute_method="uniform" if args.recompute_granularity else None,
        recompute_num_layers=1 if args.recompute_granularity else None,
    )


def model_provider(args, config):
    """GPTModel with MoE layers (SequentialMLP), wrapped in Megatron DDP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    vocab = 257
    padded_vocab = int(math.ceil(vocab / 128) * 128)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False),
        vocab_size=padded_vocab,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def optimizer_provider(args, ddp_model):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                        clip_grad=args.clip_grad, use_distributed_optimizer=True, params_dtype=torch.float32),
        [ddp_model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        # Megatron requires warmup < decay; a run shorter than the warmup just warms up less.
        lr_warmup_steps=min(args.lr_warmup_iters, args.train_iters - 1) * args.global_batch_size,
        lr_decay_steps=args.train_iters * args.global_batch_size, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant",
    )
    return optimizer, scheduler


def loss_func(loss_mask, output_tensor):
    """Megatron's GPT loss: summed token loss, token count, and the reported lm loss."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    if torch.cuda.is_available():  # (the data loader yields CPU tensors)
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def setup_model_and_optimizer(args):
    """Everything a checkpoint covers; also used by tests and benchmarks."""
    from megatron.core.distributed import finalize_model_grads

    config = transformer_config(args)
    ddp_model = model_provider(args, config)
    config.no_sync_func = ddp_model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = optimizer_provider(args, ddp_model)
    if os.environ.get("MEGATRON_PEC_FAULT"):
        # Fault point "optimizer_step": after the dense optimizer stepped, before the expert one.
        from megatron_pec.common import faults

        inner = getattr(optimizer, "chained_optimizers", [optimizer])[-1].optimizer
        inner.register_step_pre_hook(lambda *_: faults.point("optimizer_step"))
    return [ddp_model], optimizer, scheduler


def train_step(args, model, optimizer, scheduler, data_iterator, forward_only=False):
    """One global batch: forward/backward over micro-batches, optimizer step. Returns the DP-mean lm loss."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
    )
    grad_norm = None
    if not forward_only:
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=args.global_batch_size)
    total = torch.stack([d["lm loss"] for d in losses]).sum(0).double()
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return (total[0] / total[1]).item(), grad_norm


def evaluate(args, model, valid_ds) -> float:
    from byte_data import batches
    from megatron.core import parallel_state

    for chunk in model:
        chunk.eval()
    it = batches(valid_ds, 0, args.micro_batch_size, parallel_state.get_data_parallel_rank(),
                 args.data_parallel_size)
    with torch.no_grad():
        losses = [train_step(args, model, None, None, it, forward_only=True)[0] for _ in range(args.eval_iters)]
    for chunk in model:
        chunk.train()
    return sum(losses) / len(losses)


def log(args, message: str) -> None:
    if args.rank == 0:
        print(message, flush=True)


def main(argv=None) -> int:
    from byte_data import batches, build_datasets, default_data_prefix, ensure_stdlib_dataset
    from megatron.core import parallel_state

    args = parse_args(argv)
    initialize(args)
    megatron_pec.use_args(args)
    if args.data_path is None:
        args.data_path = default_data_prefix()
        if args.rank == 0:
            ensure_stdlib_dataset(args.data_path)
        torch.distributed.barrier()
    model, optimizer, scheduler = setup_model_and_optimizer(args)
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args.iteration, args.num_floating_point_operations_so_far = 0, 0
    load_s = None
    if args.load or args.pretrained_checkpoint:
        started = time.perf_counter()
        args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(model, optimizer, scheduler)
        load_s = time.perf_counter() - started
    elif args.save:
        megatron_pec.prepare(model, optimizer)  # slots and agent now: the first save costs what later ones do
    train_ds, valid_ds = build_datasets(
        args.data_path, args.seq_length, args.seed, args.train_iters * args.global_batch_size,
        max(args.eval_iters, 1) * args.global_batch_size * 2, args.split,
    )
    data_iterator = batches(train_ds, args.consumed_train_samples, args.micro_batch_size,
                            parallel_state.get_data_parallel_rank(), args.data_parallel_size)
    flops_per_iteration = 6 * args.global_batch_size * args.seq_length * sum(
        p.numel() for p in model[0].parameters())
    metrics = open(args.metrics_file, "a") if args.metrics_file and args.rank == 0 else None
    if metrics and load_s is not None:
        metrics.write(json.dumps({"iteration": args.iteration, "load_s": load_s}) + "\n")
    if metrics and megatron_pec.node_memory() is not None:
        metrics.write(json.dumps({"iteration": args.iteration, "node_memory": megatron_pec.node_memory()}) + "\n")
    iteration = args.iteration
    log(args, f"training from iteration {iteration} to {args.train_iters} "
              f"(world {args.world_size}, EP {args.expert_model_parallel_size}, DP {args.data_parallel_size})")
    profiler = Profiler(args)
    while iteration < args.train_iters:
        profiler.before(iteration)
        start, cpu_start, device_start = time.perf_counter(), time.thread_time(), _device_mark()
        loss, grad_norm = _trained(train_step, args, model, optimizer, scheduler, data_iterator)
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += args.global_batch_size
        args.num_floating_point_operations_so_far += flops_per_iteration
        step_s, step_cpu_s = time.perf_counter() - start, time.thread_time() - cpu_start
        device_step_s = _device_seconds_since(device_start)
        save_s = checkpoint_if_due(args, iteration, model, optimizer, scheduler)
        profiler.after(iteration)
        if metrics:
            record = {"iteration": iteration, "lm loss": loss, "save_blocking_s": save_s,
                      "plt": megatron_pec.plt_so_far(), "step_s": step_s, "step_cpu_s": step_cpu_s,
                      "device_step_s": device_step_s}
            if save_s is not None:
                record["save_phases_s"] = megatron_pec.last_save_phases()
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if iteration % args.log_interval == 0 or iteration == 1:
            log(args, f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} | "
                      f"consumed samples: {args.consumed_train_samples:12d} | "
                      f"elapsed time per iteration (ms): {step_s * 1000:.1f} | "
                      f"learning rate: {scheduler.get_lr(optimizer.param_groups[0]):.6E} | "
                      f"global batch size: {args.global_batch_size:5d} | lm loss: {loss:.6E} | "
                      f"grad norm: {float(grad_norm):.3f} |"
                      + (f" save blocking (ms): {save_s * 1000:.1f} |" if save_s is not None else ""))
        if args.eval_interval and iteration % args.eval_interval == 0:
            log(args, f" validation loss at iteration {iteration} | lm loss: {evaluate(args, model, valid_ds):.6E} |")
        if args.exit_interval and iteration % args.exit_interval == 0 and iteration < args.train_iters:
            # As Megatron-LM's checkpoint_and_decide_exit: no second save after this iteration's
            # (memory) snapshot; the node agents persist it when the trainers detach.
            if args.save and save_s is None:
                _timed_save(args, iteration, model, optimizer, scheduler, non_persistent=False)
            log(args, f"exiting program at iteration {iteration}")
            return 0
    if args.save and iteration > 0 and not _saved_persistently(args, iteration):
        _timed_save(args, iteration, model, optimizer, scheduler, non_persistent=False)
    val = evaluate(args, model, valid_ds)
    log(args, f" validation loss at the end of training | lm loss: {val:.6E} |")
    if metrics:
        metrics.write(json.dumps({"iteration": iteration, "validation loss": val}) + "\n")
        metrics.close()
    return 0


class Profiler:
    """--profile: torch.profiler over iterations [start, end) of this run, each one a range
    ``ProfilerStep#<iteration>`` with its save inside; the trace is written when the window closes."""

    def __init__(self, args):
        self.args, self._prof, self._step = args, None, None

    def before(self, iteration: int) -> None:
        if self.args.profile and iteration == self.args.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        if self._prof is not None:
            self._step = torch.profiler.record_function(f"ProfilerStep#{iteration + 1}")
            self._step.__enter__()

    def after(self, iteration: int) -> None:
        """``iteration``: the one just trained (and saved)."""
        if self._prof is None:
            return
        self._step.__exit__(None, None, None)
        if iteration < self.args.profile_step_end:
            return
        self._prof.__exit__(None, None, None)
        out = Path(self.args.tensorboard_dir or ".") / f"trace_rank{self.args.rank}.json.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(out))
        self._prof = None
        log(self.args, f"profiled iterations {self.args.profile_step_start + 1} to {iteration}: {out}")


def _device_mark():
    """An event on the GPU's stream at the step's start (None on CPU ranks)."""
    if not torch.cuda.is_available():
        return None
    mark = torch.cuda.Event(enable_timing=True)
    mark.record()
    return mark


def _device_seconds_since(mark) -> float | None:
    """Seconds the GPU's stream took from ``mark`` to now (the step's losses were read: it is idle, this
    waits for nothing). Beside the step's wall time and its training thread's CPU time, it tells a host-side
    slowdown from a device-side one."""
    if mark is None:
        return None
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    end.synchronize()
    return mark.elapsed_time(end) / 1000


def _trained(step, args, *rest):
    """``step(args, *rest)``; megatron-core's known failure with biased experts becomes a message."""
    try:
        return step(args, *rest)
    except RuntimeError as exc:
        if "ReduceFromModelParallelRegion" in str(exc) and "modified inplace" in str(exc) \
                and not args.disable_bias_linear:
            raise SystemExit("error: this megatron-core release cannot train experts with biases in this setup "
                             f"(expert parallel size {args.expert_model_parallel_size}: its SequentialMLP adds the "
                             "bias in place on a view autograd forbids); pass --disable-bias-linear") from None
        raise


def _saved_persistently(args, iteration: int) -> bool:
    return bool(args.save_interval) and iteration % args.save_interval == 0


def checkpoint_if_due(args, iteration, model, optimizer, scheduler):
    """Megatron's schedule: persistent saves every --save-interval, memory snapshots every
    --non-persistent-save-interval. Returns the blocking seconds, or None when nothing was saved."""
    if not args.save:
        return None
    if _saved_persistently(args, iteration):
        return _timed_save(args, iteration, model, optimizer, scheduler, non_persistent=False)
    if args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0:
        return _timed_save(args, iteration, model, optimizer, scheduler, non_persistent=True)
    return None


def _timed_save(args, iteration, model, optimizer, scheduler, non_persistent: bool) -> float:
    start = time.perf_counter()
    save_checkpoint(iteration, model, optimizer, scheduler, args.num_floating_point_operations_so_far,
                    non_persistent_ckpt=non_persistent)
    return time.perf_counter() - start


if __name__ == "__main__":
    code = main()
    # After a successful run only (a failed peer would make it wait): without it gloo's threads can
    # abort the exiting process ("terminate called without an active exception", pytorch#190489),
    # and torchrun then reports the finished run as failed.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
