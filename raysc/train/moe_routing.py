"""What a training step does with its mixture-of-experts layers (``raysc.model.moe``) besides the
forward and backward: each micro-batch's per-expert token counts and load-balancing losses gathered,
the step's counts summed over the data-parallel ranks (one all-reduce, before the update: no collective
follows a step's update, ``Trainer.discard_partial_step``), DeepSeek-V3's selection bias moved after
the update, and the step's routing metrics for ``metrics.jsonl``.

The metrics: ``moe_aux_loss`` and ``moe_z_loss`` (mean over layers and micro-batches, unscaled by their
coefficients), ``moe_load_max`` (the most loaded expert's tokens over the mean, worst layer; 1.0 is a
perfect balance, E/k means every token of a layer went to the same k experts), ``moe_dead_experts``
(experts that got no token this step, all layers) and ``moe_tokens`` (tokens per expert per MoE layer,
keyed by layer index), the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from raysc.model.moe import MoEFeedForward, update_expert_bias


def moe_layers(parts: list[nn.Module]) -> dict[str, MoEFeedForward]:
    """The MoE blocks of the model parts, by layer index."""
    return {
        name.split(".")[1]: module
        for part in parts
        for name, module in part.named_modules()
        if isinstance(module, MoEFeedForward)
    }


class MoERouting:
    """A step's routing bookkeeping for the MoE layers of ``parts`` (``active`` is False for a dense model)."""

    def __init__(self, parts: list[nn.Module], n_micro: int, bias_rate: float, distributed: bool) -> None:
        self.layers = moe_layers(parts)
        self.active = bool(self.layers)
        self.bias_rate = bias_rate
        self.distributed = distributed
        for module in self.layers.values():
            module.loss_scale = 1.0 / n_micro  # the micro-batch losses are averaged, so are their aux losses
        self.reset()

    def reset(self) -> None:
        """Forget what the step under way gathered (a step undone, or finished)."""
        self._counts: dict[str, torch.Tensor] = {}
        self._aux: list[torch.Tensor] = []
        self._z: list[torch.Tensor] = []
        self._summed: torch.Tensor | None = None

    def after_micro_batch(self) -> None:
        """Add the last forward's counts and losses of every MoE layer."""
        for layer, module in self.layers.items():
            stats = module.last
            if stats is None:
                continue
            prev = self._counts.get(layer)
            self._counts[layer] = stats.counts if prev is None else prev + stats.counts
            self._aux.append(stats.aux_loss)  # tensors: read once, in ``finish`` (no device sync per micro-batch)
            self._z.append(stats.z_loss)

    def reduce(self) -> None:
        """Sum the step's counts over every rank (each rank routed its own tokens); every rank then holds
        the same totals. Before the update."""
        if not self._counts:
            return
        stacked = torch.stack([self._counts[layer] for layer in self.layers if layer in self._counts]).to(torch.float64)
        if self.distributed:
            dist.all_reduce(stacked)
        self._summed = stacked

    def finish(self, updated: bool) -> dict:
        """After the update (``updated``: the optimizer stepped): the selection biases moved from the
        step's load; the step's routing metrics."""
        if self._summed is None:
            self.reset()
            return {}
        summed = self._summed
        layers = [layer for layer in self.layers if layer in self._counts]
        if updated and self.bias_rate:
            for layer, counts in zip(layers, summed):
                update_expert_bias(self.layers[layer].router, counts, self.bias_rate)
        mean = summed.mean(dim=1).clamp(min=1e-9)
        metrics = {
            "moe_aux_loss": float(torch.stack(self._aux).mean()),
            "moe_z_loss": float(torch.stack(self._z).mean()),
            "moe_load_max": float((summed.max(dim=1).values / mean).max()),
            "moe_dead_experts": int((summed == 0).sum()),
            "moe_tokens": {layer: [int(c) for c in counts.tolist()] for layer, counts in zip(layers, summed)},
        }
        self.reset()
        return metrics
