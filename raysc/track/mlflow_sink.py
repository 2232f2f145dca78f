"""MLflow: one MLflow run per raysc run, through ``MlflowClient`` (a tracking server, or a local
``sqlite:///`` / ``file:`` store).

MLflow keeps every value logged for a step; a rewind cannot remove the discarded steps' values.
Each value carries its step and the time rank 0 measured it, so the re-run's values are the newest
for their steps: ``history`` reads a metric back as one value per step (the newest), and each rewind
is a ``rollback.N`` tag and a ``rewind_to_step`` metric. Parameters are immutable in MLflow: a
resumed run logs the keys it has not logged yet and records a changed value as a
``param_changed.KEY`` tag.

MLflow's own REST client retries a refused call for minutes by default; raysc's relay retries
instead (``raysc.track.relay``), so the client is set to fail fast unless the user set
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` themselves.

mlflow pins pyarrow below 26 (3.17.x: ``pyarrow<26``); raysc needs only ``pyarrow>=15``, so the
``track`` extra lets pip pick the pyarrow both accept.
"""

from __future__ import annotations

import os
import time
from typing import Any

PARAM_VALUE_MAX = 6000  # MLflow's limit on a parameter's value
TAG_VALUE_MAX = 5000
BATCH_METRICS = 1000  # log_batch's limit
BATCH_PARAMS = 100


class MlflowSink:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str) -> None:
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.client: Any = None
        self.run_id: str | None = None
        self._rewinds = 0

    def open(self, run_id: str | None) -> str:
        if self.client is None:  # imported here, on the relay's thread: ~3 s the run does not wait for
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            run = self.client.get_run(run_id)  # raises when the id is unknown to this store
            if run.info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            self._rewinds = sum(1 for k in run.data.tags if k.startswith("rollback."))
        else:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(self.experiment)
            run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        self.run_id = run_id
        return run_id

    def params(self, params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params
        new = {k: str(v)[:PARAM_VALUE_MAX] for k, v in params.items() if k not in logged}
        changed = {
            f"param_changed.{k}": f"{logged[k]} -> {v}"[:TAG_VALUE_MAX]
            for k, v in params.items()
            if k in logged and logged[k] != str(v)[:PARAM_VALUE_MAX]
        }
        items = sorted(new.items())
        for i in range(0, len(items), BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i : i + BATCH_PARAMS]])
        all_tags = {**tags, **changed}
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)[:TAG_VALUE_MAX]) for k, v in all_tags.items()])

    def metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        flat = [Metric(k, float(v), int(t * 1000), step) for step, t, values in rows for k, v in values.items()]
        for i in range(0, len(flat), BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=flat[i : i + BATCH_METRICS])

    def text(self, step: int, tag: str, text: str) -> None:
        self.client.set_tag(self.run_id, f"event.{step:08d}.{tag}", text[:TAG_VALUE_MAX])

    def rewind(self, step: int, why: str) -> None:
        self._rewinds += 1
        self.client.set_tag(self.run_id, f"rollback.{self._rewinds}", f"steps after {step} re-run: {why}")
        self.client.log_metric(self.run_id, "rewind_to_step", float(step), int(time.time() * 1000), step)

    def close(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, status)


def history(client: Any, run_id: str, key: str) -> dict[int, float]:
    """A metric of a raysc run as one value per step: the newest logged (a re-run step's values
    replace those a rollback discarded)."""
    newest: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in newest or m.timestamp >= newest[m.step][0]:
            newest[m.step] = (m.timestamp, m.value)
    return {s: v for s, (_, v) in sorted(newest.items())}
