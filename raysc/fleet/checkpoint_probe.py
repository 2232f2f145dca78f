"""Before step 1: a write-read-delete probe of checkpoint.uri, and Young's checkpoint interval advice.

``probe_store`` fails the run (``RunFailed``) when the store cannot be written, read and deleted, and,
when ``checkpoint.every_steps`` is unset, times a sample write to estimate a save and advises an
interval of √(2·MTBF·save_time) (``young_interval_s``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from raysc.checkpoint.storage import StorageError
from raysc.checkpoint.store import CheckpointStore
from raysc.config.schema import Config
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind
from raysc.model.flops import param_count


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval √(2·MTBF·save_time)."""
    return math.sqrt(2.0 * mtbf_s * save_s)


def probe_store(cfg: Config, store: CheckpointStore, event: Callable[..., dict]) -> None:
    """Write-read-delete probe of checkpoint.uri, and Young's interval advice when every_steps is unset."""
    t0 = time.perf_counter()
    try:
        store.storage.probe()
    except StorageError as e:
        raise RunFailed(str(e)) from None
    event(EventKind.CHECKPOINT_STORE_OK, uri=cfg.checkpoint_uri, probe_s=round(time.perf_counter() - t0, 3))
    if not cfg.checkpoint.every_steps:
        _advise_interval(cfg, store, event)


def _advise_interval(cfg: Config, store: CheckpointStore, event: Callable[..., dict]) -> None:
    ckpt_bytes = param_count(cfg.model)["total"] * 4 * 3  # fp32 parameters + two AdamW moments
    sample, rel = min(ckpt_bytes, 32 << 20), f".raysc-throughput-{time.time_ns()}"
    t0 = time.perf_counter()
    store.storage.write_bytes(rel, bytes(sample))
    dt = max(time.perf_counter() - t0, 1e-6)
    store.storage.delete(rel)
    save_s, mtbf_s = ckpt_bytes / (sample / dt), cfg.checkpoint.mtbf_hours * 3600
    event(
        EventKind.CHECKPOINT_INTERVAL_ADVICE,
        estimated_save_s=round(save_s, 3),
        mtbf_hours=cfg.checkpoint.mtbf_hours,
        young_interval_s=round(young_interval_s(save_s, mtbf_s), 1),
        note="checkpoint.every_steps is unset: set it to about this many seconds of training",
    )
