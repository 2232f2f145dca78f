"""Quality of a (quantized) model: perplexity on held-out rows, and the per-token int8 activation
quantization a W8A8 engine applies, simulated in torch so the measurement matches what it serves."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def perplexity(model: nn.Module, rows: torch.Tensor, batch: int = 8) -> float:
    """exp(mean next-token cross-entropy) over ``rows`` (n, seq_len + 1)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        r = rows[i : i + batch]
        logits = model(r[:, :-1])
        total += F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), r[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += r[:, 1:].numel()
    return math.exp(total / count)


def fake_quant_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric per-token (last dim) quantization and back: dynamic activation quantization."""
    qmax = (1 << (bits - 1)) - 1
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    return torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale


@contextmanager
def int8_activations(model: nn.Module, names: list[str]) -> Iterator[None]:
    """While inside, the inputs of the linears ``names`` are quantized per token to int8."""
    hooks = [
        model.get_submodule(n).register_forward_pre_hook(lambda _m, args: (fake_quant_per_token(args[0]),))
        for n in names
    ]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
