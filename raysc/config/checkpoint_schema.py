"""The ``[checkpoint]`` section: where checkpoints are stored and how often, how many are kept,
async saves, transfers, hot copies, manifest signing and what a failed save does."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt, opt_dict


@dataclass
class CheckpointConfig:
    uri: str = opt(
        "",
        "where checkpoints go: a path or fsspec URL (s3://bucket/prefix, gs://, file://); "
        "empty = <run.dir>/checkpoints",
    )
    every_steps: int = opt(
        0,
        "save every N steps and always at the end; 0 (or more than train.steps) = only "
        "at the end, and Young's interval is printed as advice",
        min=0,
    )
    keep_last: int = opt(2, "committed checkpoints kept (at least 2); older ones are deleted", min=2)
    keep_every_steps: int = opt(0, "also keep every checkpoint whose step is a multiple of this; 0 = none", min=0)
    async_save: bool = opt(True, "stage to CPU and upload in the background while training continues", key="async")
    storage_options: dict = opt_dict(
        'fsspec options for the store, e.g. {endpoint_url = "http://...", '
        'region_name = "us-east-1"}; AWS_* environment variables work too'
    )
    transfer_concurrency: int = opt(
        0,
        "parallel ranged GETs per checkpoint file read from an object store "
        "(uploads use the store's multipart parts); 0 = min(8, max(2, CPU cores))",
        min=0,
        max=64,
    )
    hot_copy: bool = opt(
        True,
        "keep the newest checkpoint in Ray's object store and reuse verified node-local "
        "copies for restores; false = every restore reads the durable store",
    )
    signing_key: str = opt(
        "",
        "HMAC-SHA256 key that signs every manifest; restores refuse unsigned or altered "
        "checkpoints before parsing them. Prefer the RAYSC_CHECKPOINT_KEY environment "
        "variable (never written to disk, manifests, events or logs); at least 16 "
        "characters, e.g. `openssl rand -hex 32`; empty = RAYSC_CHECKPOINT_KEY or unsigned",
        secret=True,
    )
    upload_retries: int = opt(3, "retries (with exponential backoff from 1 s) of a failed upload", min=0)
    mtbf_hours: float = opt(24.0, "mean time between failures assumed for Young's interval advice", gt=0.0)
    on_save_failure: str = opt(
        "continue",
        "when a save fails: continue training (a checkpoint_lagging event "
        "says how far behind the newest checkpoint is) until max_failed_saves "
        "in a row, or stop at the first failure",
        choices=["continue", "stop"],
    )
    max_failed_saves: int = opt(
        3,
        "failed saves in a row after which the run stops (continue policy); the "
        "committed checkpoints are kept and the run resumes with --resume",
        min=1,
    )
    capacity_gb: float = opt(
        0.0,
        "space the store may use (a bucket quota, a volume size); raysc preflight "
        "checks it holds keep_last + 1 checkpoints; 0 = free space of a local "
        "store, not checked for object stores",
        min=0.0,
    )
