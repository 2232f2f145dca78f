"""Checkpoints: DCP shards plus a manifest written last.

Layout under the checkpoint root (``checkpoint.uri``, a local directory here)::

    step_00000100/
        .metadata, __0_0.distcp ...   torch.distributed.checkpoint shards (model + optimizer)
        extra_rank0.pt                step, tokens, loader cursor, scheduler, RNG of each rank
        manifest.json                 written last: step, layout, config hash, files with size + sha256

A checkpoint exists only when its manifest exists and every file it lists has
the recorded size (``verify=True`` also checks SHA-256). The newest such
checkpoint is found by listing; nothing is ever rewritten in place, and
retention deletes only older, committed checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT = "raysc-ckpt-v1"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, rank: int) -> None:
    """Every rank: write its DCP shards and its extra state into ``path`` (no manifest)."""
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    torch.save(extra, path / f"extra_rank{rank}.pt")


def commit(path: Path, step: int, meta: dict) -> dict:
    """Rank 0, after every rank's shards are written: checksum the files and write the manifest."""
    files = []
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != "manifest.json"):
        files.append({"path": f.relative_to(path).as_posix(), "size": f.stat().st_size, "sha256": _sha256(f)})
    manifest = {"format": FORMAT, "step": step, "time": time.time(), "files": files, **meta}
    tmp = path / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(path / "manifest.json")
    return manifest


def read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def verify(path: Path, checksums: bool = True) -> str | None:
    """None when the checkpoint at ``path`` is intact, else the reason it is not."""
    manifest = read_manifest(path)
    if manifest is None:
        return "no manifest (never committed)"
    for entry in manifest["files"]:
        f = path / entry["path"]
        if not f.is_file():
            return f"{entry['path']}: missing"
        if f.stat().st_size != entry["size"]:
            return f"{entry['path']}: size {f.stat().st_size} != recorded {entry['size']}"
        if checksums and _sha256(f) != entry["sha256"]:
            return f"{entry['path']}: sha256 mismatch"
    return None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every directory with a manifest, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    out = []
    for p in r.glob("step_*"):
        m = read_manifest(p)
        if m is not None:
            out.append((int(m["step"]), p))
    return sorted(out)


def latest_checkpoint(root: str | Path, on_skip=None) -> Path | None:
    """The newest checkpoint that verifies; ``on_skip(path, reason)`` hears about broken ones."""
    for _, p in reversed(list_checkpoints(root)):
        reason = verify(p)
        if reason is None:
            return p
        if on_skip:
            on_skip(p, reason)
    return None


def load_shards(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int) -> dict:
    """Load model (and optimizer) tensors in place from ``path``; return this rank's extra state."""
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        msd = model.state_dict()
        dcp.load({"model": msd}, checkpoint_id=str(path))
        model.load_state_dict(msd)
    extra = path / f"extra_rank{rank}.pt"
    if not extra.is_file():  # resharded to more ranks than saved: the counters and cursor are global
        extra = path / "extra_rank0.pt"
    return torch.load(extra, weights_only=False) if extra.is_file() else {}


def prepare_step_dir(root: str | Path, step: int) -> Path | None:
    """A fresh directory for ``step``, or None if a committed checkpoint already holds it."""
    path = step_dir(root, step)
    if read_manifest(path) is not None:
        return None
    if path.exists():  # leftovers of a save that died before its commit
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def apply_retention(root: str | Path, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep_last``; return what was deleted."""
    ckpts = list_checkpoints(root)
    doomed = [p for _, p in ckpts[:-keep_last] if p != protect] if keep_last > 0 else []
    for p in doomed:
        (p / "manifest.json").unlink()  # un-commit first, so a crash mid-delete leaves no half checkpoint
        shutil.rmtree(p)
    return doomed
