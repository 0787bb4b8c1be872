"""The whole training state of every rank, dumped after a checkpoint load, for the state-parity tests.

Runs Megatron-LM's ``pretrain_gpt.py`` (through ``megatron_pec.testing.megatron_lm_cpu``, pristine or patched
tree alike) or the example trainer (``examples/gpt_moe/pretrain_gpt_moe.py``) with three additions, all made
from outside the script:

* the model gets a ``StateProbe`` child (the model provider is wrapped): a frozen parameter, drawn from
  ``$MEGATRON_PEC_PROBE_SEED`` (give the save run and the load run different seeds: a restore that drops
  the parameter then shows), and extra state that changes every forward step (a stand-in for Transformer
  Engine's FP8 scaling state: ``get_extra_state`` returns a uint8 tensor, ``set_extra_state`` restores it);
* with ``$MEGATRON_PEC_STATE_DUMP=DIR`` the state is written to ``DIR/rank<r>.safetensors`` (tensors) and
  ``DIR/rank<r>.json`` (everything else), no pickle: right after ``load_checkpoint`` returns (before
  anything draws a random number; the process then exits), or, with ``$MEGATRON_PEC_STATE_DUMP_AT=save:N``,
  right after the save of iteration N (training goes on);
* with ``$MEGATRON_PEC_ALSO_TORCH_DIST=DIR`` (patched Megatron-LM only) each persistent save of the
  training loop also goes through Megatron-LM's own ``save_checkpoint`` into ``DIR`` (``torch_dist``), so
  one run saves the same iteration in both formats.

    torchrun --nproc-per-node 2 -m megatron_pec.testing.state_dump TREE/pretrain_gpt.py ARGS...
    torchrun --nproc-per-node 2 -m megatron_pec.testing.state_dump examples/gpt_moe/pretrain_gpt_moe.py ARGS...

What is dumped (one flat key per leaf, ``section/...``): ``returned/iteration`` and ``returned/flops`` (what
``load_checkpoint`` returned), ``model<i>/`` (each chunk's ``state_dict()``, extra state included),
``optimizer/state_dict/`` (``optimizer.state_dict()``: param groups, steps, grad scaler), ``optimizer/shard/``
(each inner optimizer's main-parameter shards and their Adam state, by position), ``scheduler/``, ``rng/``
(Python, NumPy, torch, "CUDA", every tracker state), ``rerun/`` (the rerun state machine's state dict,
forced), ``args/`` (every argument), ``checkpoint_version``, ``microbatches/``. ``read`` and ``compare``
are the tests' side. Test-only code; megatron-pec never imports it.
"""

from __future__ import annotations

import enum
import functools
import io
import json
import math
import os
import struct
import sys
import types
from pathlib import Path

DUMP_ENV, AT_ENV, SEED_ENV, TORCH_DIST_ENV = (
    "MEGATRON_PEC_STATE_DUMP", "MEGATRON_PEC_STATE_DUMP_AT", "MEGATRON_PEC_PROBE_SEED", "MEGATRON_PEC_ALSO_TORCH_DIST")
PROBE = "pec_state_probe"  # the probe's attribute name in the model

# ---- the probe -----------------------------------------------------------------------------------


def _probe_class():
    import torch

    class StateProbe(torch.nn.Module):
        """A frozen parameter and per-step extra state, as Transformer Engine's layers carry."""

        def __init__(self, seed: int):
            super().__init__()
            generator = torch.Generator().manual_seed(seed)  # the global generators stay untouched
            self.frozen = torch.nn.Parameter(torch.randn(4, 8, generator=generator), requires_grad=False)
            self.steps = 0

        def advance(self) -> None:
            self.steps += 1

        def get_extra_state(self):
            # 8 bytes of the step count and 8 that follow it, like an amax history that moves each step
            moving = [(self.steps * 37 + i) % 256 for i in range(8)]
            return torch.tensor(list(self.steps.to_bytes(8, "little")) + moving, dtype=torch.uint8)

        def set_extra_state(self, state) -> None:
            if isinstance(state, io.BytesIO):  # how some formats hand extra state back
                state = torch.frombuffer(bytearray(state.getvalue()), dtype=torch.uint8)
            if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
                return
            self.steps = int.from_bytes(bytes(state[:8].tolist()), "little")

    return StateProbe


def attach_probe(model):
    """Give ``model`` (an unwrapped GPTModel) the probe; each forward step in training mode advances it and
    draws from every random generator (as dropout would), so that a restore that drops one shows."""
    probe = _probe_class()(int(os.environ.get(SEED_ENV, "0")))
    model.add_module(PROBE, probe)

    def step(module, inputs, output):
        if module.training:
            probe.advance()
            _draw_from_every_generator()

    model.register_forward_hook(step)
    return model


def _draw_from_every_generator() -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    device = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU stand-ins' "CUDA" generator is the CPU's)
    random.random()
    np.random.random()
    torch.rand(1)
    torch.rand(1, device=device)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    for name in tracker.get_states():
        with tracker.fork(name):
            torch.rand(1, device=device)


# ---- flattening and the file format --------------------------------------------------------------


def _flatten(obj, path: str, tensors: dict, values: dict) -> None:
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
    elif isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(obj.astype(np.int64) if obj.dtype == np.uint32 else obj.copy())
    elif isinstance(obj, (bytes, bytearray, io.BytesIO)):
        data = obj.getvalue() if isinstance(obj, io.BytesIO) else bytes(obj)
        tensors[path] = torch.tensor(list(data), dtype=torch.uint8)
    elif isinstance(obj, dict):
        if not obj:
            values[path] = {}
        for k, v in obj.items():
            _flatten(v, f"{path}/{k}", tensors, values)
    elif isinstance(obj, (list, tuple)):
        if not obj:
            values[path] = []
        for i, v in enumerate(obj):
            _flatten(v, f"{path}/{i}", tensors, values)
    elif isinstance(obj, enum.Enum):
        values[path] = f"{type(obj).__name__}.{obj.name}"
    elif isinstance(obj, float) and not math.isfinite(obj):
        values[path] = repr(obj)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        values[path] = obj
    elif isinstance(obj, (np.integer, np.floating, np.bool_)):
        values[path] = obj.item()
    elif type(obj).__name__ == "ShardedObject":  # what the rerun state machine hands torch_dist: its data
        _flatten(obj.data, path, tensors, values)
    elif isinstance(obj, types.SimpleNamespace) or type(obj).__name__ == "Namespace":
        _flatten(vars(obj), path, tensors, values)
    elif callable(obj):
        values[path] = f"<{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}>"
    else:
        values[path] = f"<{type(obj).__name__}> {obj}"


_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
           "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _write_safetensors(path: Path, tensors: dict) -> None:
    """safetensors layout: 8-byte header length, JSON header padded to 8, contiguous data."""
    import torch

    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in blobs:
            f.write(data)


def _read_safetensors(path: Path) -> dict:
    import torch

    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    codes = {v: getattr(torch, k) for k, v in _DTYPES.items()}
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = codes[entry["dtype"]]
        if end == begin:
            out[name] = torch.zeros(entry["shape"], dtype=dtype)
        else:
            flat = torch.frombuffer(bytearray(raw[8 + n + begin:8 + n + end]), dtype=torch.uint8)
            out[name] = flat.view(dtype).reshape(entry["shape"])
    return out


# ---- what is dumped ------------------------------------------------------------------------------


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def collect(model, optimizer, scheduler, args, returned=None) -> tuple[dict, dict]:
    """(tensors, values) of this rank's whole state, one flat key per leaf."""
    tensors, values = {}, {}

    def put(obj, path):
        _flatten(obj, path, tensors, values)

    if returned is not None:
        put(returned[0], "returned/iteration")
        put(returned[1], "returned/flops")
    for i, chunk in enumerate(model if isinstance(model, (list, tuple)) else [model]):
        put(dict(chunk.state_dict()), f"model{i}")
    if optimizer is not None:
        _put_optimizer(optimizer, put)
    if scheduler is not None:
        put(scheduler.state_dict(), "scheduler")
    _put_rng_and_rerun(put)
    put(args, "args")
    try:
        from megatron.training.checkpointing import get_checkpoint_version
    except ImportError:  # the example trainer's environment has no megatron.training
        pass
    else:
        put(get_checkpoint_version(), "checkpoint_version")
    from megatron.core import num_microbatches_calculator as nmc

    put(nmc.get_num_microbatches(), "microbatches/num")
    put(nmc.get_current_global_batch_size(), "microbatches/global_batch_size")
    return tensors, values


def _put_optimizer(optimizer, put) -> None:
    """Megatron's state dict, then each shard's main params and moments, grad scaler and loss scale."""
    try:
        put(optimizer.state_dict(), "optimizer/state_dict")
    except AssertionError as exc:  # a DistributedOptimizer before its first step on CPU (torch's Adam)
        put(f"<state_dict() fails: AssertionError {exc}>", "optimizer/state_dict")
    for c, inner in enumerate(_inner_optimizers(optimizer)):
        torch_opt = getattr(inner, "optimizer", None)
        if torch_opt is None:
            continue
        for g, group in enumerate(torch_opt.param_groups):
            for p, param in enumerate(group["params"]):
                put(param, f"optimizer/shard/{c}/group{g}/param{p}/main")
                put(dict(torch_opt.state.get(param, {})), f"optimizer/shard/{c}/group{g}/param{p}/state")
        scaler = getattr(inner, "grad_scaler", None)
        if scaler is not None:
            put(scaler.state_dict(), f"optimizer/grad_scaler/{c}")
            put(inner.get_loss_scale(), f"optimizer/loss_scale/{c}")


def _put_rng_and_rerun(put) -> None:
    """Every RNG Megatron keeps (Python, numpy, torch, "CUDA", the tracker's) and the rerun state machine's."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    put(list(random.getstate()), "rng/random")
    put(list(np.random.get_state()), "rng/numpy")
    put(torch.get_rng_state(), "rng/torch")
    put(torch.cuda.get_rng_state(), "rng/cuda")
    put(tensor_parallel.get_cuda_rng_tracker().get_states(), "rng/tracker")
    machine = get_rerun_state_machine()
    put(machine.state_dict(data_iterator=None, ckpt_format="torch_dist", force=True), "rerun/state_dict")
    put(getattr(machine, "state", None), "rerun/state")
    put(getattr(machine, "mode", None), "rerun/mode")


def dump(directory, model, optimizer, scheduler, args, returned=None) -> None:
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    tensors, values = collect(model, optimizer, scheduler, args, returned)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_safetensors(directory / f"rank{rank}.safetensors.tmp", tensors)
    (directory / f"rank{rank}.json.tmp").write_text(json.dumps(values, indent=0, sort_keys=True))
    os.replace(directory / f"rank{rank}.safetensors.tmp", directory / f"rank{rank}.safetensors")
    os.replace(directory / f"rank{rank}.json.tmp", directory / f"rank{rank}.json")


def read(directory, rank: int) -> tuple[dict, dict]:
    """(tensors, values) as ``dump`` wrote them for ``rank``."""
    directory = Path(directory)
    return (_read_safetensors(directory / f"rank{rank}.safetensors"),
            json.loads((directory / f"rank{rank}.json").read_text()))


def compare(expected, actual, ignore=()) -> dict[str, str]:
    """Every difference between two ``read`` results: key -> what was expected and what came (empty:
    equal). Keys starting with one of ``ignore`` are skipped."""
    (t_exp, v_exp), (t_act, v_act) = expected, actual
    skip = tuple(ignore)
    out = {}
    for name in sorted(set(t_exp) | set(t_act) | set(v_exp) | set(v_act)):
        if skip and name.startswith(skip):
            continue
        a_kind = "tensor" if name in t_exp else "value" if name in v_exp else None
        b_kind = "tensor" if name in t_act else "value" if name in v_act else None
        if a_kind is None:
            out[name] = f"not expected, got {_show(t_act, v_act, name)}"
        elif b_kind is None:
            out[name] = f"expected {_show(t_exp, v_exp, name)}, missing"
        elif (a_kind != b_kind or (a_kind == "value" and v_exp[name] != v_act[name])
              or (a_kind == "tensor" and not _same_tensor(t_exp[name], t_act[name]))):
            out[name] = f"expected {_show(t_exp, v_exp, name)}, got {_show(t_act, v_act, name)}"
    return out


def _same_tensor(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _show(tensors, values, name) -> str:
    if name in values:
        return repr(values[name])
    t = tensors[name]
    head = t.reshape(-1)[:6].tolist()
    return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)} {head}{'...' if t.numel() > 6 else ''}"


# ---- the hooks in the launched process -----------------------------------------------------------


def _dump_at() -> tuple[str, int | None]:
    at = os.environ.get(AT_ENV, "load")
    if at == "load":
        return "load", None
    kind, _, iteration = at.partition(":")
    if kind != "save" or not iteration.isdigit():
        raise SystemExit(f"state_dump: {AT_ENV} must be 'load' or 'save:N', not {at!r}")
    return "save", int(iteration)


def _exit_after_dump() -> None:
    import torch

    torch.distributed.barrier()
    print(f"state_dump: rank {torch.distributed.get_rank()} dumped its state after the load", flush=True)
    # As the example trainer at its end: without it gloo's threads can hold up or abort the exit.
    torch.distributed.destroy_process_group()
    sys.exit(0)


def _wrap_load(load, get_args):
    directory = os.environ.get(DUMP_ENV)

    @functools.wraps(load)
    def load_checkpoint(*a, **k):
        returned = load(*a, **k)
        if directory and _dump_at()[0] == "load":
            model = k.get("ddp_model", k.get("model", a[0] if a else None))
            optimizer = k.get("optimizer", a[1] if len(a) > 1 else None)
            scheduler = k.get("opt_param_scheduler", a[2] if len(a) > 2 else None)
            dump(directory, model, optimizer, scheduler, get_args(), returned)
            _exit_after_dump()
        return returned

    return load_checkpoint


def _wrap_save(save, get_args, also_torch_dist=None):
    directory = os.environ.get(DUMP_ENV)
    kind, at = _dump_at()

    @functools.wraps(save)
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *a, **k):
        result = save(iteration, model, optimizer, opt_param_scheduler, *a, **k)
        persistent = not k.get("non_persistent_ckpt", False)
        if also_torch_dist and persistent:
            _save_torch_dist(also_torch_dist, iteration, model, optimizer, opt_param_scheduler, *a, **k)
        if directory and kind == "save" and iteration == at:
            dump(directory, model, optimizer, opt_param_scheduler, get_args(), (iteration, _flops(a, k)))
        return result

    return save_checkpoint


def _flops(a, k):
    return k.get("num_floating_point_operations_so_far", a[0] if a else 0)


def _save_torch_dist(directory, iteration, model, optimizer, scheduler, *a, **k) -> None:
    """Megatron-LM's own save of the same iteration into ``directory``, with its own context."""
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    args = get_args()
    saved = args.save, args.ckpt_format
    args.save, args.ckpt_format = directory, "torch_dist"
    try:
        k = dict(k, checkpointing_context={}, non_persistent_ckpt=False)
        a = a[:1]  # (flops); the context and later positionals go by keyword
        save_checkpoint(iteration, model, optimizer, scheduler, *a, **k)
    finally:
        args.save, args.ckpt_format = saved


def _probed(provider):
    """``provider`` (a model provider or a builder's build_model), whose models get the probe."""

    @functools.wraps(provider)
    def probed(*a, **k):
        return attach_probe(provider(*a, **k))

    return probed


def _install_megatron_lm() -> None:
    """Hooks into Megatron-LM's training loop (the tree is on sys.path, the CPU stand-ins are in)."""
    import megatron.training
    import megatron.training.training as training
    from megatron.training import get_args

    try:  # core_v0.19: pretrain_gpt.py hands pretrain() a config; a builder's build_model makes each model
        from megatron.training.models.gpt import GPTModelBuilder
    except ImportError:  # up to core_v0.18: pretrain() gets the model provider
        original_pretrain = training.pretrain

        @functools.wraps(original_pretrain)
        def pretrain(datasets_provider, model_provider, *a, **k):
            return original_pretrain(datasets_provider, _probed(model_provider), *a, **k)

        training.pretrain = megatron.training.pretrain = pretrain
    else:
        GPTModelBuilder.build_model = _probed(GPTModelBuilder.build_model)
    training.load_checkpoint = _wrap_load(training.load_checkpoint, get_args)
    training.save_checkpoint = _wrap_save(training.save_checkpoint, get_args, os.environ.get(TORCH_DIST_ENV))


def _run_example(script: Path) -> None:
    """The example trainer as ``__main__``, with the probe in its GPTModel and the hooks on its entry points."""
    import torch

    if not torch.cuda.is_available():  # before megatron.core is imported, as the example itself does
        from megatron_pec.testing import cpu

        cpu.activate()
    import megatron.core.models.gpt as gpt

    import megatron_pec

    base = gpt.GPTModel

    class ProbedGPTModel(base):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            attach_probe(self)

    gpt.GPTModel = ProbedGPTModel
    captured = {}
    original_use_args = megatron_pec.use_args

    def use_args(args):
        captured["args"] = args
        original_use_args(args)

    megatron_pec.use_args = use_args
    megatron_pec.load_checkpoint = _wrap_load(megatron_pec.load_checkpoint, lambda: captured["args"])
    megatron_pec.save_checkpoint = _wrap_save(megatron_pec.save_checkpoint, lambda: captured["args"])
    import runpy

    runpy.run_path(str(script), run_name="__main__")


def _run_megatron_lm_on_gpu(script: Path) -> None:
    """Megatron-LM's script as ``__main__`` on a GPU: no stand-ins, the tree first on sys.path, the hooks in
    (as ``megatron_lm_cpu.main`` runs it, spawned processes import this module, not the script)."""
    import typing

    sys.path.insert(0, str(script.parent))
    if not hasattr(typing, "override"):  # core_v0.19's training package on Python 3.11
        import typing_extensions

        typing.override = typing_extensions.override
    from megatron_pec.testing import megatron_lm_cpu

    megatron_lm_cpu._install_helpers()  # the wheel's compiled dataset helpers (no compiler needed): no stand-in
    _install_megatron_lm()
    megatron_lm_cpu.run_as_main(script)


def main() -> None:
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        raise SystemExit("usage: python -m megatron_pec.testing.state_dump SCRIPT.py ARGS...")
    script = Path(sys.argv[1]).resolve()
    import torch

    if script.name == "pretrain_gpt.py" and torch.cuda.is_available():
        _run_megatron_lm_on_gpu(script)
    elif script.name == "pretrain_gpt.py":
        from megatron_pec.testing import megatron_lm_cpu

        megatron_lm_cpu.main(after_prepare=_install_megatron_lm)
    else:
        sys.argv = [str(script), *sys.argv[2:]]
        _run_example(script)


if __name__ == "__main__":
    main()
