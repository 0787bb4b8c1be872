"""Megatron's optimizer ``state_dict()`` without its walk over every parameter.

With the distributed optimizer, ``state_dict()`` holds no per-parameter data (the param groups'
hyperparameters, the step they share, the grad scaler), yet it packs every parameter's state and,
without Apex or Transformer Engine, reads every parameter's step with ``.item()``: about 40 ms
per save at 15k expert parameters per rank. Shown one stepped parameter per group, the inner
optimizers give the same dict. Cheaper still, the dict is built from the param groups themselves
(``_from_groups``: what Megatron's ``DistributedOptimizer.state_dict`` makes of them with torch's own
optimizers, without touching a parameter: half the cost on the training thread right after a step). The
first call of each ``OptimizerState`` checks both against the full ``state_dict()`` and keeps to the
cheapest that gave the same dict (the full one where neither did: an optimizer class that keeps more than
this knows of).
"""

from __future__ import annotations

import contextlib

from megatron_pec.common import log
from megatron_pec.format import small_state


class OptimizerState:
    """``state_dict()`` of one Megatron optimizer at a cost independent of its parameter count."""

    def __init__(self, optimizer, inner: list):
        """``inner``: its ``collect.distributed_optimizers``, found once (a save asks at every iteration)."""
        self.optimizer, self.inner = optimizer, inner
        self.trimmed_ok: bool | None = None  # None: not checked yet
        self.from_groups_ok = False          # ... and the param groups' dict too, once checked

    def state_dict(self) -> dict | list:
        if self.from_groups_ok:
            built = _built_or_none(self.optimizer, self.inner)
            if built is not None:
                return built
        if self.trimmed_ok is False:
            return self.optimizer.state_dict()
        with _one_param_per_group(self.inner):
            trimmed = self.optimizer.state_dict()
        if self.trimmed_ok is None:
            full = self.optimizer.state_dict()
            self.trimmed_ok = _same(trimmed, full)
            if not self.trimmed_ok:
                log.info("note: this optimizer's state_dict depends on more than one parameter per group; every "
                         "save asks it for the full one (slower saves, same checkpoint)", rank0=True)
                return full
            self.from_groups_ok = _same(_built_or_none(self.optimizer, self.inner), full)
        return trimmed


def _from_groups(optimizer, inner: list) -> dict | list | None:
    """``optimizer.state_dict()`` as Megatron's distributed optimizers make it over torch's optimizers: per
    distributed optimizer its inner optimizer's param groups without their params, each with the step every
    parameter's state shares (``.item()`` of one stepped parameter per group), and the grad scaler's state; a
    chain of several, a list of them. None where the parameters' steps differ (Megatron's own then says so)."""
    out = []
    for opt in inner:
        groups, state = opt.optimizer.param_groups, opt.optimizer.state
        steps = {state[p]["step"].item() for g in groups for p in _first_stepped(g["params"], state) if p in state}
        if len(steps) != 1:
            return None
        [step] = steps
        built = {"optimizer": {"param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "step": step}
                                                for g in groups]}}
        if opt.grad_scaler:
            built["grad_scaler"] = opt.grad_scaler.state_dict()
        out.append(built)
    return out[0] if len(inner) == 1 else out  # (as Megatron's ChainedOptimizer: one optimizer's dict alone)


def _built_or_none(optimizer, inner: list) -> dict | list | None:
    """``_from_groups``, or None where an optimizer keeps its step elsewhere (Transformer Engine's and Apex's fused
    Adam keep it in the param groups: Megatron's own dict is then built otherwise)."""
    try:
        return _from_groups(optimizer, inner)
    except (KeyError, AttributeError, TypeError, RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def _one_param_per_group(optimizers):
    """Each inner optimizer shows, per param group, its first parameter that has state (its first
    parameter if none has), and only those parameters' state."""
    saved = []
    try:
        for opt in optimizers:
            inner = opt.optimizer
            groups, state = inner.param_groups, inner.state
            shown = [{**g, "params": _first_stepped(g["params"], state)} for g in groups]
            saved.append((inner, groups, state))
            inner.param_groups = shown
            inner.state = type(state)(state.default_factory) if hasattr(state, "default_factory") else {}
            inner.state.update({p: state[p] for g in shown for p in g["params"] if p in state})
        yield
    finally:
        for inner, groups, state in saved:
            inner.param_groups, inner.state = groups, state


def _first_stepped(params: list, state) -> list:
    return next(([p] for p in params if p in state), params[:1])


def _same(a, b) -> bool:
    """Equal as a checkpoint stores them (tensors in the grad scaler's state compare by bytes); None is
    nothing's."""
    if a is None:
        return False
    try:
        return small_state.dumps(a) == small_state.dumps(b)
    except TypeError:
        return False
