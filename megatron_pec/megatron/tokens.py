"""Per-expert token counts from forward hooks on Megatron's MoE routers.

Installed once per model on every rank. The hook adds ``routing_map.sum(0)``
(tokens routed to each global expert in this micro-batch) to a counter that
stays on the router's device, so training never waits on it. At save time the
engine sums every rank's counts in the one small all-reduce a save makes anyway
(``Engine._start_agreement``), which makes them global and identical on every
rank, and keeps the cumulative totals (PEC bookkeeping, not Megatron's).
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
        self._counts: list[torch.Tensor] = []
        self._hooks = []
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, MoELayer):
                    self._hook(module)

    def _hook(self, moe_layer) -> None:
        index = len(self.layers)
        self.layers.append(int(moe_layer.layer_number))
        self.num_experts = moe_layer.config.num_moe_experts
        weight = moe_layer.router.weight
        self._counts.append(torch.zeros(self.num_experts, dtype=torch.int64, device=weight.device))

        def count(module, inputs, output):
            if module.training and torch.is_grad_enabled():
                routing_map = output[1]
                self._counts[index] += routing_map.sum(0).to(torch.int64)

        self._hooks.append(moe_layer.router.register_forward_hook(count))

    def remove(self) -> None:
        """Stop counting (the engine is closed; a new one installs its own hooks)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def take(self) -> torch.Tensor:
        """This rank's counts since the last call, one row per layer of ``layers`` (int64, on the CPU:
        a [0, 0] tensor without MoE layers); resets them."""
        if not self._counts:
            return torch.zeros(0, 0, dtype=torch.int64)
        local = torch.stack(self._counts)
        for c in self._counts:
            c.zero_()
        return local.cpu()
