"""Where each of a rank's slices lies in the model's global parameters (``format.protocol.RankLayout``): what
a restore onto other parallel sizes and the export read (``restore/reshard.py``, ``tools/export.py``)."""

from __future__ import annotations

from megatron_pec.format.protocol import GlobalParam, RankLayout
from megatron_pec.format.stformat import dtype_code
from megatron_pec.megatron import collect, expert_params


def rank_layout(fingerprint: str, rank: int, topology: dict, slices: list, optimizers: list, global_names,
                buffers) -> RankLayout:
    """``slices``: the rank's (``collect.Slice``); ``global_names``: per model chunk, (param -> its global
    name, module -> its global name); ``buffers``: ``collect.buffer_refs``."""
    names, module_names = {}, {}
    for params, modules in global_names:
        names.update(params)
        module_names.update(modules)
    param_maps = {}  # (optimizer, buffer, dtype, bucket) -> the bucket's params in order
    index, params, placed = {}, [], {}
    for s in slices:
        oi, gi, dtype, bi, ei, _, _ = s.locator
        key = (oi, gi, dtype, bi)
        if key not in param_maps:
            param_maps[key] = list(optimizers[oi].gbuf_ranges[gi][dtype][bi]["param_map"])
        param = param_maps[key][ei]
        if param not in index:
            index[param] = len(params)
            main = collect.main_param(optimizers[oi], param)
            params.append(GlobalParam(names[param], list(param.shape), dtype_code(main.dtype)))
        placed[s.name] = [index[param], s.param_start, s.param_end]
    held = {key: f"{module_names[module]}.{attr}" for key, module, attr in buffers}
    why = ""
    if topology["tp"] > 1:
        why = "tensor parallelism splits each parameter (TP > 1): the ranges are within each TP rank's part"
    elif any(expert_params.parse_expert_param_name(p.name) == ("grouped", None) for p in params):
        why = "the legacy GroupedMLP holds all local experts in one tensor (--moe-grouped-gemm without TE)"
    return RankLayout(fingerprint, rank, topology, params, placed, held, why)


__all__ = ["rank_layout"]
