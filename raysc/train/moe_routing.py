"""What a training step does with its mixture-of-experts layers (``raysc.model.moe``) besides the
forward and backward: each micro-batch's per-expert token counts and load-balancing losses gathered
(the blocks' ``history``), the step's table of them summed over the ranks (one all-reduce, before the
update: no collective follows a step's update, ``Trainer.discard_partial_step``), DeepSeek-V3's
selection bias moved after the update, and the step's routing metrics for ``metrics.jsonl``.

The metrics: ``moe_aux_loss`` and ``moe_z_loss`` (mean over layers, micro-batches and ranks, unscaled
by their coefficients), ``moe_load_max`` (the most loaded expert's tokens over the mean, worst layer; 1.0 is a
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
    """A step's routing bookkeeping for the MoE layers of ``parts`` (``active`` is False for a dense model).

    ``all_layers``: every MoE layer of the whole model (a pipeline stage holds some of them; each rank
    fills its own rows of the step's table and one all-reduce gives every rank every layer's).
    ``loss_scale``: what each micro-batch's balancing losses are scaled by in backward (1/micro-batches,
    or 1 where a pipeline schedule scales the gradients itself). ``micro_batches``: the forwards a block
    runs per step; a step takes its blocks' last that many records (a pipeline stage's first step runs
    one forward more, torch's metadata inference, on the first micro-batch or on placeholder tensors).
    ``copies``: how many ranks route the same tokens through the same layer (their counts are divided
    by it)."""

    def __init__(
        self,
        parts: list[nn.Module],
        all_layers: list[int],
        micro_batches: int,
        loss_scale: float,
        bias_rate: float,
        distributed: bool,
        copies: int = 1,
    ) -> None:
        self.layers = moe_layers(parts)
        self.all_layers = [str(i) for i in all_layers]
        self.active = bool(self.layers)
        self.micro_batches = micro_batches
        self.bias_rate = bias_rate
        self.distributed = distributed
        self.copies = copies
        for module in self.layers.values():
            module.loss_scale = loss_scale  # the micro-batch losses are averaged, so are their aux losses
        self.reset()

    def reset(self) -> None:
        """Forget what the step under way gathered (a step undone, or finished)."""
        for module in self.layers.values():
            module.history.clear()
        self._table: torch.Tensor | None = None

    def reduce(self) -> None:
        """The step's table, summed over every rank (each rank routed its own tokens through its own
        layers): per MoE layer of the model, tokens per expert, then the sums of the aux and z losses and
        how many forwards they came from; every rank then holds the same table. Before the update."""
        first = next(iter(self.layers.values()))
        experts, device = first.num_experts, first.router.expert_bias.device
        table = torch.zeros(len(self.all_layers), experts + 3, dtype=torch.float64, device=device)
        for row, layer in enumerate(self.all_layers):
            module = self.layers.get(layer)
            if module is None or not module.history:
                continue
            stats = module.history[-self.micro_batches :]
            table[row, :experts] = torch.stack([s.counts for s in stats]).sum(0)  # on the device: no sync
            table[row, experts] = torch.stack([s.aux_loss for s in stats]).sum()
            table[row, experts + 1] = torch.stack([s.z_loss for s in stats]).sum()
            table[row, experts + 2] = len(stats)
            module.history.clear()
        if self.distributed:
            dist.all_reduce(table)
        self._table = table

    def finish(self, updated: bool) -> dict:
        """After the update (``updated``: the optimizer stepped): the selection biases moved from the
        step's load; the step's routing metrics."""
        table = self._table
        if table is None or not table[:, -1].any():
            self.reset()
            return {}
        ran = table[:, -1] > 0
        layers = [layer for layer, r in zip(self.all_layers, ran.tolist()) if r]
        summed = table[ran, :-3] / self.copies
        if updated and self.bias_rate:
            for layer, counts in zip(layers, summed):
                if layer in self.layers:
                    update_expert_bias(self.layers[layer].router, counts, self.bias_rate)
        mean = summed.mean(dim=1).clamp(min=1e-9)
        forwards = table[:, -1].sum()
        metrics = {
            "moe_aux_loss": float(table[:, -3].sum() / forwards),
            "moe_z_loss": float(table[:, -2].sum() / forwards),
            "moe_load_max": float((summed.max(dim=1).values / mean).max()),
            "moe_dead_experts": int((summed == 0).sum()),
            "moe_tokens": {layer: [int(c) for c in counts.tolist()] for layer, counts in zip(layers, summed)},
        }
        self.reset()
        return metrics
