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


def _buckets(optimizers: list, slot_slices: list[Slice]):
    """(optimizer, the main params of one bucket in ``slot_slices``' order) for every bucket of a slice."""
    order: dict[tuple, dict[int, None]] = {}  # (optimizer, buffer, dtype, bucket) -> its params' entries
    for s in slot_slices:
        if s.kind == "param":
            order.setdefault(s.locator[:4], {})[s.locator[4]] = None
    for (oi, gi, dtype, bi), entries in order.items():
        opt = optimizers[oi]
        params = list(opt.gbuf_ranges[gi][dtype][bi]["param_map"])
        yield opt, [main_param(opt, params[ei]) for ei in entries]


@torch.no_grad()
def fresh_moments(optimizers: list, slot_slices: list[Slice], kinds: tuple[str, ...]) -> dict:
    """A fresh optimizer's state tensors of ``kinds`` (uninitialised: a restore overwrites them next), already
    placed as ``place_state_contiguously`` places them: main param -> kind -> its view of one tensor per bucket
    and kind. One allocation per bucket and kind, not one per param and kind and then one more to place them
    (on a GPU each allocation of the caching allocator's is a driver call the first time)."""
    out: dict = {}
    for _, mains in _buckets(optimizers, slot_slices):
        if any(m.dtype != mains[0].dtype or m.device != mains[0].device for m in mains):
            continue  # (not alike: each gets its own, as the optimizer allocates them)
        total = sum(m.numel() for m in mains)
        for kind in kinds:
            flat, offset = torch.empty(total, dtype=mains[0].dtype, device=mains[0].device), 0
            for m in mains:
                out.setdefault(m, {})[kind] = flat[offset:offset + m.numel()].view(m.shape)
                offset += m.numel()
    return out


@torch.no_grad()
def place_state_contiguously(optimizers: list, slot_slices: list[Slice], keep_values: bool = True) -> None:
    """Move each bucket's state tensors (per kind) into one tensor, params in ``slot_slices``' order.
    Tensors already laid out so, or not all alike (dtype, device, layout), stay. The extra memory at
    any moment is one bucket's tensors of one kind. ``keep_values=False``: their values are not
    copied (a restore overwrites every one of them next)."""
    for opt, mains in _buckets(optimizers, slot_slices):
        states = [opt.optimizer.state.get(m) for m in mains]
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


__all__ = ["fresh_moments", "place_state_contiguously"]
