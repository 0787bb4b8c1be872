"""This rank's DistributedOptimizer shards as slices, plus small state: what save steps 3 (snapshot) and
4 (describe) copy and record.

Runs on every rank, with no communication. The slice table is built once
(``build_slices``) from the optimizer's bucket ranges; ``live_views`` binds it
to the tensors of ``get_parameter_state_dp_reshardable()`` once Adam's state
exists, so a save only copies. Each slice is one range of a main param
or Adam moment that this rank owns, tagged with its item (``dense`` or an
expert) and its global coordinates in the full parameter.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from megatron_pec.common.errors import CheckpointError
from megatron_pec.format.item_names import NON_EXPERT, ExpertId, item_name
from megatron_pec.format.small_state_record import SmallState
from megatron_pec.megatron.expert_params import param_pieces
from megatron_pec.megatron.numpy_rng import numpy_state
from megatron_pec.megatron.python_rng import python_state

# Per-element optimizer state by optimizer class name: what each slice kind besides "param" is.
# Megatron's distributed optimizer takes Adam (torch, apex, TE) and, from core_v0.19, Lion.
STATE_KINDS = {"Adam": ("exp_avg", "exp_avg_sq"), "AdamW": ("exp_avg", "exp_avg_sq"),
               "FusedAdam": ("exp_avg", "exp_avg_sq"), "Lion": ("exp_avg",)}


class UnsupportedSetup(CheckpointError):
    """A Megatron configuration megatron-pec cannot checkpoint; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Slice:
    name: str             # "<item>/o<opt>.g<buffer>.b<bucket>.p<entry>.x<offset>.<kind>"
    item: str
    expert: ExpertId | None
    param_name: str
    param_start: int      # global coordinates: element range of the full (unsharded) parameter
    param_end: int
    dtype: torch.dtype
    locator: tuple        # (optimizer, buffer, dtype, bucket, entry, kind, offset) in the reshardable state

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def kind(self) -> str:
        return self.locator[5]


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside Megatron's (Chained)Optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    bad = [type(o).__name__ for o in inner if not isinstance(o, DistributedOptimizer)]
    if bad:
        raise UnsupportedSetup(f"megatron-pec needs Megatron's distributed optimizer (--use-distributed-optimizer); "
                               f"found {', '.join(bad)}")
    for o in inner:
        if o.ddp_config.use_megatron_fsdp:
            raise UnsupportedSetup("megatron-pec does not support Megatron FSDP (--use-megatron-fsdp) yet; "
                                   "use the distributed optimizer with Megatron DDP")
        if o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise UnsupportedSetup("megatron-pec does not support --use-precision-aware-optimizer yet; "
                                   "drop that flag to use megatron-pec")
    return inner


def state_kinds(opt) -> tuple[str, ...]:
    """The per-element state tensors ``opt`` (a DistributedOptimizer) keeps per main param."""
    inner = opt.optimizer
    name = type(inner).__name__
    if any(g.get("amsgrad") for g in inner.param_groups):
        raise UnsupportedSetup("megatron-pec does not save AMSGrad's max_exp_avg_sq; use Adam without amsgrad")
    if name not in STATE_KINDS:
        raise UnsupportedSetup(f"megatron-pec does not know the state of optimizer {type(inner).__module__}.{name} "
                               f"(it knows {', '.join(sorted(STATE_KINDS))}); use one of those")
    return STATE_KINDS[name]


def main_param(opt, model_param) -> torch.Tensor:
    """The fp32 main-param shard of ``model_param``.

    Read from param_groups directly: ``_get_main_param_and_optimizer_states`` would
    touch ``optimizer.state`` (a defaultdict) and create empty entries, after which
    Megatron's ``load_state_dict`` no longer allocates the Adam moments.
    """
    group, order = opt.model_param_group_index_map[model_param]
    return opt.optimizer.param_groups[group]["params"][order]


def build_slices(model_chunks, optimizer) -> list[Slice]:
    """The static slice table: names, items, sizes. Needs no optimizer state to exist yet."""
    optimizers = distributed_optimizers(optimizer)
    pieces, names = {}, {}
    for chunk in model_chunks:
        pieces.update(param_pieces(chunk))
        names.update({p: n for n, p in chunk.named_parameters()})
    slices = []
    for oi, opt in enumerate(optimizers):
        moment_dtype = getattr(opt.config, "exp_avg_dtype", torch.float32)
        for gi, by_dtype in enumerate(opt.gbuf_ranges):
            for dtype, buckets in by_dtype.items():
                for bi, bucket in enumerate(buckets):
                    for ei, (param, ranges) in enumerate(bucket["param_map"].items()):
                        owned = ranges["param"]
                        main = main_param(opt, param)
                        for piece in pieces[param]:
                            lo, hi = max(piece.start, owned.start), min(piece.end, owned.end)
                            if lo >= hi:
                                continue
                            item = item_name(piece.expert)
                            for kind in ("param", *state_kinds(opt)):
                                offset = lo - owned.start
                                slices.append(Slice(
                                    f"{item}/o{oi}.g{gi}.b{bi}.p{ei}.x{offset}.{kind}", item, piece.expert,
                                    names[param], lo, hi, main.dtype if kind == "param" else moment_dtype,
                                    (oi, gi, dtype, bi, ei, kind, offset)))
    return slices


def slot_order(slices: list[Slice]) -> list[Slice]:
    """The slices as a snapshot slot lays them out: item by item (each item's bytes together: a
    partial snapshot, persist or carry moves whole items), and within an item kind by kind (its main
    params, then its first moments, ...), each in buffer order. Consecutive slices of a kind then
    follow each other in the optimizer's memory as well wherever its tensors do (Megatron's param
    buffer, ``contiguous.py``), and ``coalesce`` copies them at once."""
    items: dict[str, int] = {}
    kinds: dict[str, int] = {"param": 0}
    for s in slices:
        items.setdefault(s.item, len(items))
        kinds.setdefault(s.kind, len(kinds))
    return sorted(slices, key=lambda s: (items[s.item], kinds[s.kind]))  # (stable: buffer order within)


def live_views(slices: list[Slice], optimizer) -> dict[str, torch.Tensor] | None:
    """Views into the optimizer's current main params and state (Adam's moments, ...), by slice name;
    None while the optimizer has no state yet (no step taken: fp16 loss scaling skips the first ones).

    Valid until the optimizer replaces its state tensors (``load_state_dict`` does);
    the optimizer's steps update them in place.
    """
    if not has_state(optimizer):
        return None  # (asking Megatron for the state now would create empty entries it then trips on)
    optimizers = distributed_optimizers(optimizer)
    states = [o.get_parameter_state_dp_reshardable() for o in optimizers]
    views = {}
    for s in slices:
        oi, gi, dtype, bi, ei, kind, offset = s.locator
        tensors = states[oi][gi][dtype][bi][ei]
        if kind not in tensors:
            return None
        views[s.name] = tensors[kind].view(-1)[offset: offset + s.numel]
    return views


def check_state_keys(optimizer) -> None:
    """Refuse per-parameter optimizer state megatron-pec would not keep (keys beyond ``step`` and the
    slice kinds, e.g. AMSGrad's ``max_exp_avg_sq``): checked once the optimizer has state."""
    for opt in distributed_optimizers(optimizer):
        known = {"step", *state_kinds(opt)}
        for state in opt.optimizer.state.values():
            unknown = sorted(set(state) - known)
            if unknown:
                raise UnsupportedSetup(f"{type(opt.optimizer).__name__} keeps per-parameter state {unknown}, which "
                                       f"megatron-pec does not save (it keeps {sorted(known)}); use Megatron's own "
                                       "checkpointing for this optimizer configuration")
            break  # (every parameter's state has the same keys)


def has_state(optimizer) -> bool:
    """Whether every inner optimizer has taken a step (holds per-param state)."""
    return stepped(distributed_optimizers(optimizer))


def stepped(optimizers: list) -> bool:
    """``has_state`` of the ``distributed_optimizers`` found once (a save asks at every iteration). Reads
    the state dicts without indexing them: they are defaultdicts."""
    return all(any(state for state in o.optimizer.state.values()) for o in optimizers)


def stateless_views(slices: list[Slice], optimizer) -> dict[str, torch.Tensor]:
    """Before the first optimizer step: the main params, and zeros for the state the optimizer does
    not have yet (a restore of such a save leaves the optimizer without state, as it was)."""
    optimizers = distributed_optimizers(optimizer)
    return {s.name: param_view(optimizers, s) if s.kind == "param" else torch.zeros(s.numel, dtype=s.dtype)
            for s in slices}


def param_view(optimizers: list, s: Slice) -> torch.Tensor:
    """The main-param range of ``s`` (a ``param`` slice), from the param groups: valid even before
    Adam has state (``--no-load-optim`` restores only the weights)."""
    oi, gi, dtype, bi, ei, _, offset = s.locator
    model_param = list(optimizers[oi].gbuf_ranges[gi][dtype][bi]["param_map"])[ei]
    return main_param(optimizers[oi], model_param).view(-1)[offset: offset + s.numel]


def fingerprint(slices: list[Slice], topology: dict) -> str:
    """Changes whenever a saved slice would no longer fit the live model the same way."""
    h = hashlib.sha256(json.dumps(topology, sort_keys=True).encode())
    for s in slices:
        h.update(f"{s.name}:{s.param_name}:{s.param_start}:{s.param_end}:{s.dtype};".encode())
    return h.hexdigest()[:16]


def topology() -> dict:
    from megatron.core import parallel_state as ps

    return {"world_size": torch.distributed.get_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    # CUDA-graph-safe trackers (--te-rng-tracker, --cuda-graph-impl) hold torch.Generator objects:
    # their state tensor is what is saved.
    tracker = {name: value.get_state() if isinstance(value, torch.Generator) else value
               for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    state = {"random": python_state(), "numpy": numpy_state(), "torch": torch.get_rng_state(),
             "tracker": tracker}
    if torch.cuda.is_initialized():  # (initialized implies available; is_available() costs more per save)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def buffer_refs(model_chunks) -> list[tuple[str, torch.nn.Module, str]]:
    """Model state that is not a parameter: every persistent buffer of every chunk (the router's
    ``expert_bias`` of aux-loss-free balancing, for one), as (``<chunk>/<name>``, module, attribute).
    Found once; read through the module at every save (Megatron may rebind a buffer's ``.data``)."""
    refs = []
    for index, chunk in enumerate(model_chunks):
        # by identity: wrappers (DDP, Float16Module) name their state_dict without their own prefix
        persistent = {id(t) for t in chunk.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
        for module_name, module in chunk.named_modules():
            for attr, buffer in module.named_buffers(recurse=False):
                if buffer is not None and id(buffer) in persistent:
                    refs.append((f"{index}/{module_name}.{attr}", module, attr))
    return refs


def module_buffers(refs) -> dict[str, torch.Tensor]:
    return {key: getattr(module, attr) for key, module, attr in refs}


def host_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies on the host of live tensors, one device-to-host copy per device and dtype (not one per
    tensor: a buffer per MoE layer)."""
    out, groups = {}, {}
    for key, t in tensors.items():
        if t.device.type == "cpu":
            out[key] = t.detach().clone()
        else:
            groups.setdefault((t.device, t.dtype), []).append(key)
    for keys in groups.values():
        flat = torch.cat([tensors[k].detach().reshape(-1) for k in keys]).cpu()
        for key, piece in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[key] = piece.view(tensors[key].shape)
    return {key: out[key] for key in tensors}


_SCALARS = frozenset({int, float, str, bool, type(None)})


def _detached(obj):
    """``obj`` (a state_dict) with every tensor in it copied to the host: what the hand-over thread may
    encode after training has gone on (a grad scaler's state holds live device tensors)."""
    if type(obj) in _SCALARS:  # (most of a state_dict: checked first, by one lookup, at every save)
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: v if type(v) in _SCALARS else _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


def small_state(optimizer, scheduler, train_args, iteration: int, flops: float, buffers=(), state_dict=None,
                grad_scalers=None, optimizers=None, **beyond) -> SmallState:
    """Everything besides the slices that Megatron's checkpoint holds for this rank (``buffers``:
    ``buffer_refs``; ``state_dict``: what computes the optimizer's, default its own ``state_dict``),
    none of it live state: it may be encoded later, while training goes on (``train_args``: Megatron's
    arguments, for the sample counters). The model's state beyond
    the optimizer (frozen, extra state, rerun state, ...) is the adapter's: ``beyond``, fields of the
    record; ``grad_scalers``: what gives the grad scalers' state, saved on its own before the first step
    (after it, the optimizer's state holds it); ``optimizers``: its ``distributed_optimizers``, if found before."""
    has = stepped(optimizers if optimizers is not None else distributed_optimizers(optimizer))
    return SmallState(
        buffers=host_copies(module_buffers(buffers)),
        iteration=iteration,
        # None before the first step: Megatron's state_dict needs a step count then missing
        optimizer=_detached((state_dict or optimizer.state_dict)()) if has else None,
        scheduler=_detached(scheduler.state_dict()) if scheduler is not None else None,
        rng=rng_state(),
        num_floating_point_operations_so_far=flops,
        consumed_train_samples=getattr(train_args, "consumed_train_samples", 0),
        skipped_train_samples=getattr(train_args, "skipped_train_samples", 0),
        consumed_valid_samples=getattr(train_args, "consumed_valid_samples", 0),
        checkpoint_version=3.0,
        grad_scaler=None if has or grad_scalers is None else grad_scalers(),
        **beyond,
    )


__all__ = ["Slice", "build_slices", "slot_order", "live_views", "param_view", "small_state", "buffer_refs",
           "module_buffers", "fingerprint", "topology", "NON_EXPERT", "UnsupportedSetup"]
