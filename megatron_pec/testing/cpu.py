"""CPU stand-ins for the CUDA entry points megatron-core 0.16.1 calls.

Used only by the tests and the CPU example; production code never imports this
module. ``activate()`` must run before any megatron-core model is built. The
stand-ins only redirect device placement, streams and RNG state to the CPU;
they change no numerics.

Every entry below names the megatron-core call that needs it, so the list can
shrink when megatron-core fixes its CPU paths.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_ACTIVE = False
_CPU = torch.device("cpu")

# Tensor factories megatron-core calls with device=torch.cuda.current_device() or "cuda"
# (DDP buffers, optimizer state, router/dispatcher scratch tensors).
_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "randn_like", "rand_like",
)


class CudaAvailableError(RuntimeError):
    """Raised when the stand-ins are asked to replace a real GPU."""


def is_active() -> bool:
    return _ACTIVE


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _redirect_device(kwargs: dict) -> dict:
    if "device" in kwargs and _is_cuda_device(kwargs["device"]):
        kwargs["device"] = _CPU
    return kwargs


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        return fn(*args, **_redirect_device(kwargs))

    return factory


class _NoOpStream:
    """torch.cuda.Stream / Event stand-in: CPU work is already synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


def activate() -> None:
    """Install the stand-ins in this process (idempotent).

    Raises CudaAvailableError when a GPU is present: on a GPU machine the real
    CUDA paths must run.
    """
    global _ACTIVE
    if _ACTIVE:
        return
    if torch.cuda.is_available():
        raise CudaAvailableError(
            "megatron_pec.testing.cpu refuses to activate: CUDA is available, so the real CUDA "
            "code paths must be used. Run without the CPU stand-ins on GPU machines."
        )
    _replace_cuda_runtime(torch.cuda)
    _redirect_tensors_to_cpu()
    _patch_megatron_core()
    _ACTIVE = True


def _replace_cuda_runtime(cuda) -> None:
    """Devices, streams, events and the "CUDA" RNG: the CPU's."""
    # DDP, optimizer and dispatcher place tensors on torch.cuda.current_device().
    cuda.current_device = lambda: _CPU
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    # DDP overlaps communication on side streams; optimizer and DDP record events.
    cuda.Stream = _NoOpStream
    cuda.Event = _NoOpStream
    cuda.current_stream = lambda *a, **k: _NoOpStream()
    cuda.default_stream = lambda *a, **k: _NoOpStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None
    # Token dispatchers and cuda-graph guards ask this.
    cuda.is_current_stream_capturing = lambda: False
    # model_parallel_cuda_manual_seed and the RNG tracker keep "CUDA" RNG states: use the CPU generator.
    # (torch.manual_seed itself calls cuda.manual_seed_all: that one must not re-seed.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _redirect_tensors_to_cpu() -> None:
    """``.cuda()``, ``.to("cuda")`` and the factories' ``device=`` land on the CPU; the type names stay CUDA's."""
    # Model code calls .cuda() and .to("cuda"/current_device()).
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = (_CPU,) + args[1:]
        return original_to(self, *args, **_redirect_device(kwargs))

    torch.Tensor.to = to
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))

    # DistributedOptimizer checks param.type() against "torch.cuda.FloatTensor" etc.
    original_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = tensor_type


def _patch_megatron_core() -> None:
    """megatron-core's own RNG-state swaps and a missing name of 0.16.1."""
    from megatron.core.tensor_parallel import random as mcore_random

    # The Megatron RNG tracker's fork() swaps "CUDA" RNG states through these two.
    mcore_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # megatron-core 0.16.1 bug: without Transformer Engine te_general_gemm is never
    # defined, and router gating raises NameError.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
