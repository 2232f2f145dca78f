"""Learning-rate transfer across widths: the experiment that shows what μP is for.

Sweep a grid of peak learning rates at two or more widths with the same depth,
data, batch, schedule and seed, once under the standard parametrisation and
once under μP, and find the best LR (lowest final training loss, averaged over
the last ``tail`` steps, averaged over seeds) at each width. Under μP the best LR should stay put
as the width grows; under SP with Adam it falls roughly like 1/width. The
shift is measured in grid steps. Runs are tiny, in-process and deterministic
(``raysc.scaling.probe``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from raysc.config.schema import ModelConfig, OptimConfig, ScheduleConfig
from raysc.scaling.probe import at_width, train


def final_loss(losses: list[float], tail: int) -> float:
    """Mean of the last ``tail`` losses; inf when the run diverged."""
    last = losses[-tail:]
    return float(np.mean(last)) if last and all(math.isfinite(x) for x in last) else math.inf


def lr_sweep(
    model: ModelConfig,
    optim: OptimConfig,
    schedule: ScheduleConfig | None,
    rows: np.ndarray,
    widths: list[int],
    lrs: list[float],
    steps: int,
    batch: int,
    seeds: list[int],
    mup: bool,
    base_width: int = 0,
    tail: int = 5,
) -> dict:
    """Final loss for every (width, lr); best LR and its grid index per width; the shift in grid steps.

    Each seed sets the init and the batch order; the final losses are averaged
    over ``seeds`` (early training of tiny models is noisy: one seed's optimum can
    jump a grid step). ``base_width`` is the μP base (0 = the smallest width): the
    width at which a tuned LR is meant to hold.
    """
    if not seeds:
        raise ValueError("an LR sweep needs at least one seed")
    widths, lrs = sorted(widths), sorted(lrs)
    if len(widths) < 2 or len(lrs) < 2:
        raise ValueError(f"an LR sweep needs at least two widths and two learning rates (got {widths}, {lrs})")
    base = base_width or widths[0]
    loss: dict[int, dict[float, float]] = {}
    best: dict[int, float] = {}
    for w in widths:
        cfg = at_width(model, w, mup, base)
        loss[w] = {}
        for lr in lrs:
            o = dataclasses.replace(optim, lr=lr)
            loss[w][lr] = float(
                np.mean([final_loss(train(cfg, o, rows, steps, batch, s, schedule), tail) for s in seeds])
            )
        best[w] = min(lrs, key=lambda lr: (loss[w][lr], lr))
    index = {w: lrs.index(best[w]) for w in widths}
    return {
        "mup": mup,
        "widths": widths,
        "lrs": lrs,
        "steps": steps,
        "batch": batch,
        "tail": tail,
        "seeds": list(seeds),
        "base_width": base,
        "loss": loss,
        "best_lr": best,
        "best_index": index,
        "shift": index[widths[-1]] - index[widths[0]],
    }


def format_sweep(result: dict) -> str:
    name = "μP" if result["mup"] else "SP"
    lines = [
        f"{name}: final train loss (mean of last {result['tail']} of {result['steps']} steps, "
        f"{len(result['seeds'])} seeds)",
        "  width " + " ".join(f"{lr:>9.2e}" for lr in result["lrs"]) + "   best",
    ]
    for w in result["widths"]:
        row = " ".join(f"{result['loss'][w][lr]:>9.4f}" for lr in result["lrs"])
        lines.append(f"  {w:>5} {row}   {result['best_lr'][w]:.2e}")
    lines.append(
        f"  best LR moves {result['shift']:+d} grid steps from width {result['widths'][0]} to {result['widths'][-1]}"
    )
    return "\n".join(lines)
