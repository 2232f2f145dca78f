"""A config as a short measuring run: what ``raysc plan --profile`` and ``raysc preflight`` start.

Lives in config because it only rewrites config sections; both commands import it from here.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from raysc.config.schema import Config


def measurement_config(
    cfg: Config, steps: int, run_dir: str | Path, checkpoint: dict | None = None, supervisor: dict | None = None
) -> Config:
    """``cfg`` as a short measuring run: ``steps`` steps with per-rank peak memory, no fault drills, no
    warm spares, no pre-flight gate (it is what measures), under ``run_dir``; ``checkpoint`` and
    ``supervisor`` override fields of those sections (default: no periodic checkpoints or SDC checks)."""
    run = copy.deepcopy(cfg)
    run.train = dataclasses.replace(
        run.train, steps=steps, measure_memory=True, require_preflight=False, log_every=steps
    )
    run.checkpoint = dataclasses.replace(
        run.checkpoint, **{"every_steps": 0, "uri": "", "async_save": False, **(checkpoint or {})}
    )
    run.supervisor = dataclasses.replace(
        run.supervisor, **{"inject": "", "warm_spares": False, "sdc_every_steps": 0, **(supervisor or {})}
    )
    run.run = dataclasses.replace(run.run, dir=str(run_dir))
    return run
