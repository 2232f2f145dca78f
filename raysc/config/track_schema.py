"""The ``[track]`` section: the experiment trackers a run logs to (TensorBoard, MLflow, W&B;
``raysc.track``, docs/tracking.md) and how a tracker that is down or slow is buffered."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt, opt_dict


@dataclass
class TrackConfig:
    tensorboard: bool = opt(
        False, "write TensorBoard event files under <run dir>/tensorboard (pip install raysc[track])"
    )
    tensorboard_uri: str = opt(
        "",
        "also copy the event files there (any fsspec URL, e.g. s3://bucket/runs/NAME/tb) "
        "every sync_s and at the end, for `tensorboard --logdir` on a shared store",
    )
    storage_options: dict = opt_dict(
        "fsspec options for tensorboard_uri (endpoint_url, region_name ...); "
        "credentials come from the environment (AWS_ACCESS_KEY_ID ...)"
    )
    sync_s: float = opt(30.0, "seconds between copies of the event files to tensorboard_uri", gt=0.0)
    mlflow_uri: str = opt(
        "",
        "log to MLflow: a tracking server (http://host:5000) or a local store "
        "(sqlite:///mlflow.db, file:///path); empty = off",
    )
    mlflow_experiment: str = opt("raysc", "MLflow experiment the run is logged under (created if missing)")
    run_name: str = opt("", "the run's name in MLflow and W&B; empty = run.name")
    wandb_project: str = opt("", "log to Weights & Biases under this project; empty = off")
    wandb_entity: str = opt("", "W&B team or user; empty = the API key's default")
    wandb_mode: str = opt(
        "online",
        "online (needs WANDB_API_KEY and the network) or offline (files under "
        "<run dir>/wandb, `wandb sync` them later)",
        choices=["online", "offline"],
    )
    buffer: int = opt(
        100000,
        "records held per tracker while it is down or slow; the oldest metrics go first "
        "when it fills (counted in the tracker_degraded event)",
        min=100,
    )
    retry_max_s: float = opt(60.0, "longest wait between retries of a tracker that refuses or is down", gt=0.0)
    close_timeout_s: float = opt(
        30.0,
        "at the run's end, the longest wait for a tracker to take what is still "
        "queued (then a tracker_undelivered event; the jsonl files have it all)",
        min=0.0,
    )
