"""Run Megatron-LM's own training script on CPU ranks (gloo), for tests:

    torchrun --nproc-per-node 2 -m megatron_pec.testing.megatron_lm_cpu TREE/pretrain_gpt.py ARGS...

Installs ``megatron_pec.testing.cpu``'s stand-ins, then what the training loop itself needs
on a machine without CUDA, and runs the script as ``__main__`` with TREE first on
``sys.path``. Each entry names the Megatron-LM call that needs it:

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``: always allowed here;
* ``fused_kernels.load`` and ``_warmup_jit_function`` build and warm CUDA kernels: skipped;
* ``torch.cuda.memory_allocated`` and friends (memory reports in ``training_log``): 0;
* core_v0.19's training package imports ``typing.override`` (Python 3.12): on 3.11 it is
  ``typing_extensions.override``;
* ``torch.compile``'d fusions (the sigmoid router's, for one) compile for ~20 s on CPU:
  ``TORCHDYNAMO_DISABLE=1`` unless set (eager numerics are the same in every run compared);
* Megatron's own load of a ``torch_dist`` checkpoint into a fresh DistributedOptimizer asks
  ``state_dict()`` for the step count, which without apex/TE it reads from the per-param state
  that torch's Adam creates only at its first step (an ``AssertionError`` on CPU-only machines):
  before such a load the state is initialised (zeros and step 0, what the first step would
  create; the load then overwrites it));
* the dataset index helpers (``megatron.core.datasets.helpers_cpp``) are compiled from the
  tree at start-up (needs pybind11 and a compiler): the prebuilt extension of the installed
  megatron-core wheel is used instead.

Numerics are untouched. Never imported by megatron-pec itself.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
import typing
from pathlib import Path


def _wheel_helpers() -> Path | None:
    """The installed megatron-core wheel's compiled dataset helpers (not the tree's)."""
    for entry in sys.path:
        folder = Path(entry or ".") / "megatron" / "core" / "datasets"
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if (folder / f"helpers_cpp{suffix}").is_file() and "site-packages" in str(folder):
                return folder / f"helpers_cpp{suffix}"
    return None


def _install_helpers() -> None:
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")  # the tree has a built one
        return
    except ImportError:
        pass
    path = _wheel_helpers()
    if path is None:
        raise SystemExit("megatron_lm_cpu: no compiled megatron/core/datasets/helpers_cpp in the tree or in an "
                         "installed megatron-core wheel: pip install megatron-core (any supported version)")
    name = "megatron.core.datasets.helpers_cpp"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    import megatron.core.datasets as datasets

    datasets.helpers_cpp = module


def prepare(tree: Path) -> None:
    """Everything before the script runs (in this process)."""
    import torch

    from megatron_pec.testing import cpu

    sys.path.insert(0, str(tree))
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    cpu.activate()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)

    import megatron.training.initialize as initialize

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    import megatron.training.training as training

    if getattr(training, "initialize_megatron", None) is original:
        training.initialize_megatron = initialize_megatron
    if hasattr(initialize, "fused_kernels"):  # gone in core_v0.19
        initialize.fused_kernels.load = lambda *a, **k: None
    initialize._warmup_jit_function = lambda *a, **k: None
    _install_helpers()
    _initialise_state_before_dist_load()


def _initialise_state_before_dist_load() -> None:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict={}, is_loading: bool = False, *args, **kwargs):  # noqa: B006 (Megatron's own signature, passed on as it is)
        if is_loading and not any(self.optimizer.state.values()):
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    DistributedOptimizer.sharded_state_dict = sharded_state_dict


def main(after_prepare=None) -> None:
    """Run the script named by ``sys.argv[1]``; ``after_prepare()`` (if given) runs once the stand-ins are in
    and the tree is importable, right before the script (``megatron_pec.testing.state_dump`` hooks in there)."""
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        raise SystemExit("usage: python -m megatron_pec.testing.megatron_lm_cpu TREE/pretrain_gpt.py ARGS...")
    script = Path(sys.argv[1]).resolve()
    if not script.is_file():
        raise SystemExit(f"megatron_lm_cpu: {script} not found")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    prepare(script.parent)
    if after_prepare is not None:
        after_prepare()
    run_as_main(script)


def run_as_main(script: Path) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv[2:]`` as its arguments. It keeps the launched module's
    spec: processes Megatron spawns (the torch_dist writer's multiprocessing Manager) then import that module,
    not re-run the script without the stand-ins and hooks it installed."""
    sys.argv = [str(script), *sys.argv[2:]]
    main_module = types.ModuleType("__main__")
    main_module.__file__ = str(script)
    main_module.__spec__ = sys.modules["__main__"].__spec__
    sys.modules["__main__"] = main_module
    exec(compile(script.read_text(), str(script), "exec"), main_module.__dict__)


if __name__ == "__main__":
    main()
