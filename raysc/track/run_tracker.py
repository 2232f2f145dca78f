"""``RunTracker``: what a run tells its trackers, built from the supervisor's own records.

The supervisor hands it every metrics batch (rank 0's steps), the run-health counters and every
event; it turns them into tracker calls on one ``Relay`` per tracker (never blocking a step):

- per step: ``train/*`` (loss, grad norm, lr, tokens, tokens/s, MFU, step time), ``health/*``
  (restarts, rollbacks, skipped updates, SDC checks and mismatches, goodput), ``checkpoint/*``
  (bytes, stall, save time) at each committed save, ``val/loss`` at the end;
- once: the resolved config as parameters (secrets redacted), the run's identity as tags (raysc run
  id, config hash, corpus hash, git commit);
- events of note (faults, recoveries, node loss, quarantine, rollbacks, slow steps) as text;
- a rewind when steps are re-run (``--resume`` from an older step, a restart, a rollback).

The trackers' run ids are kept in ``<run dir>/track.json`` and in each checkpoint's manifest, so
``--resume`` (also into a new run directory, from the manifest) and every restart continue the same
tracker runs; a fresh run starts new ones.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raysc.config.load import config_to_dict
from raysc.config.schema import Config
from raysc.config.secrets import redact
from raysc.track.relay import Relay

TRACK_FILE = "track.json"  # in a run directory: {tracker: its run id}
# event kinds by name (raysc.fleet.events: this package sits below fleet, whose supervisor imports it)
NOTABLE = {
    "fault_injected",
    "worker_died",
    "worker_error",
    "worker_hang",
    "worker_timeout",
    "recovered",
    "node_lost",
    "node_quarantined",
    "spike_rollback",
    "sdc_mismatch",
    "sdc_repaired",
    "sdc_rollback",
    "slow_step",
    "checkpoint_save_failed",
    "checkpoint_corrupt",
    "resumed",
    "run_failed",
    "run_stopped",
    "update_skipped",
}
REWINDS = {
    "resumed": "step",
    "recovered": "resumed_step",
    "spike_rollback": "resumed_step",
    "sdc_rollback": "resumed_step",
}  # events after which steps are re-run: the field naming the step
TRAIN_KEYS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "step_time",
    "tokens_per_s",
    "mfu",
    # a mixture of experts' routing (raysc.train.moe_routing; absent from a dense run's steps)
    "moe_aux_loss",
    "moe_z_loss",
    "moe_load_max",
    "moe_dead_experts",
)


def read_track_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((Path(run_dir) / TRACK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def flat_params(cfg: Config) -> dict[str, str]:
    """The resolved config as ``section.key`` -> value text, secrets redacted."""
    out: dict[str, str] = {}
    for section, values in redact(config_to_dict(cfg)).items():
        for k, v in values.items():
            out[f"{section}.{k}"] = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return out


def git_commit(cwd: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def build_sinks(cfg: Config, run_dir: Path) -> list:
    tr = cfg.track
    name = tr.run_name or cfg.run.name
    sinks: list = []
    if tr.tensorboard:
        from raysc.track.tb_sink import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir / "tensorboard", tr.tensorboard_uri, tr.storage_options))
    if tr.mlflow_uri:
        from raysc.track.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(tr.mlflow_uri, tr.mlflow_experiment, name))
    if tr.wandb_project:
        from raysc.track.wandb_sink import WandbSink

        sinks.append(WandbSink(tr.wandb_project, tr.wandb_entity, tr.wandb_mode, name, run_dir))
    return sinks


class RunTracker:
    def __init__(
        self, cfg: Config, run_dir: Path, event: Callable[..., dict], ids: dict[str, str], sinks: list | None = None
    ) -> None:
        """``ids``: the trackers' run ids to continue (empty for a fresh run); ``event`` records the
        trackers' own events (``tracker_degraded``, ``tracker_recovered``, ``tracking``)."""
        self.cfg, self.run_dir, self._event = cfg, Path(run_dir), event
        self.ids = dict(ids)
        self._lock = threading.Lock()
        self._max_step = 0  # newest step logged in this session
        self._rewound_at: int | None = None
        self._synced = time.monotonic()  # last time the mirrored trackers (tensorboard_uri) were asked to copy
        opening = threading.Lock()  # the trackers open one at a time (``Relay._do`` says why)
        self.relays = [
            Relay(s, cfg.track.buffer, cfg.track.retry_max_s, self._report, ids.get(s.name), self._opened, opening)
            for s in (build_sinks(cfg, self.run_dir) if sinks is None else sinks)
        ]

    @property
    def active(self) -> bool:
        return bool(self.relays)

    def _call(self, op: str, *args: Any) -> None:
        for r in self.relays:
            r.call(op, *args)

    def _report(self, kind: str, fields: dict[str, Any]) -> None:
        try:
            self._event(kind, **fields)
        except ValueError:
            pass  # the run's records are closed (a tracker recovering after the end)

    def _opened(self, tracker: str, run_id: str) -> None:
        with self._lock:
            first = self.ids.get(tracker) != run_id
            self.ids[tracker] = run_id
            tmp = self.run_dir / f".{TRACK_FILE}.tmp"
            tmp.write_text(json.dumps(self.ids, indent=1))
            tmp.replace(self.run_dir / TRACK_FILE)
        self._report("tracking", {"tracker": tracker, "run_id": run_id, "new": first})

    # ---- from the supervisor ----
    def start(self, run_id: str, config_hash: str) -> None:
        tags = {"raysc.run_id": run_id, "raysc.config_hash": config_hash, "raysc.run_dir": str(self.run_dir)}
        commit = git_commit(Path.cwd())
        if commit:
            tags["git.commit"] = commit
        self._call("params", flat_params(self.cfg), tags)

    def metrics(self, batch: list[dict], health: dict[str, float | None]) -> None:
        if not self.relays or not batch:
            return
        rows = []
        for m in batch:
            values = {f"train/{k}": float(m[k]) for k in TRAIN_KEYS if isinstance(m.get(k), (int, float))}
            rows.append((m["step"], m.get("time", 0.0), values))
        rows[-1][2].update({f"health/{k}": float(v) for k, v in health.items() if v is not None})
        with self._lock:
            self._max_step = max(self._max_step, batch[-1]["step"])
            sync = time.monotonic() - self._synced >= self.cfg.track.sync_s
            if sync:
                self._synced = time.monotonic()
        self._call("metrics", rows)
        if sync:
            for r in self.relays:
                if hasattr(r.sink, "sync"):
                    r.call("sync")

    def event(self, rec: dict) -> None:
        if not self.relays:
            return
        kind = rec["kind"]
        if kind in REWINDS:
            self._rewind(rec[REWINDS[kind]], kind)
        if kind == "checkpoint_saved":
            self._call(
                "metrics",
                [
                    (
                        rec["step"],
                        rec["time"],
                        {
                            "checkpoint/bytes": float(rec["bytes"]),
                            "checkpoint/stall_s": float(rec["stall_s"]),
                            "checkpoint/save_s": float(rec["total_s"]),
                        },
                    )
                ],
            )
        elif kind == "data_ready" and rec.get("corpus_sha256"):
            self._call("params", {}, {"raysc.corpus_sha256": str(rec["corpus_sha256"])})
        elif kind == "run_end" and rec.get("val_loss") is not None:
            self._call("metrics", [(rec["steps"], rec["time"], {"val/loss": float(rec["val_loss"])})])
        if kind in NOTABLE:
            step = rec.get("step", rec.get("resumed_step", self._max_step))
            text = json.dumps({k: v for k, v in rec.items() if k not in ("kind", "time")}, default=str)
            self._call("text", int(step or 0), kind, text)

    def _rewind(self, step: int, why: str) -> None:
        """Steps after ``step`` will be re-run: once per restore (a restart records both ``resumed``
        and ``recovered``), and only when something after it may have been logged (in this session,
        or by an earlier one: the first restore of a session)."""
        with self._lock:
            if self._max_step <= step and self._rewound_at is not None:
                return
            self._rewound_at, self._max_step = step, step
        self._call("rewind", step, why)

    def close(self, status: str) -> dict[str, bool]:
        """End the trackers' runs (FINISHED, FAILED, KILLED), waiting up to track.close_timeout_s
        (for all of them together) for what is queued; whether each got everything."""
        end = time.monotonic() + self.cfg.track.close_timeout_s
        for r in self.relays:
            r.begin_close(status)
        done = {r.sink.name: r.wait_closed(max(0.0, end - time.monotonic())) for r in self.relays}
        for name, ok in done.items():
            if not ok:
                st = next(r.state for r in self.relays if r.sink.name == name)
                self._report(
                    "tracker_undelivered",
                    {
                        "tracker": name,
                        "pending": st.pending,
                        "error": st.last_error,
                        "note": "the tracker did not take the run's last records before the run ended; "
                        "metrics.jsonl and events.jsonl have them",
                    },
                )
        return done

    def states(self) -> dict[str, dict]:
        return {r.sink.name: r.state.as_dict() for r in self.relays}
