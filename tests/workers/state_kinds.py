"""The example trainer with a frozen parameter and a module whose extra state changes every step (a stand-in
for Transformer Engine's FP8 scaling state): the state beyond the optimizer.

Run under torchrun with the example's flags. The model provider is the example's, with two changes made
before Megatron DDP wraps the model:

* ``decoder.final_layernorm.weight`` is frozen (``requires_grad=False``, so neither DDP's buffers nor the
  optimizer hold it) and set from a generator seeded by ``PEC_TEST_FROZEN_SEED`` (unseeded without it): a
  relaunch given another seed draws other values, so only a restore gives it the saved ones (and the
  uninterrupted run's losses);
* ``pec_fp8_stand_in``, a module whose ``get_extra_state`` is a uint8 tensor of an amax history it updates in
  every forward of the final layernorm, whose output it scales by a factor of that history.

With ``PEC_TEST_STATE_LOG=DIR`` every rank appends to ``DIR/state.rank<r>.jsonl`` the digests of both at each
save (``{"saved": iteration, ...}``) and after each load (``{"loaded": iteration, ...}``).
``PEC_TEST_BAD_EXTRA_STATE=1``: the stand-in's extra state is a dict (what megatron-pec refuses at start-up).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "gpt_moe"))
sys.path.insert(0, str(REPO))

import pretrain_gpt_moe as example  # noqa: E402 (after the set-up above)
import torch  # noqa: E402 (after the set-up above)

HISTORY = 4


class Fp8StandIn(torch.nn.Module):
    """An amax history and a step count, kept as TE keeps its FP8 meta: outside parameters and buffers,
    saved through the extra-state protocol as bytes."""

    def __init__(self):
        super().__init__()
        self.history = torch.zeros(HISTORY, dtype=torch.float64)
        self.steps = 0

    def observe(self, x: torch.Tensor) -> float:
        with torch.no_grad():
            self.history = torch.roll(self.history, 1)
            self.history[0] = x.detach().abs().max().double()
            self.steps += 1
            return 1.0 + 1e-3 * float(torch.tanh(self.history.mean()))

    def get_extra_state(self):
        if os.environ.get("PEC_TEST_BAD_EXTRA_STATE"):
            return {"history": self.history.tolist(), "steps": self.steps}
        raw = torch.cat([self.history, torch.tensor([float(self.steps)], dtype=torch.float64)])
        return raw.view(torch.uint8).clone()

    def set_extra_state(self, state):
        values = state.view(torch.float64)
        self.history = values[:HISTORY].clone()
        self.steps = int(values[HISTORY].item())

    def digest(self) -> str:
        return hashlib.sha256(self.get_extra_state().numpy().tobytes()).hexdigest()[:16]


def _with_state(module):
    """The GPTModel, given a frozen parameter and the stand-in (before DDP sees it)."""
    norm = module.decoder.final_layernorm
    seed = os.environ.get("PEC_TEST_FROZEN_SEED")
    generator = torch.Generator().manual_seed(int(seed) if seed else int.from_bytes(os.urandom(4), "little"))
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(norm.weight.shape, generator=generator))
    norm.weight.requires_grad_(False)
    module.pec_fp8_stand_in = Fp8StandIn()
    norm.register_forward_hook(lambda _m, _inputs, out: out * module.pec_fp8_stand_in.observe(out))
    return module


def _install():
    from megatron.core import distributed

    real = distributed.DistributedDataParallel

    def wrapping(*, config, ddp_config, module, **kw):
        return real(config=config, ddp_config=ddp_config, module=_with_state(module), **kw)

    distributed.DistributedDataParallel = wrapping  # (the example's provider imports it when called)
    log_dir = os.environ.get("PEC_TEST_STATE_LOG")
    if not log_dir:
        return
    save, load = example.save_checkpoint, example.load_checkpoint

    def record(what: str, iteration: int, model) -> None:
        inner = model[0].module
        weight = inner.decoder.final_layernorm.weight
        line = {what: iteration, "frozen": hashlib.sha256(weight.detach().numpy().tobytes()).hexdigest()[:16],
                "extra": inner.pec_fp8_stand_in.digest(), "steps": inner.pec_fp8_stand_in.steps}
        path = Path(log_dir) / f"state.rank{torch.distributed.get_rank()}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def saving(iteration, model, *args, **kwargs):
        record("saved", iteration, model)
        return save(iteration, model, *args, **kwargs)

    def loading(model, *args, **kwargs):
        out = load(model, *args, **kwargs)
        record("loaded", out[0], model)
        return out

    example.save_checkpoint, example.load_checkpoint = saving, loading


if __name__ == "__main__":
    _install()
    code = example.main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.exit(code)
