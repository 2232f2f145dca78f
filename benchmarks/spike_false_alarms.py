"""Does the spike detector fire on healthy training? Clean runs of the shipped configs, replayed.

Each clean run trains one shipped config (``demo`` = raysc/demo.toml, ``tiny``, ``small``) at its
own defaults (learning rate, warm-up, clipping) in this process with the single-process
``Trainer`` and ``supervisor.spike_policy="off"``, recording every step's global loss and
gradient norm. The trajectories are cached under ``.cache/raysc/spike_trajectories`` and replayed
offline through three rules:

- ``old``: the detector this project shipped before (window 128, 6 sigma, two-sided |z| on the
  loss and on log grad norm, judged after 16 accepted values, flagged values kept out of the window);
- ``olmo``: OLMo-core's SkipStepOptimizer (window 128, 6 sigma, two-sided on the loss and the raw
  grad norm, judged once the window holds max(20, window/2) values, every value enters the window);
- ``new``: ``raysc.train.stability.SpikeDetector`` at the config's own settings.

A rule that flags nothing sees exactly the trajectory it would see online (no update was
skipped), so for ``new`` the replay equals the online run; for a rule that flags, the count is
that of the clean trajectory (online, each skip would change what follows).

``demo`` and ``tiny`` train the same model with the same settings (only the run name differs),
so ``tiny`` uses other seeds than ``demo`` (distinct runs, not copies). ``small`` runs only
SMALL_STEPS (default 60) of its 2000 steps for each seed, and 300 steps for seed 1234 (``small+``),
on the full run's LR schedule (warm-up is 100 steps): on 2 CPU cores a step of ``small`` costs about
4 s, so the full run would take over 2 hours a seed.

    python benchmarks/spike_false_alarms.py            # record what is missing, replay all
Prints JSON on its last line.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raysc.config import load_config  # noqa: E402
from raysc.train.stability import SpikeDetector  # noqa: E402

SMALL_STEPS = int(os.environ.get("SMALL_STEPS", "60"))
CACHE = ROOT / ".cache/raysc"
RUNS = {  # name: (config file, seeds, steps or None for the config's own)
    "demo": (ROOT / "raysc/demo.toml", [1234, 1, 2, 3, 4], None),
    "tiny": (ROOT / "jobs/configs/tiny.toml", [5, 6, 7, 8, 9], None),
    "small": (ROOT / "jobs/configs/small.toml", [1234, 1, 2, 3, 4], SMALL_STEPS),
    "small+": (ROOT / "jobs/configs/small.toml", [1234], 300),  # one longer run, past the warm-up
}


def record(name: str, path: Path, seed: int, steps: int | None) -> dict:
    """Train one clean run (no detector) and return its per-step loss and grad norm."""
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    overrides = [
        f"train.seed={seed}",
        'supervisor.spike_policy="off"',
        f'data.cache_dir="{CACHE}"',
        f'run.dir="{CACHE}/spike_runs/{name}-{seed}"',
    ]
    if steps:
        overrides.append(f"train.steps={steps}")
    cfg = load_config(path, overrides)
    torch.set_num_threads(2)
    packed, _, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, packed.val, measure_peak=False)
    # a shortened run keeps the full run's schedule (steps only bounds the loop): the LR at each
    # step is the one the full run uses
    if steps:
        from raysc.train.optim import build_scheduler

        trainer.scheduler = build_scheduler(trainer.optimizer, load_config(path).train.steps, cfg.schedule)
    t0 = time.time()
    loss, grad = [], []
    for _ in range(cfg.train.steps):
        m = trainer.train_step()
        loss.append(m["loss"])
        grad.append(m["grad_norm"])
    return {
        "config": name,
        "seed": seed,
        "steps": cfg.train.steps,
        "seconds": round(time.time() - t0, 1),
        "lr": cfg.optim.lr,
        "warmup_steps": cfg.schedule.warmup_steps,
        "loss": loss,
        "grad_norm": grad,
    }


def trajectory(name: str, path: Path, seed: int, steps: int | None) -> dict:
    name = name.rstrip("+")
    f = CACHE / "spike_trajectories" / f"{name}-{seed}-{steps or 'full'}.json"
    if f.exists():
        return json.loads(f.read_text())
    if steps:  # a longer recording of the same run starts with this one (same schedule, same seed)
        for g in sorted(f.parent.glob(f"{name}-{seed}-*.json")):
            longer = g.stem.rsplit("-", 1)[1]
            if longer.isdigit() and int(longer) > steps:
                run = json.loads(g.read_text())
                return run | {"steps": steps, "loss": run["loss"][:steps], "grad_norm": run["grad_norm"][:steps]}
    run = record(name, path, seed, steps)
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(run))
    print(f"recorded {name} seed {seed}: {run['steps']} steps in {run['seconds']} s", flush=True)
    return run


class OldDetector:
    """The detector shipped before issue 12 (window 128, 6 sigma, min_history 16), as an object the
    Trainer can use online."""

    shift = None

    def __init__(self) -> None:
        self.hl: list[float] = []
        self.hg: list[float] = []

    @staticmethod
    def _z(h: list[float], x: float) -> float:
        m = sum(h) / len(h)
        return (x - m) / max(math.sqrt(sum((v - m) ** 2 for v in h) / max(1, len(h) - 1)), 1e-12)

    def check(self, loss: float, grad_norm: float) -> dict | None:
        lg = math.log(max(grad_norm, 1e-12))
        if len(self.hl) >= 16:
            zl, zg = self._z(self.hl, loss), self._z(self.hg, lg)
            if abs(zl) > 6 or abs(zg) > 6:
                return {"reason": "spike", "z_loss": zl, "z_grad_norm": zg, "grad_norm": grad_norm}
        self.hl, self.hg = (self.hl + [loss])[-128:], (self.hg + [lg])[-128:]
        return None


def old_rule(loss: list[float], grad: list[float]) -> list[int]:
    d = OldDetector()
    return [i for i, (lv, g) in enumerate(zip(loss, grad), 1) if d.check(lv, g) is not None]


def grad_only_outliers(loss: list[float], grad: list[float], horizon: int = 10) -> list[dict]:
    """Steps whose log grad norm is > 6 sigma above the window of the 128 steps before (judged once
    16 are there) while the loss is not above its band: is a loss spike ever what follows?"""
    out = []
    for i in range(16, len(loss)):
        lo = max(0, i - 128)
        zg = SpikeDetector._z([math.log(g) for g in grad[lo:i]], math.log(grad[i]))
        zl = SpikeDetector._z(loss[lo:i], loss[i])
        if zg > 6 and zl <= 6:
            later = [
                SpikeDetector._z(loss[max(0, j - 128) : j], loss[j])
                for j in range(i + 1, min(len(loss), i + 1 + horizon))
            ]
            out.append(
                {
                    "step": i + 1,
                    "z_grad_norm": round(zg, 1),
                    "z_loss": round(zl, 2),
                    "grad_norm_x_median": round(grad[i] / statistics.median(grad[lo:i]), 1),
                    "max_z_loss_next_10": round(max(later, default=0.0), 2),
                }
            )
    return out


def old_rule_online(steps: int = 45) -> dict:
    """The demo (seed 1234) trained with the old detector deciding online: which updates it skips
    and the grad norm it sees meanwhile (the weights do not move while updates are skipped)."""
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    cfg = load_config(RUNS["demo"][0], [f'data.cache_dir="{CACHE}"', f'run.dir="{CACHE}/spike_runs/old-online"'])
    torch.set_num_threads(2)
    packed, _, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, packed.val, measure_peak=False)
    trainer.detector = OldDetector()
    ms = [trainer.train_step() for _ in range(steps)]
    skipped = [m["step"] for m in ms if m["skipped"]]
    return {
        "steps": steps,
        "skipped": skipped,
        "grad_norm_while_skipping": [round(ms[s - 1]["grad_norm"], 2) for s in skipped],
        "loss_while_skipping": [round(ms[s - 1]["loss"], 3) for s in skipped],
    }


def olmo_rule(loss: list[float], grad: list[float]) -> list[int]:
    """OLMo-core SkipStepOptimizer.get_step_factor (window 128, sigma 6, every value enters)."""
    hl, hg, flagged = [], [], []
    for i, (lv, g) in enumerate(zip(loss, grad), 1):
        hl, hg = (hl + [lv])[-129:], (hg + [g])[-129:]
        if len(hl) < max(20, 128 // 2):
            continue
        zl = abs(lv - statistics.fmean(hl[:-1])) / statistics.stdev(hl[:-1])
        zg = abs(g - statistics.fmean(hg[:-1])) / statistics.stdev(hg[:-1])
        if zl > 6 or zg > 6:
            flagged.append(i)
    return flagged


def new_rule(loss: list[float], grad: list[float], cfg) -> tuple[list[int], float, float]:
    """The shipped detector at the config's settings; also the largest loss z and grad-norm z it
    judged (steps with at least min_history accepted values before them)."""
    sup = cfg.supervisor
    d = SpikeDetector(sup.spike_window, sup.spike_sigma, sup.spike_min_history, sup.spike_patience)
    flagged, zl, zg = [], -math.inf, -math.inf
    for i, (lv, g) in enumerate(zip(loss, grad), 1):
        judged = len(d.loss) >= d.min_history
        if d.check(lv, g) is not None or d.shift is not None:
            flagged.append(i)
        if judged:
            zl, zg = max(zl, d.last_z["loss"]), max(zg, d.last_z["grad_norm"])
    return flagged, zl, zg


def main() -> None:
    rows = []
    for name, (path, seeds, steps) in RUNS.items():
        cfg = load_config(path)
        for seed in seeds:
            run = trajectory(name, path, seed, steps)
            new, zl, zg = new_rule(run["loss"], run["grad_norm"], cfg)
            g = run["grad_norm"]
            rows.append(
                {
                    "config": name,
                    "seed": seed,
                    "steps": run["steps"],
                    "grad_only_outliers": grad_only_outliers(run["loss"], g),
                    "old": old_rule(run["loss"], g),
                    "olmo": olmo_rule(run["loss"], g),
                    "new": new,
                    "max_z_loss": round(zl, 2),
                    "max_z_grad_norm": round(zg, 2),
                    "grad_norm_range": [round(min(g), 3), round(max(g), 3)],
                    "max_step_ratio_grad_norm": round(max(b / a for a, b in zip(g, g[1:])), 2),
                    "loss_first_last": [round(run["loss"][0], 3), round(run["loss"][-1], 3)],
                }
            )
            r = rows[-1]
            print(
                f"{name:5s} seed {seed:4d}: old {len(r['old']):3d} {r['old'][:12]}  olmo {len(r['olmo']):3d} "
                f"{r['olmo'][:12]}  new {len(r['new'])}  max z loss {r['max_z_loss']} grad {r['max_z_grad_norm']}"
                f"  grad norm {r['grad_norm_range']} max x{r['max_step_ratio_grad_norm']}/step",
                flush=True,
            )
    extra = [r for r in rows if r["config"].endswith("+")]  # the longer small run (its first steps are counted)
    rows = [r for r in rows if not r["config"].endswith("+")]
    total = {rule: sum(bool(r[rule]) for r in rows) for rule in ("old", "olmo", "new")}
    outliers = [o | {"config": r["config"], "seed": r["seed"]} for r in rows + extra for o in r["grad_only_outliers"]]
    online = old_rule_online()
    print(
        f"old rule online, demo seed 1234: skipped {online['skipped']}, grad norm meanwhile "
        f"{online['grad_norm_while_skipping']}",
        flush=True,
    )
    steps = sum(r["steps"] for r in rows)
    print(
        json.dumps(
            {
                "benchmark": "spike_false_alarms",
                "runs": len(rows),
                "steps": steps,
                "small_steps": SMALL_STEPS,
                "runs_with_a_flag": total,
                "flagged_steps": {rule: sum(len(r[rule]) for r in rows) for rule in ("old", "olmo", "new")},
                "false_positive_rate_per_step": {
                    rule: round(sum(len(r[rule]) for r in rows) / steps, 5) for rule in ("old", "olmo", "new")
                },
                "grad_norm_only_outliers": {
                    "count": len(outliers),  # over the 15 runs and the longer small run
                    "followed_by_a_loss_spike": sum(o["max_z_loss_next_10"] > 6 for o in outliers),
                    "largest_x_median": max((o["grad_norm_x_median"] for o in outliers), default=None),
                    "steps": outliers,
                },
                "longer_small_run": [
                    {k: r[k] for k in ("seed", "steps", "old", "olmo", "new", "max_z_loss", "max_z_grad_norm")}
                    for r in extra
                ],
                "old_rule_online_demo": online,
                "per_run": [
                    {k: r[k] for k in ("config", "seed", "steps", "max_z_loss", "max_z_grad_norm")}
                    | {"flagged_" + rule: r[rule] for rule in ("old", "olmo", "new")}
                    for r in rows
                ],
            }
        )
    )


if __name__ == "__main__":
    main()
