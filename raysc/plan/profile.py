"""``raysc plan --profile``: run candidate layouts for a few steps on the real fleet, compare the
estimates with what they measure, and calibrate the planner from the measurement.

Each candidate runs as an ordinary supervised training run (``raysc.fleet.driver.train``: the same
workers, process groups and model shards a real run uses) of ``steps`` steps with
``train.measure_memory`` on, under ``<run_dir>/plan/<n>``. Measured: every rank's peak memory
(``raysc.train.memory``) and the median step time after the first two steps. Calibration:
the step-time estimate is scaled by the median measured/estimated ratio (the cluster's
``efficiency`` is divided by it) and memory estimates by the largest measured/estimated ratio,
then the ranking is recomputed with them.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from raysc.config.measure import measurement_config
from raysc.config.schema import Config
from raysc.fleet.driver import train
from raysc.fleet.records import read_jsonl
from raysc.plan.layout import Cluster, Layout
from raysc.plan.memory import estimate_memory
from raysc.plan.perf import estimate_step
from raysc.plan.search import layout_config


def profile_layouts(
    cfg: Config, layouts: list[Layout], cluster: Cluster, steps: int = 6, dtype: str = "fp32", log=print
) -> list[dict]:
    """Run each layout for ``steps`` steps; estimated vs measured memory and step time per layout."""
    gb = cfg.train.global_batch_sequences
    out = []
    for i, lay in enumerate(layouts):
        run = measurement_config(layout_config(cfg, lay), steps, Path(cfg.run_dir) / "plan" / f"{i:02d}")
        log(f"plan --profile: [{i + 1}/{len(layouts)}] {lay.describe()} for {steps} steps")
        summary = train(run, progress=False, overwrite=True)  # scratch runs: a rerun replaces them
        times = [m["step_time"] for m in read_jsonl(Path(run.run_dir) / "metrics.jsonl") if m["step"] > 2]
        mem_est = estimate_memory(cfg.model, cfg.train.seq_len, gb, lay, dtype)["total"]
        step_est = estimate_step(cfg.model, cfg.train.seq_len, gb, lay, cluster, dtype)["step_s"]
        measured = max(summary["peak_memory_gb"] or [0.0]) * 1e9
        step = statistics.median(times) if times else float("nan")
        out.append(
            {
                "layout": lay.describe(),
                "layout_obj": lay,
                "memory_estimate_gb": round(mem_est / 1e9, 4),
                "memory_measured_gb": round(measured / 1e9, 4),
                "memory_ratio": round(measured / mem_est, 3) if mem_est else None,
                "per_rank_gb": summary["peak_memory_gb"],
                "step_estimate_s": round(step_est, 5),
                "step_measured_s": round(step, 5),
                "step_ratio": round(step / step_est, 3) if step_est else None,
            }
        )
        log(
            f"  memory/rank: estimated {mem_est / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB; "
            f"step: estimated {step_est * 1e3:.1f} ms, measured {step * 1e3:.1f} ms"
        )
    return out


def calibrate(cluster: Cluster, results: list[dict]) -> tuple[Cluster, float]:
    """A cluster whose efficiency reproduces the median measured step time, and the memory factor."""
    ratios = [r["step_ratio"] for r in results if r["step_ratio"]]
    step_ratio = statistics.median(ratios) if ratios else 1.0
    memory = max((r["memory_ratio"] for r in results if r["memory_ratio"]), default=1.0)
    return dataclasses.replace(cluster, efficiency=cluster.efficiency / step_ratio), memory
