"""AdamW with decoupled weight decay on matrices only, and the learning-rate schedule.

Under μP (``model.mup``) the parameter groups come from ``raysc.model.mup``,
decided by parameter name (hidden matrices get LR/m), so they are right for any
TP/FSDP/PP shard.

The schedule is a pure function of the step (linear warmup from 0 to the peak,
then cosine or linear decay to ``min_lr_ratio``·peak), so resuming needs only the
step counter; ``LambdaLR`` carries it in its state dict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from raysc.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from raysc.model import mup


def lr_factor(step: int, total_steps: int, sched: ScheduleConfig) -> float:
    """Multiplier of the peak LR for 0-based optimizer ``step``."""
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    if sched.decay == "constant":
        return 1.0
    span = max(1, total_steps - sched.warmup_steps)
    progress = min(1.0, (step - sched.warmup_steps) / span)
    if sched.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * shape


def build_optimizer(
    params: Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    cfg: OptimConfig,
    model: ModelConfig | None = None,
) -> torch.optim.AdamW:
    """AdamW over ``params``: tensors, or ``(name, tensor)`` pairs from ``named_parameters()``.

    Without μP: one group of matrices with weight decay and one of vectors
    without, both at ``cfg.lr``. With ``model.mup`` the groups of
    ``raysc.model.mup.param_groups``, which need the names.
    """
    items = list(params)
    if model is not None and model.mup:
        if not all(isinstance(x, tuple) for x in items):
            raise ValueError(
                "model.mup needs parameter names to split the optimizer groups: pass "
                "(name, parameter) pairs, e.g. list(model.named_parameters())"
            )
        groups = mup.param_groups(items, cfg, model)
    else:
        decay, no_decay = [], []
        for p in (x[1] if isinstance(x, tuple) else x for x in items):
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_scheduler(
    opt: torch.optim.Optimizer, total_steps: int, sched: ScheduleConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, sched))
