"""Model and training state beyond the optimizer's slices that Megatron's own checkpoint keeps: frozen
parameters, modules' extra state (Transformer Engine's FP8 scaling), the rerun state machine, the
arguments ``check_checkpoint_args`` compares, the grad scaler before the first step; and the start-up
check that refuses, naming it, any state Megatron would save that megatron-pec does not keep.

Runs on every rank, with no communication. Found once (``ModelState.of``), captured at every save into
the small state (host copies: the hand-over encodes them later), restored by ``restore``. Keys are
``<chunk>/<global name>`` (``expert_params.global_names``: experts by their global id, layers by their global
number), so that a restore onto another data- or expert-parallel layout finds each module's state in
the old rank that held it.

megatron-pec never unpickles an extra state: a module's ``get_extra_state`` result is kept as the tensor
it is (Transformer Engine's: a uint8 tensor of its own pickle) and handed back to ``set_extra_state``.
"""

from __future__ import annotations

import enum

import torch

from megatron_pec.common.errors import CheckpointError
from megatron_pec.megatron.collect import _detached

# The arguments Megatron-LM's check_checkpoint_args compares (core_v0.16.1 and core_v0.19.0), and those
# its conditions and --override-ckpt-iteration read.
CHECKED_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                "max_position_embeddings", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
                "data_parallel_random_init", "global_batch_size", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "vocab_file")
# Frozen parameters live in the small state (base64 in every snapshot's header): kept for a few per rank
# (frozen norms, embeddings of a small vocabulary, a stand-in's tables), refused beyond this.
FROZEN_MAX = 64 << 20
EXTRA_STATE_MARGIN = 4096  # bytes an extra state may grow beyond its size at start-up (TE's is fixed per recipe)


class UnkeptState(CheckpointError):
    """State Megatron's checkpoint would keep and megatron-pec cannot: refused at start-up."""


def _has_extra_state(module: torch.nn.Module) -> bool:
    # (torch's own test in Module.state_dict)
    return getattr(type(module), "get_extra_state", torch.nn.Module.get_extra_state) \
        is not torch.nn.Module.get_extra_state


def _unwrapped(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


class ModelState:
    """This rank's frozen parameters and modules with extra state, found once."""

    def __init__(self, frozen: list, extra: list, sizes: dict[str, int]):
        self.frozen = frozen    # [(key, parameter)]
        self.extra = extra      # [(key, module)]
        self.sizes = sizes      # key -> bytes of its extra state at start-up

    @classmethod
    def of(cls, model_chunks, global_names: list, buffer_ids: set[int]) -> "ModelState":
        """Walk the chunks (``global_names``: ``expert_params.global_names`` of each); refuse (``UnkeptState``) what no
        kind of saved state covers. ``buffer_ids``: the ids of the persistent buffers ``collect.buffer_refs``
        keeps."""
        frozen, extra, sizes, unkept = [], [], {}, []
        for index, (chunk, (params, modules)) in enumerate(zip(model_chunks, global_names)):
            for param, name in params.items():
                if not param.requires_grad:
                    frozen.append((f"{index}/{name}", param))
            for module, name in modules.items():
                if not _has_extra_state(module):
                    continue
                key = f"{index}/{name}"
                state = module.get_extra_state()
                if state is None:
                    # (megatron-core's own linear layers return None for TE compatibility, always; their
                    # set_extra_state ignores what it is given: nothing to keep)
                    continue
                if not isinstance(state, torch.Tensor):
                    unkept.append(f"the extra state of module {name or type(module).__name__} "
                                  f"({type(module).__name__}.get_extra_state returns a {type(state).__name__}, "
                                  "not a tensor: megatron-pec keeps tensors only and never pickles)")
                    continue
                extra.append((key, module))
                sizes[key] = state.numel() * state.element_size()
            kept = {id(p) for p in params} | buffer_ids
            for key, value in _unwrapped(chunk).state_dict(keep_vars=True).items():
                if key.endswith("_extra_state") or (isinstance(value, torch.Tensor) and id(value) in kept):
                    continue
                unkept.append(f"model state {key!r} ({type(value).__name__}: neither a parameter, a persistent "
                              "buffer nor a module's extra state)")
        frozen_bytes = sum(p.numel() * p.element_size() for _, p in frozen)
        if frozen_bytes > FROZEN_MAX:
            largest = sorted(frozen, key=lambda kp: -kp[1].numel() * kp[1].element_size())[:3]
            unkept.append(f"frozen parameters of {frozen_bytes / 2**20:.1f} MiB on this rank (largest: "
                          f"{', '.join(k for k, _ in largest)}; megatron-pec keeps up to {FROZEN_MAX >> 20} MiB "
                          "of them, in every snapshot's metadata)")
        unkept += _modelopt_state(model_chunks)
        if unkept:
            raise UnkeptState("megatron-pec would not keep state Megatron's own checkpoint keeps: "
                              + "; ".join(unkept) + ". Nothing was saved; use Megatron's own checkpointing "
                              "(drop megatron-pec) for this model, or remove what is named")
        return cls(frozen, extra, sizes)

    def frozen_copies(self) -> dict[str, torch.Tensor]:
        return {key: p.detach().to("cpu", copy=True) for key, p in self.frozen}

    def extra_states(self) -> dict[str, torch.Tensor]:
        """Every module's extra state now, on the host; refuses one grown past its start-up size and margin
        (the small state's bound, hence the slots' header room, was sized from it)."""
        out = {}
        for key, module in self.extra:
            state = module.get_extra_state()
            if not isinstance(state, torch.Tensor):
                raise UnkeptState(f"the extra state of module {key} is now a {type(state).__name__}, not a tensor")
            if state.numel() * state.element_size() > self.sizes[key] + EXTRA_STATE_MARGIN:
                raise CheckpointError(f"the extra state of module {key} grew to {state.numel() * state.element_size()} "
                                      f"bytes from {self.sizes[key]} at start-up, beyond the room sized for it: "
                                      "restart the job (the room is sized again at start-up)")
            out[key] = state.detach().to("cpu", copy=True)
        return out

    def extra_state_margin(self) -> int:
        return len(self.extra) * EXTRA_STATE_MARGIN

    def kinds(self) -> list[str]:
        out = []
        if self.frozen:
            out.append(f"frozen parameters ({len(self.frozen)})")
        if self.extra:
            out.append(f"modules' extra state ({len(self.extra)})")
        return out

    # ---- restore -------------------------------------------------------------------------------------
    @torch.no_grad()
    def restore(self, saved_frozen: dict | None, saved_extra: dict | None) -> None:
        """Frozen parameters and extra states back into the model (checkpoints written before they were
        saved have neither: the model keeps its own). A missing one is an error naming it."""
        if saved_frozen is not None:
            missing = [key for key, _ in self.frozen if key not in saved_frozen]
            if missing:
                raise CheckpointError(f"the checkpoint lacks the frozen parameters {missing}: was it saved with "
                                      "other model flags (which parameters are frozen)?")
            for key, param in self.frozen:
                saved = saved_frozen[key]
                if saved.shape != param.shape or saved.dtype != param.dtype:
                    raise CheckpointError(f"frozen parameter {key} is {saved.dtype} {tuple(saved.shape)} in the "
                                          f"checkpoint, {param.dtype} {tuple(param.shape)} in the model")
                param.copy_(saved)
        if saved_extra is not None:
            missing = [key for key, _ in self.extra if key not in saved_extra]
            if missing:
                raise CheckpointError(f"the checkpoint lacks the extra state of modules {missing}: was it saved "
                                      "with another model (for example without Transformer Engine layers)?")
            for key, module in self.extra:
                module.set_extra_state(saved_extra[key])


def _modelopt_state(model_chunks) -> list[str]:
    """ModelOpt's state, which Megatron-LM saves when modelopt is installed and the model converted."""
    try:
        from modelopt.torch.opt import ModeloptStateManager
    except Exception:  # not installed (or broken): Megatron-LM saves none either
        return []
    return [f"ModelOpt state of model chunk {i} (quantization / distillation modes)"
            for i, chunk in enumerate(model_chunks) if ModeloptStateManager.is_converted(_unwrapped(chunk))]


# ---- Megatron's other state ------------------------------------------------------------------------------
def checkpoint_args(args) -> dict:
    """The arguments check_checkpoint_args compares, as JSON-safe values."""
    return {name: _plain(getattr(args, name)) for name in CHECKED_ARGS if hasattr(args, name)}


def _plain(value):
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def check_args(args, saved: dict | None, checkpoint_version: float = 3.0) -> None:
    """Megatron-LM's check_checkpoint_args on the saved arguments: its comparisons, its conditions, its
    message (a CheckpointError naming the argument). A checkpoint without them is not checked."""
    if saved is None:
        return

    def compare(name: str, default=None):
        if not hasattr(args, name):
            return  # (not a Megatron-LM run: the trainer has no such argument)
        value = saved.get(name, default) if default is not None else saved.get(name)
        live = _plain(getattr(args, name))
        if value != live:
            raise CheckpointError(f"{name} value from checkpoint ({value}) is not equal to the input argument "
                                  f"value ({live}).")

    compare("num_layers")
    compare("hidden_size")
    compare("num_attention_heads")
    compare("add_position_embedding", default=True)
    if getattr(args, "vocab_file", None):
        compare("max_position_embeddings")
        compare("make_vocab_size_divisible_by")
        compare("padded_vocab_size")
        compare("tokenizer_type")
    if getattr(args, "data_parallel_random_init", False):
        compare("data_parallel_random_init")
    if getattr(args, "phase_transition_iterations", None):
        compare("global_batch_size")
    if checkpoint_version >= 3.0:  # (megatron-pec's format is not a dist checkpoint: Megatron compares them)
        compare("tensor_model_parallel_size")
        compare("pipeline_model_parallel_size")


def _rerun_module():
    try:
        from megatron.core import rerun_state_machine
    except ImportError:
        return None
    return rerun_state_machine


def rerun_enabled() -> bool:
    """A rerun state machine exists and is enabled (what Megatron's save then may keep)."""
    module = _rerun_module()
    machine = getattr(module, "_GLOBAL_RERUN_STATE_MACHINE", None) if module else None
    return machine is not None and machine.mode != module.RerunMode.DISABLED


def rerun_state(data_iterator) -> dict | None:
    """What Megatron's save_checkpoint stores of the rerun state machine, as the installed release does
    (core 0.16: only while a rerun is pending; 0.19: whenever it is enabled), JSON-safe: its enums by
    name, its per-rank part unwrapped from the ShardedObject. None without a machine (Megatron would
    create a disabled one, which saves nothing)."""
    module = _rerun_module()
    if module is None or module._GLOBAL_RERUN_STATE_MACHINE is None:
        return None
    state = module._GLOBAL_RERUN_STATE_MACHINE.state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")
    if state is None:
        return None
    sharded = state["sharded"]
    # (host copies: a pending rerun's saved micro-batches and initial result may live on the device)
    return _detached(_enums_out({**state, "sharded": getattr(sharded, "data", sharded)}))


def restore_rerun_state(saved: dict | None) -> bool:
    """Megatron's load: the saved rerun state back into the machine when it says a rerun is pending
    (``validate_state_dict``); returns whether it was."""
    module = _rerun_module()
    if saved is None or module is None:
        return False
    state = _enums_in(saved, module)
    machine = module.get_rerun_state_machine()
    if not machine.validate_state_dict(state):
        return False
    machine.load_state_dict(state)
    return True


# The rerun state machine's own types in its state_dict: rebuilt by name from its module (and only these).
_ENUMS = ("RerunMode", "RerunState", "RerunDiagnostic")
_TUPLES = ("Call", "Caller")


def _enums_out(obj):
    if isinstance(obj, enum.Enum):
        return {"__enum__": type(obj).__name__, "name": obj.name}
    if isinstance(obj, tuple) and type(obj).__name__ in _TUPLES and hasattr(obj, "_fields"):
        return {"__namedtuple__": type(obj).__name__, "values": [_enums_out(v) for v in obj]}
    if isinstance(obj, dict):
        return {k: _enums_out(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_enums_out(v) for v in obj)
    return obj


def _enums_in(obj, module):
    if isinstance(obj, dict):
        if set(obj) == {"__enum__", "name"} and obj["__enum__"] in _ENUMS:
            return getattr(module, obj["__enum__"])[obj["name"]]
        if set(obj) == {"__namedtuple__", "values"} and obj["__namedtuple__"] in _TUPLES:
            return getattr(module, obj["__namedtuple__"])(*(_enums_in(v, module) for v in obj["values"]))
        return {k: _enums_in(v, module) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_enums_in(v, module) for v in obj)
    return obj


RERUN_ROOM_MAX = 16 << 20  # the most header room sized for a pending rerun's saved micro-batches


def rerun_margin(args) -> int:
    """Header room for the rerun state machine's state: 64 KiB, plus, for a pending rerun's saved
    micro-batches (one iteration's tokens, labels, loss mask, position ids; base64 in the small state),
    an estimate capped at RERUN_ROOM_MAX (an attention mask in the batch, seq x seq, would take gigabytes
    of node memory in every slot for an event of a faulty GPU); 0 while the machine is disabled. A pending
    rerun whose state does not fit is refused at its save, with a message (``check_rerun_room``)."""
    if not rerun_enabled():
        return 0
    mbs, seq = getattr(args, "micro_batch_size", 1) or 1, getattr(args, "seq_length", 0) or 0
    microbatches = max(1, (getattr(args, "global_batch_size", 1) or 1)
                       // (mbs * max(1, getattr(args, "data_parallel_size", 1) or 1)))
    return min(2 * microbatches * mbs * seq * 4 * 8, RERUN_ROOM_MAX) + (64 << 10)


def check_rerun_room(state: dict | None, room: int) -> None:
    """A pending rerun's state (with its saved micro-batches) must fit the room sized at start-up."""
    if not state or not (state.get("sharded") or {}).get("data_iterator_checkpoints"):
        return
    from megatron_pec.format import small_state

    size = len(small_state.dumps(state))
    if size > room:
        raise CheckpointError(
            f"the rerun state machine's pending rerun saves {size} bytes (its saved micro-batches), more than the "
            f"{room} bytes megatron-pec sized for it at start-up: this checkpoint for fault attribution cannot be "
            "kept; rerun the iteration with Megatron's own checkpointing (drop megatron-pec), or a smaller batch")


def grad_scalers(optimizers) -> list | None:
    """The grad scalers' state (fp16), for a save before the first step (Megatron's optimizer state_dict
    then needs a step count and megatron-pec stores none; the scaler's warm-up must not repeat)."""
    states = [o.grad_scaler.state_dict() if o.grad_scaler is not None else None for o in optimizers]
    return None if all(s is None for s in states) else states


def restore_grad_scalers(optimizers, saved: list | None) -> None:
    if saved is None:
        return
    for opt, state in zip(optimizers, saved):
        if opt.grad_scaler is not None and state is not None:
            opt.grad_scaler.load_state_dict(state)


__all__ = ["ModelState", "UnkeptState", "checkpoint_args", "check_args", "rerun_enabled", "rerun_state",
           "restore_rerun_state", "rerun_margin", "check_rerun_room", "grad_scalers", "restore_grad_scalers"]
