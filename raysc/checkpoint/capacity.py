"""Will the checkpoint store hold the checkpoints a run keeps? (``raysc preflight``, item 3.)

A run keeps ``checkpoint.keep_last`` committed checkpoints and writes one more
before retention deletes the oldest, so the store must hold ``keep_last + 1``
checkpoints of the measured size. The space available is the declared
``checkpoint.capacity_gb`` (a bucket quota, a volume) minus what the store already
holds, or, for a local store without a declaration, the file system's free space.
Object stores do not report a quota through the S3 API, so without a declaration
the check says "not reported" instead of passing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from raysc.checkpoint.store import CheckpointStore
from raysc.config.schema import Config


def _existing_parent(path: str) -> Path:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_capacity(cfg: Config, checkpoint_bytes: int) -> dict:
    """{need_bytes, available_bytes, source, ok}; ``ok`` is None when the capacity is unknown."""
    ck = cfg.checkpoint
    need = int(checkpoint_bytes * (ck.keep_last + 1))
    out: dict = {"checkpoint_bytes": int(checkpoint_bytes), "keep_last": ck.keep_last, "need_bytes": need}
    storage = CheckpointStore.for_config(cfg).storage
    if ck.capacity_gb:
        used = storage.usage("")
        out.update(
            available_bytes=int(ck.capacity_gb * 1e9) - used,
            used_bytes=used,
            source=f"checkpoint.capacity_gb = {ck.capacity_gb}",
        )
    elif storage.is_local:
        out.update(
            available_bytes=shutil.disk_usage(_existing_parent(storage.root)).free,
            source=f"free space of the file system holding {storage.root}",
        )
    else:
        out.update(
            available_bytes=None,
            ok=None,
            source="not reported by an object store: set checkpoint.capacity_gb to the bucket's quota",
        )
        return out
    out["ok"] = out["available_bytes"] >= need
    return out


def describe(cap: dict) -> str:
    if cap["ok"] is None:
        return f"store capacity {cap['source']}"
    gb = lambda b: f"{b / 1e9:.3g} GB"  # noqa: E731
    verdict = "holds" if cap["ok"] else "CANNOT hold"
    text = (
        f"store {verdict} keep_last + 1 = {cap['keep_last'] + 1} checkpoints of {gb(cap['checkpoint_bytes'])} "
        f"({gb(cap['need_bytes'])} needed, {gb(cap['available_bytes'])} available: {cap['source']})"
    )
    if not cap["ok"]:
        text += "; free space, raise the quota, lower checkpoint.keep_last or move checkpoint.uri"
    return text
