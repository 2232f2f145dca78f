"""Gradient norm and clipping over every shard of every stage.

``torch.nn.utils.clip_grad_norm_`` cannot mix plain tensors with DTensors on
different meshes, and knows nothing of pipeline stages, so the total norm is
assembled here: each gradient's norm (a DTensor's via ``full_tensor``, which
reduces over the dims it is sharded on; replicated copies count once), squared
and summed, then summed over the pipeline group. Every rank gets the same
global norm and applies the same clip factor as single-process training.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def global_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total += n * n
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
                   ) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0/inf: measure only)."""
    norm = global_grad_norm(params, pp_group)
    if max_norm and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype) if not isinstance(p.grad, DTensor) else coef.item())
    return norm
