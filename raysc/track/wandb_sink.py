"""Weights & Biases: one W&B run per raysc run, online or offline (``track.wandb_mode``; offline
runs live under ``<run dir>/wandb`` until ``wandb sync``).

W&B's own step must only grow, and a rollback re-runs earlier steps; so the training step is a
metric of its own, ``train/step``, declared the x-axis of every other metric (``define_metric``),
and each row is logged without a W&B step. A rewind is a ``rewind_to_step`` value and a row in the
``events`` table; re-run steps appear beside the discarded ones in W&B (its rewind needs the
service online: not used, so that offline runs behave the same). A resumed run continues the same
W&B run id (``resume="allow"``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

STEP_KEY = "train/step"


class WandbSink:
    name = "wandb"

    def __init__(self, project: str, entity: str, mode: str, run_name: str, root: Path) -> None:
        self.project, self.entity, self.mode, self.run_name, self.root = project, entity, mode, run_name, Path(root)
        self.run = None
        self._events: list[list] = []

    def open(self, run_id: str | None) -> str:
        import wandb

        self.root.mkdir(parents=True, exist_ok=True)
        run_id = run_id or uuid.uuid4().hex[:12]  # W&B run ids: lower-case letters and digits
        self.run = wandb.init(
            project=self.project,
            entity=self.entity or None,
            id=run_id,
            resume="allow",
            name=self.run_name,
            mode=self.mode,
            dir=str(self.root),
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        return run_id

    def params(self, params: dict[str, str], tags: dict[str, str]) -> None:
        self.run.config.update({**params, **{f"raysc/{k}": v for k, v in tags.items()}}, allow_val_change=True)

    def metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        for step, _, values in rows:
            self.run.log({STEP_KEY: step, **values})

    def text(self, step: int, tag: str, text: str) -> None:
        self._events.append([step, tag, text])

    def rewind(self, step: int, why: str) -> None:
        self.run.log({STEP_KEY: step, "rewind_to_step": step})
        self._events.append([step, "rewind", f"steps after {step} re-run: {why}"])

    def close(self, status: str = "FINISHED") -> None:
        import wandb

        if self.run is None:
            return
        if self._events:
            self.run.log({"events": wandb.Table(columns=["step", "kind", "text"], data=self._events)})
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        self.run = None
