"""The μP coordinate check (Yang et al. 2022, TP5 §D.1 / the ``mup`` package's ``get_coord_data``).

Train the same tiny model at several widths for a few steps, under the
standard parametrisation (SP) and under μP, and record the mean |activation|
of every layer at every step. Under μP those sizes must not grow with the
width; under SP with Adam the hidden and output activations grow about
linearly with it after the first update. Written here (not with ``mup``'s
helper) because our μP is keyed by parameter name, see ``raysc.model.mup``.

Widths keep the config's head_dim (n_heads scales with the width), its GQA
ratio and its depth. The learning rate is the config's ``optim.lr``, constant
(no warmup), with its clipping, betas and weight decay. The base width is
``model.mup_base_width`` (0 = the config's ``model.dim``).

Verdict: fit log(mean |activation|) against log(width) by least squares at the
last step for each recorded layer; μP passes when every slope is at most
``bound`` (0.25 by default: a 4× wider model's activations grow < 1.42×).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from raysc.config.schema import Config
from raysc.data.prepare import prepare_data
from raysc.scaling.probe import at_width, train

DEFAULT_WIDTHS = (64, 128, 256, 512)


def slope(widths: list[int], values: list[float]) -> float:
    """Least-squares slope of log(value) against log(width)."""
    x, y = np.log(np.asarray(widths, float)), np.log(np.asarray(values, float))
    return float(np.polyfit(x, y, 1)[0])


def coord_data(
    cfg: Config, rows: np.ndarray, widths: list[int], steps: int, mup: bool, seeds: int = 1
) -> dict[int, list[dict[str, float]]]:
    """{width: [ {layer: mean |act|} at step 0..steps ]}, averaged over ``seeds`` seeds."""
    base = cfg.model.mup_base_width or cfg.model.dim
    out: dict[int, list[dict[str, float]]] = {}
    for w in widths:
        model_cfg = at_width(cfg.model, w, mup, base)
        per_step: list[dict[str, list[float]]] = [{} for _ in range(steps + 1)]

        def keep(step: int, acts: dict[str, float], per_step: list = per_step) -> None:
            for name, v in acts.items():
                per_step[step].setdefault(name, []).append(v)

        for s in range(seeds):
            train(
                model_cfg, cfg.optim, rows, steps, cfg.train.global_batch_sequences, cfg.train.seed + s, on_forward=keep
            )
        out[w] = [{k: float(np.mean(v)) for k, v in step.items()} for step in per_step]
    return out


def slopes_at(data: dict[int, list[dict[str, float]]], step: int) -> dict[str, float]:
    """Slope of log|act| vs log width per layer at ``step`` (inf when a width diverged)."""
    widths = sorted(data)
    result = {}
    for name in data[widths[0]][0]:
        vals = [data[w][step].get(name, math.inf) if step < len(data[w]) else math.inf for w in widths]
        ok = all(math.isfinite(v) and v > 0 for v in vals)
        result[name] = slope(widths, vals) if ok else math.inf
    return result


def check_args(cfg: Config, widths: list[int], steps: int) -> list[int]:
    """The sorted distinct widths; ValueError for fewer than two, a width the head_dim does not divide,
    or no steps."""
    widths = sorted(set(int(w) for w in widths))
    if len(widths) < 2:
        raise ValueError(f"the coordinate check needs at least two widths, got {widths}")
    if steps < 1:
        raise ValueError(f"steps={steps}: train at least one step")
    for w in widths:
        at_width(cfg.model, w, True, cfg.model.mup_base_width or cfg.model.dim)
    return widths


def coord_check(
    cfg: Config,
    rows: np.ndarray,
    widths: list[int] = DEFAULT_WIDTHS,
    steps: int = 5,
    seeds: int = 1,
    bound: float = 0.25,
) -> dict:
    """SP and μP coordinate data, per-layer slopes at the last step and the verdict."""
    widths = check_args(cfg, widths, steps)
    report: dict = {
        "widths": widths,
        "steps": steps,
        "seeds": seeds,
        "bound": bound,
        "lr": cfg.optim.lr,
        "base_width": cfg.model.mup_base_width or cfg.model.dim,
        "head_dim": cfg.model.head_dim,
        "n_layers": cfg.model.n_layers,
    }
    for name, on in (("sp", False), ("mup", True)):
        data = coord_data(cfg, rows, widths, steps, on, seeds)
        s = slopes_at(data, steps)
        worst, least = max(s, key=s.get), min(s, key=s.get)
        report[name] = {
            "activations": {str(w): d for w, d in data.items()},
            "slopes": s,
            "max_slope": s[worst],
            "max_layer": worst,
            "min_slope": s[least],
            "min_layer": least,
        }
    report["passed"] = report["mup"]["max_slope"] <= bound
    return report


def verdict(report: dict) -> str:
    mu, sp, b = report["mup"], report["sp"], report["bound"]
    return (
        f"μP {'PASSES' if report['passed'] else 'FAILS'}: largest slope of log|activation| vs log width at "
        f"step {report['steps']} is {mu['max_slope']:+.3f} ({mu['max_layer']}), bound {b} (smallest "
        f"{mu['min_slope']:+.3f}, {mu['min_layer']}); "
        f"SP: {sp['max_slope']:+.3f} ({sp['max_layer']}), logits {sp['slopes'].get('logits', math.nan):+.3f} "
        f"vs μP {mu['slopes'].get('logits', math.nan):+.3f}"
    )


def format_report(report: dict) -> str:
    lines = [
        f"coordinate check: widths {report['widths']}, {report['steps']} steps, lr {report['lr']:g}, "
        f"base width {report['base_width']}, head_dim {report['head_dim']}",
        f"  {'layer':18} {'SP slope':>9} {'μP slope':>9}",
    ]
    for name in report["sp"]["slopes"]:
        lines.append(f"  {name:18} {report['sp']['slopes'][name]:>+9.3f} {report['mup']['slopes'][name]:>+9.3f}")
    lines.append(verdict(report))
    return "\n".join(lines)


def plot(report: dict, path: Path) -> Path:
    """One PNG: mean |activation| per layer against width at the last step, SP left, μP right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths, step = report["widths"], report["steps"]
    names = list(report["sp"]["slopes"])
    colours = plt.cm.tab20(np.linspace(0, 1, max(len(names), 2)))
    marker = {"attn": "s", "mlp": "^"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=True)
    for ax, key, title in ((axes[0], "sp", "standard parametrisation"), (axes[1], "mup", "μP")):
        acts = report[key]["activations"]
        for name, colour in zip(names, colours):
            ys = [acts[str(w)][step][name] if step < len(acts[str(w)]) else math.nan for w in widths]
            ax.plot(
                widths,
                ys,
                color=colour,
                marker=marker.get(name.rsplit(".", 1)[-1], "o"),
                label=f"{name} (SP {report['sp']['slopes'][name]:+.2f}, μP {report['mup']['slopes'][name]:+.2f})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (model.dim)")
        ax.set_title(f"{title}: max slope {report[key]['max_slope']:+.2f}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"mean |activation| after {step} steps")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), title="layer (slope)")
    fig.suptitle(verdict(report), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(report: dict, out_dir: str | Path) -> dict[str, str]:
    """coord_check.json (every number) and coord_check.png under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "coord_check.json").write_text(json.dumps(report, indent=1, default=float))
    png = plot(report, out / "coord_check.png")
    return {"json": str(out / "coord_check.json"), "png": str(png)}


def training_rows(cfg: Config) -> np.ndarray:
    """The config's training rows (``prepare_data``); the domains of a packed source, concatenated."""
    packed, _, _ = prepare_data(cfg)
    rows = packed.train
    return np.concatenate(list(rows.values())) if isinstance(rows, dict) else rows


def run(cfg: Config, widths: list[int], steps: int, seeds: int, bound: float, out_dir: str | None) -> dict:
    """``raysc mup coord-check``: check, write the JSON and the PNG, return the report."""
    check_args(cfg, widths, steps)  # before preparing any data
    report = coord_check(cfg, training_rows(cfg), widths, steps, seeds, bound)
    report["files"] = write(report, out_dir or f"{cfg.run_dir}/coord_check")
    return report
