"""The optimizer's per-element state, bucket by bucket, in one tensor per kind.

Runs on every rank once its optimizer has state, when the engine binds its views of it (again after
Megatron's ``load_state_dict`` replaced the state). torch's and apex/TE's Adam allocate each
param's moments on their own, so a snapshot copied them slice by slice: thousands of small copies
on a large MoE rank (one launch each on GPU). Here each bucket's ``exp_avg`` (and ``exp_avg_sq``)
tensors become views of one tensor, laid out in the order the slot holds them (``collect.slot_order``:
item by item), so ``coalesce`` copies a run of experts' moments at once. The values, dtypes and
shapes stay as they were, and the optimizer updates the views in place as it did its own tensors.
"""

from __future__ import annotations

import torch

from megatron_pec.megatron.collect import Slice, main_param, state_kinds


@torch.no_grad()
def place_state_contiguously(optimizers: list, slot_slices: list[Slice], keep_values: bool = True) -> None:
    """Move each bucket's state tensors (per kind) into one tensor, params in ``slot_slices``' order.
    Tensors already laid out so, or not all alike (dtype, device, layout), stay. The extra memory at
    any moment is one bucket's tensors of one kind. ``keep_values=False``: their values are not
    copied (a restore overwrites every one of them next)."""
    order: dict[tuple, dict[int, None]] = {}  # (optimizer, buffer, dtype, bucket) -> its params' entries
    for s in slot_slices:
        if s.kind == "param":
            order.setdefault(s.locator[:4], {})[s.locator[4]] = None
    for (oi, gi, dtype, bi), entries in order.items():
        opt = optimizers[oi]
        params = list(opt.gbuf_ranges[gi][dtype][bi]["param_map"])
        states = [opt.optimizer.state.get(main_param(opt, params[ei])) for ei in entries]
        if not all(states):
            continue
        for kind in state_kinds(opt):
            if _packable([state.get(kind) for state in states]):
                flat = torch.empty(sum(state[kind].numel() for state in states), dtype=states[0][kind].dtype,
                                   device=states[0][kind].device)
                offset = 0
                for state in states:
                    old = state[kind]
                    state[kind] = flat[offset:offset + old.numel()].view(old.shape)
                    if keep_values:
                        state[kind].copy_(old)
                    offset += old.numel()  # (the old tensor is freed: the optimizer held the only reference)


def _packable(tensors: list) -> bool:
    """Alike (contiguous tensors of one dtype and device), and not already one after the other."""
    if not tensors or any(not torch.is_tensor(t) or not t.is_contiguous() for t in tensors):
        return False
    first = tensors[0]
    if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return False
    # (a second binding finds them placed)
    return not all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(tensors, tensors[1:]))


__all__ = ["place_state_contiguously"]
