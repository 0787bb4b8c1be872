"""Expert identity of parameters: the only code that knows how Megatron names experts.

PEC saves a subset of experts per MoE layer, so every element of every parameter must
be attributed to either non-expert state or one expert ``(global layer, global expert)``.
The ``allreduce`` attribute cannot tell (it is True for expert parameters when EP = 1),
so identity comes from the parameter name under the MoE layer's ``experts`` module and
the layer's ``local_expert_indices``. Runs on every rank, once per model chunk at setup
(no communication); later phases reuse the result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_pec.format.item_names import ExpertId

__all__ = ["ParamPiece", "parse_expert_param_name", "param_pieces", "global_names"]


@dataclass(frozen=True)
class ParamPiece:
    """A contiguous element range of one flattened parameter and the item it belongs to."""

    expert: ExpertId | None  # None = non-expert state
    start: int  # element offset within the flattened parameter (inclusive)
    end: int  # exclusive


# megatron-core 0.16.1, megatron/core/transformer/moe/experts.py:
#   SequentialMLP  local_experts.{i}.linear_fc{1,2}.{weight,bias}   (one MLP per local expert)
#   TEGroupedMLP   linear_fc{1,2}.{weight,bias}{i}                  (TE GroupedLinear)
#   GroupedMLP     weight1, weight2                                 (all local experts in one tensor)
# The optional prefix is the dotted path to the experts module; "(^|\.)experts\." keeps
# "shared_experts." (a dense MLP) out.
_EXPERT_PARAM = re.compile(
    r"^(?:(?:.*\.)?experts\.)?(?:"
    r"local_experts\.(?P<seq>\d+)\.linear_fc[12]\.(?:weight|bias)"
    r"|linear_fc[12]\.(?:weight|bias)(?P<te>\d+)"
    r"|(?P<grouped>weight[12])"
    r")$"
)


def parse_expert_param_name(name: str) -> tuple[str, int | None] | None:
    """``(layout, local expert index)`` for an expert parameter name, else None.

    ``name`` is relative to the experts module (``local_experts.0.linear_fc1.weight``)
    or a full dotted name (``decoder.layers.3.mlp.experts.linear_fc2.weight1``). layout is
    ``sequential``, ``te_grouped`` or ``grouped``; the index is None for ``grouped``
    (legacy GroupedMLP), whose weight1/weight2 hold every local expert.
    """
    match = _EXPERT_PARAM.match(name)
    if match is None:
        return None
    if match["seq"] is not None:
        return "sequential", int(match["seq"])
    if match["te"] is not None:
        return "te_grouped", int(match["te"])
    return "grouped", None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # Megatron's DistributedDataParallel and Float16Module keep the model in `.module`.
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def _expert_pieces(moe, layer: int) -> dict[torch.nn.Parameter, tuple[ParamPiece, ...]]:
    experts = moe.experts
    local_ids = list(moe.local_expert_indices)
    pieces: dict[torch.nn.Parameter, tuple[ParamPiece, ...]] = {}
    for name, param in experts.named_parameters():
        parsed = parse_expert_param_name(name)
        if parsed is None:
            raise ValueError(
                f"MoE layer {layer}: parameter {name!r} of {type(experts).__name__} is not in a known "
                "expert layout (SequentialMLP, TEGroupedMLP, GroupedMLP); "
                "megatron_pec.megatron.expert_params must learn it before PEC can checkpoint this model"
            )
        layout, local = parsed
        numel = param.numel()
        if layout == "grouped":
            # GroupedMLP.forward views weight1 as [num_local_experts, hidden, -1] and weight2 as
            # [num_local_experts, -1, hidden]: expert i is the i-th contiguous chunk.
            n = len(local_ids)
            if numel % n:
                raise ValueError(
                    f"MoE layer {layer}: {name} has {numel} elements, not divisible by {n} local experts"
                )
            size = numel // n
            pieces[param] = tuple(
                ParamPiece(ExpertId(layer, g), i * size, (i + 1) * size) for i, g in enumerate(local_ids)
            )
        else:
            if local >= len(local_ids):
                raise ValueError(f"MoE layer {layer}: {name} names local expert {local}, "
                                 f"but the layer has {len(local_ids)} local experts")
            pieces[param] = (ParamPiece(ExpertId(layer, local_ids[local]), 0, numel),)
    return pieces


def param_pieces(model_chunk: torch.nn.Module) -> dict[torch.nn.Parameter, tuple[ParamPiece, ...]]:
    """Every parameter of a model chunk (wrapped or not) -> its pieces, in parameter order.

    Non-expert parameters (shared experts, routers included) are one ``(None, 0, numel)``
    piece. Expert parameters carry the MoE layer's global 1-based ``layer_number`` (it
    includes the pipeline offset; TransformerLayer sets it on its MoE layer) and the global
    expert id ``local_expert_indices[local index]``. Raises ValueError for an unknown
    expert layout or a MoE layer without a usable layer number.
    """
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    module = _unwrap(model_chunk)
    experts_of: dict[torch.nn.Parameter, tuple[ParamPiece, ...]] = {}
    seen_layers: set[int] = set()
    for moe in module.modules():
        if not isinstance(moe, BaseMoELayer) or moe.experts is None:
            continue
        layer = moe.layer_number
        if not isinstance(layer, int) or layer < 1 or layer in seen_layers:
            raise ValueError(f"MoE layer with layer_number={layer!r}: expected a unique global 1-based "
                             "layer number (set by TransformerLayer via set_layer_number)")
        seen_layers.add(layer)
        experts_of.update(_expert_pieces(moe, layer))
    return {
        p: experts_of.get(p) or (ParamPiece(None, 0, p.numel()),)
        for p in module.parameters()
    }


_LAYER_INDEX = re.compile(r"^(?P<prefix>decoder\.layers)\.(?P<index>\d+)\.")  # transformer layers only (not MTP)


def global_names(model_chunk: torch.nn.Module) -> tuple[dict[torch.nn.Parameter, str], dict[torch.nn.Module, str]]:
    """Every parameter and module of a chunk -> its name in the model as one rank without model
    parallelism would hold it: ``decoder.layers.<i>`` numbered by the layer's global number (pipeline
    stages number their layers from 0) and experts by their global id (each EP rank numbers its own
    from 0). Parameters of the legacy GroupedMLP, whose one tensor holds all local experts, keep their
    name."""
    module = _unwrap(model_chunk)
    layer_of = {name: m.layer_number for name, m in module.named_modules()
                if _LAYER_INDEX.match(name + ".") and name.rsplit(".", 1)[-1].isdigit()
                and isinstance(getattr(m, "layer_number", None), int)}

    def renumbered(name: str) -> str:
        match = _LAYER_INDEX.match(name + ".")
        if match and (number := layer_of.get(f"{match['prefix']}.{match['index']}")) is not None:
            return f"{match['prefix']}.{number - 1}.{name[match.end():]}".rstrip(".")
        return name

    pieces = param_pieces(model_chunk)
    params = {}
    for name, param in module.named_parameters():
        name = renumbered(name)
        expert = pieces[param][0].expert if len(pieces[param]) == 1 else None
        parsed = parse_expert_param_name(name)
        if expert is not None and parsed is not None and parsed[1] is not None:
            name = _with_expert_index(name, parsed[0], expert.expert)
        params[param] = name
    return params, {m: renumbered(name) for name, m in module.named_modules()}


def _with_expert_index(name: str, layout: str, expert: int) -> str:
    if layout == "sequential":
        return re.sub(r"local_experts\.\d+\.", f"local_experts.{expert}.", name)
    return re.sub(r"(weight|bias)\d+$", rf"\g<1>{expert}", name)
