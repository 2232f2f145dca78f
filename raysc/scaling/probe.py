"""Tiny in-process training runs for the μP coordinate check and the LR-transfer sweep.

One process, world size 1, no Ray: ``build_model`` + ``build_optimizer`` (+ the
LR schedule) in a plain loop, the same pieces ``Trainer`` uses at world size 1,
without its loader, supervisor and MFU machinery. Runs are deterministic:
the model init, and the batch order, come from ``seed``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from raysc.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from raysc.model.llama import Llama, build_model
from raysc.train.optim import build_optimizer, build_scheduler


def at_width(model: ModelConfig, width: int, mup: bool, base_width: int) -> ModelConfig:
    """``model`` at hidden size ``width`` with its head_dim kept (n_heads = width/head_dim), its GQA
    ratio kept where it divides, ffn_dim scaled with the width (or automatic), μP on or off."""
    hd = model.head_dim
    if width <= 0 or width % hd:
        raise ValueError(
            f"width {width} is not a positive multiple of the config's head_dim "
            f"(model.dim/model.n_heads = {hd}); pick widths that are"
        )
    n_heads = width // hd
    groups = max(1, model.n_heads // model.n_kv_heads)
    n_kv = n_heads // groups if n_heads % groups == 0 else n_heads
    ffn = math.ceil(model.ffn_dim * width / model.dim) if model.ffn_dim else 0
    return dataclasses.replace(
        model, dim=width, n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=ffn, mup=mup, mup_base_width=base_width
    )


def batches(rows: np.ndarray, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of ``batch`` rows (seq_len + 1 tokens each), a seeded permutation, cycled."""
    if len(rows) == 0:
        raise ValueError("no training rows")
    order = np.random.default_rng(seed).permutation(len(rows))
    need = np.resize(order, batch * steps)
    return [torch.from_numpy(rows[need[i * batch : (i + 1) * batch]].astype(np.int64)) for i in range(steps)]


def record_activations(model: Llama, sink: dict[str, float]) -> list:
    """Forward hooks writing mean |output| of the embedding, each attention, MLP and block, and the logits."""
    modules = {"embed": model.embed, "logits": model.output}
    for i, block in model.layers.items():
        modules.update({f"layers.{i}.attn": block.attn, f"layers.{i}.mlp": block.mlp, f"layers.{i}": block})
    handles = []
    for name, mod in modules.items():
        if mod is None:
            continue

        def hook(_m, _inp, out, name=name):
            sink[name] = float(out.detach().abs().mean())

        handles.append(mod.register_forward_hook(hook))
    return handles


def train(
    model_cfg: ModelConfig,
    optim: OptimConfig,
    rows: np.ndarray,
    steps: int,
    batch: int,
    seed: int,
    schedule: ScheduleConfig | None = None,
    on_forward: Callable[[int, dict], None] | None = None,
) -> list[float]:
    """Train ``steps`` AdamW steps; returns the per-step training losses (inf once non-finite).

    ``on_forward(step, activations)`` sees the hooked mean |activations| of the
    forward pass before update ``step``; with it, one more forward pass after
    the last update is reported as step ``steps``. No schedule = constant LR.
    """
    seq_len = rows.shape[1] - 1
    model = build_model(model_cfg, seq_len, seed)
    opt = build_optimizer(list(model.named_parameters()), optim, model_cfg)
    sched = build_scheduler(opt, steps, schedule) if schedule is not None else None
    acts: dict[str, float] = {}
    handles = record_activations(model, acts) if on_forward else []
    data = batches(rows, batch, steps + (1 if on_forward else 0), seed)
    losses: list[float] = []
    try:
        for step in range(steps):
            x, y = data[step][:, :-1], data[step][:, 1:]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if on_forward:
                on_forward(step, dict(acts))
            value = loss.item()
            if not math.isfinite(value):
                losses.extend([math.inf] * (steps - step))
                break
            losses.append(value)
            loss.backward()
            if optim.clip_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_norm)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad(set_to_none=True)
        else:
            if on_forward:
                with torch.no_grad():
                    model(data[steps][:, :-1])
                on_forward(steps, dict(acts))
    finally:
        for h in handles:
            h.remove()
    return losses
