"""Per-expert token counts from forward hooks on Megatron's MoE routers.

Installed once per model on every rank. The hook adds ``routing_map.sum(0)``
(tokens routed to each global expert in this micro-batch) to a counter that
stays on the router's device, so training never waits on it. At save time the
save sums every rank's counts in the one small all-reduce it makes anyway
(``save.Save.start_agreement``: on the hand-over thread where the plan reads no counts),
which makes them global and identical on every rank, and keeps the cumulative totals
(PEC bookkeeping, not Megatron's).
Evaluation passes (``module.training`` False) update no expert and are not counted.
Activation recompute (``--recompute-*``, ``--moe-layer-recompute``) runs a layer's forward
twice: first without autograd, again with it during the backward. Only forwards with
autograd count, so every token counts once per step whatever the recompute settings.
"""

from __future__ import annotations

import torch


class TokenCounter:
    def __init__(self, model_chunks):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.layers: list[int] = []
        self.num_experts = 0
        self._table: torch.Tensor | None = None  # [layers, experts] on the routers' device
        self._host = self._landed = None  # the host copy ``take`` refills (page-locked on a GPU), its event
        self._hooks = []
        layers = [m for chunk in model_chunks for m in chunk.modules() if isinstance(m, MoELayer)]
        if layers:
            self.num_experts = layers[0].config.num_moe_experts
            self._table = torch.zeros(len(layers), self.num_experts, dtype=torch.int64,
                                      device=layers[0].router.weight.device)
        for layer in layers:
            self._hook(layer)

    def _hook(self, moe_layer) -> None:
        row = self._table[len(self.layers)]
        self.layers.append(int(moe_layer.layer_number))

        def count(module, inputs, output):
            if module.training and torch.is_grad_enabled():
                routing_map = output[1]
                row.add_(routing_map.sum(0).to(torch.int64))

        self._hooks.append(moe_layer.router.register_forward_hook(count))

    def remove(self) -> None:
        """Stop counting (the engine is closed; a new one installs its own hooks)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def take(self) -> "TakenCounts":
        """This rank's counts since the last call, one row per layer of ``layers`` (int64; a [0, 0] tensor
        without MoE layers), on their way to the host; resets them. A save calls it on the training thread,
        which must not wait for the device: on a GPU the counts travel by a non-blocking copy into
        page-locked memory, behind the step that counted them, and ``TakenCounts.wait`` (the hand-over
        thread's, where the plan needs no counts) waits for that copy alone. Three device operations
        whatever the layers, and no allocation: one take's counts are read before the next take refills
        the same buffer (a save waits for the previous save's hand-over before it takes)."""
        if self._table is None:
            return TakenCounts(torch.zeros(0, 0, dtype=torch.int64))
        if self._host is None:
            on_device = self._table.device.type != "cpu"
            self._host = torch.empty(self._table.shape, dtype=self._table.dtype, pin_memory=on_device)
            self._landed = torch.cuda.Event(blocking=True) if on_device else None  # (a wait sleeps: no spinning)
        self._host.copy_(self._table, non_blocking=self._landed is not None)
        self._table.zero_()  # (on the same stream: after the copy read it)
        if self._landed is not None:
            self._landed.record()
        return TakenCounts(self._host, self._landed)


class TakenCounts:
    """Token counts taken from the device (``TokenCounter.take``): ``wait()`` gives them, on the host."""

    def __init__(self, host: torch.Tensor, landed=None):
        self._host, self._landed = host, landed

    def wait(self) -> torch.Tensor:
        if self._landed is not None:
            self._landed.synchronize()
        return self._host
