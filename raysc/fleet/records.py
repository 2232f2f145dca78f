"""The run directory's records: ``metrics.jsonl``, ``events.jsonl`` and dashboard gauges.

One JSON object per line, flushed as written, so a crashed run keeps every line
it produced and ``tail -f`` works. The same figures go to ``ray.util.metrics``
gauges (Ray dashboard / Prometheus) when Ray is running.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from raysc.fleet.events import EventKind

DASHBOARD_METRICS = {
    "loss": "training loss of the last optimizer step",
    "grad_norm": "global gradient norm before clipping",
    "lr": "learning rate of the last step",
    "tokens_per_s": "training throughput, tokens per second",
    "mfu": "model FLOPs utilisation",
    "step": "last completed optimizer step",
    "dp": "data-parallel size of the fleet now (an elastic run's follows the cluster)",
    "data_wait_s": "seconds rank 0's last step waited for its batch (reads from the corpus not hidden by prefetch)",
    # a mixture of experts' routing (raysc.train.moe_routing); a dense run never sets them
    "moe_load_max": "mixture of experts: the busiest expert's tokens over the mean, worst layer (1 = balanced)",
    "moe_dead_experts": "mixture of experts: experts that got no token in the last step, all layers",
    "moe_aux_loss": "mixture of experts: the load-balancing loss, mean over layers (1 = balanced)",
}
HEALTH_METRICS = {
    "restarts": "fleet restarts after a dead, hung or failing worker",
    "rollbacks": "restores of an earlier checkpoint (loss spikes, replica disagreement)",
    "skipped_steps": "optimizer updates skipped by the spike/NaN detector",
    "sdc_checks": "passing replica fingerprint comparisons",
    "sdc_mismatches": "replica fingerprint comparisons that found corrupted parameters",
    "goodput": "time in steps that count toward the final model / wall time so far",
    "checkpoint_lag_steps": "steps trained since the newest durable checkpoint (what a failure now would cost)",
}


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.write_many([record])

    def write_many(self, records: list[dict[str, Any]]) -> None:
        self._f.write("".join(json.dumps(r) + "\n" for r in records))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class RunRecords:
    def __init__(self, run_dir: Path, run_name: str) -> None:
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl")
        self.events = JsonlWriter(run_dir / "events.jsonl")
        self._gauges = {}
        try:
            from ray.util.metrics import Gauge

            for name, desc in {**DASHBOARD_METRICS, **HEALTH_METRICS}.items():
                self._gauges[name] = Gauge(f"raysc_{name}", description=desc, tag_keys=("run",))
                self._gauges[name].set_default_tags({"run": run_name})
        except Exception as e:  # metrics are optional outside a Ray worker; the files are the record
            self.event(EventKind.DASHBOARD_METRICS_UNAVAILABLE, error=repr(e))

    def metrics_batch(self, batch: list[dict[str, Any]]) -> None:
        """Append every step's metrics; the dashboard gauges show the newest."""
        self.metrics.write_many(batch)
        last = batch[-1]
        for name, gauge in self._gauges.items():
            if last.get(name) is not None:
                gauge.set(float(last[name]))

    def health(self, values: dict[str, float | None]) -> None:
        """Set the run-health gauges (``HEALTH_METRICS``) to their current totals."""
        for name, value in values.items():
            if value is not None and name in self._gauges:
                self._gauges[name].set(float(value))

    def event(self, kind: EventKind | str, **fields: Any) -> dict:
        """Append one event; ``kind`` must be an ``EventKind`` (ValueError names an unknown one)."""
        rec = {"time": time.time(), "kind": EventKind(kind).value, **fields}
        self.events.write(rec)
        return rec

    def close(self) -> None:
        self.metrics.close()
        self.events.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a last line without its newline is one still being written (a
    live run's metrics or events, read by `raysc status` or a test while the run appends) and is left
    out, not parsed half-way (a CI run once read half a metrics line and failed)."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")[:-1]  # the part after the last newline: empty, or a record not finished yet
    return [json.loads(line) for line in lines if line.strip()]


SERVING_RECORD = "serve/serving.json"  # in a run directory: what serves the run now (raysc serve writes it)


def read_serving(run_dir: str | Path) -> dict | None:
    """The serving record of the run in ``run_dir`` (None when nothing serves it)."""
    try:
        return json.loads((Path(run_dir) / SERVING_RECORD).read_text())
    except (OSError, ValueError):
        return None
