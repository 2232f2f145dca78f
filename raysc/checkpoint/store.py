"""Checkpoints in any fsspec store: one prefix per step, a manifest written last.

Layout under ``checkpoint.uri``::

    step_00000100/
        .metadata, __0_0.distcp, __1_0.distcp ...  torch.distributed.checkpoint shards (model + optimizer)
        extra_rank0.pt, extra_rank1.pt ...         per rank: step, tokens, loader cursor, scheduler, RNG
        manifest.json                              written last: step, tokens, layout, config + hash,
                                                   every file with size and sha256, loader state

Rules (``docs/checkpointing.md``): a checkpoint exists only when its manifest
exists and every file it lists is there with the recorded size (and, when
loading, the recorded SHA-256). The newest is found by listing manifests; no
object is rewritten in place: a prefix left by a save that died before its
commit is deleted before that step is saved again. Retention un-commits (deletes
the manifest) before deleting files, and never touches the checkpoint being
restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raysc.checkpoint.storage import Storage
from raysc.hashing import file_sha256

FORMAT = "raysc-ckpt-v2"
MANIFEST = "manifest.json"


class CorruptCheckpoint(RuntimeError):
    """A file of a committed checkpoint is missing, truncated or altered."""

    def __init__(self, step: int, file: str, reason: str) -> None:
        super().__init__(f"checkpoint step {step}: {file}: {reason}")
        self.step, self.file, self.reason = step, file, reason

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (CorruptCheckpoint, (self.step, self.file, self.reason))


@dataclass
class CheckpointStore:
    uri: str
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.storage = Storage(self.uri, self.options)

    # ---- listing and verification ----
    def prefix(self, step: int) -> str:
        return self.storage.step_prefix(step)

    def read_manifest(self, step: int) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(f"{self.prefix(step)}/{MANIFEST}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def steps(self) -> list[int]:
        """Steps with a manifest, oldest first."""
        out = []
        for name in self.storage.step_dirs():
            try:
                step = int(name.split("_", 1)[1])
            except ValueError:
                continue
            if self.storage.exists(f"{name}/{MANIFEST}"):
                out.append(step)
        return sorted(out)

    def verify(self, step: int, checksums: bool = False) -> str | None:
        """None when ``step`` is intact; else why not. Sizes always, SHA-256 if ``checksums``."""
        manifest = self.read_manifest(step)
        if manifest is None:
            return "no manifest (never committed)"
        for entry in manifest["files"]:
            rel = f"{self.prefix(step)}/{entry['path']}"
            try:
                size = self.storage.size(rel)
            except FileNotFoundError:
                return f"{entry['path']}: missing"
            if size != entry["size"]:
                return f"{entry['path']}: size {size} != recorded {entry['size']} (truncated or altered)"
            if checksums and self.storage.sha256(rel) != entry["sha256"]:
                return f"{entry['path']}: sha256 mismatch (altered after commit)"
        return None

    def latest(self, on_skip: Callable[[int, str], None] | None = None, checksums: bool = False) -> int | None:
        for step in reversed(self.steps()):
            reason = self.verify(step, checksums)
            if reason is None:
                return step
            if on_skip:
                on_skip(step, reason)
        return None

    # ---- writing ----
    def discard_uncommitted(self, step: int) -> bool:
        """Before saving ``step``: False if it is already committed, else clear any leftovers."""
        if self.read_manifest(step) is not None:
            return False
        self.storage.delete_prefix(self.prefix(step))
        return True

    def upload(self, step: int, local_dir: Path, names: list[str], retries: int = 3,
               backoff_s: float = 1.0, on_retry: Callable[[str, int, Exception], None] | None = None,
               after_file: Callable[[str], None] | None = None) -> list[dict]:
        """Upload ``names`` from ``local_dir``; return their manifest entries. Retries with backoff."""
        entries = []
        for name in names:
            for attempt in range(retries + 1):
                try:
                    size, sha = self.storage.upload_file(str(local_dir / name), f"{self.prefix(step)}/{name}")
                    entries.append({"path": name, "size": size, "sha256": sha})
                    if after_file:
                        after_file(name)
                    break
                except Exception as e:  # any client error (botocore's have no common base) is retried
                    if attempt == retries:
                        raise
                    if on_retry:
                        on_retry(name, attempt + 1, e)
                    time.sleep(backoff_s * 2 ** attempt)
        return entries

    def commit(self, step: int, files: list[dict], meta: dict) -> dict:
        """Write the manifest (the commit point) after every file is durable."""
        manifest = {"format": FORMAT, "step": step, "time": time.time(),
                    "files": sorted(files, key=lambda f: f["path"]), **meta}
        self.storage.write_bytes(f"{self.prefix(step)}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        return manifest

    def retention(self, keep_last: int, keep_every: int = 0, protect: int | None = None) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep_last`` (sparing multiples of
        ``keep_every`` and ``protect``); return the deleted steps."""
        steps = self.steps()
        doomed = [s for s in steps[:-keep_last] if s != protect and not (keep_every and s % keep_every == 0)]
        for s in doomed:
            self.storage.delete(f"{self.prefix(s)}/{MANIFEST}")  # un-commit first
            self.storage.delete_prefix(self.prefix(s))
        return doomed

    # ---- reading ----
    def fetch(self, step: int, local_dir: Path, hot: dict | None = None) -> tuple[dict, str]:
        """Make ``local_dir`` hold every file of ``step`` with its recorded SHA-256.

        Files already there and intact are kept; the rest come from ``hot`` (name -> bytes
        getter, the supervisor's in-memory copy) or the store. Returns (manifest, source).
        Raises ``CorruptCheckpoint`` naming the first bad file; nothing is loaded from it.
        """
        manifest = self.read_manifest(step)
        if manifest is None:
            raise CorruptCheckpoint(step, MANIFEST, "missing")
        local_dir.mkdir(parents=True, exist_ok=True)
        sources = set()
        for entry in manifest["files"]:
            target = local_dir / entry["path"]
            if target.is_file() and target.stat().st_size == entry["size"] and file_sha256(target) == entry["sha256"]:
                sources.add("local")
                continue
            tmp = target.with_name(target.name + f".part{os.getpid()}")
            got = None
            if hot and entry["path"] in hot:
                try:
                    data = hot[entry["path"]]()
                    tmp.write_bytes(data)
                    got = (len(data), file_sha256(tmp))
                    sources.add("hot")
                except Exception:  # the hot copy is a cache: any failure falls back to the store
                    got = None
            if got is None or got != (entry["size"], entry["sha256"]):
                try:
                    got = self.storage.download_file(f"{self.prefix(step)}/{entry['path']}", str(tmp),
                                                     size_hint=entry["size"])
                except FileNotFoundError:
                    raise CorruptCheckpoint(step, entry["path"], "missing from the store") from None
                sources.add("store")
            if got[0] != entry["size"]:
                tmp.unlink(missing_ok=True)
                raise CorruptCheckpoint(step, entry["path"], f"size {got[0]} != recorded {entry['size']}")
            if got[1] != entry["sha256"]:
                tmp.unlink(missing_ok=True)
                raise CorruptCheckpoint(step, entry["path"], "sha256 mismatch")
            tmp.replace(target)
        source = "store" if "store" in sources else "hot" if "hot" in sources else "local"
        return manifest, source


def local_copy_dir(cache_dir: str | Path, uri: str, step: int) -> Path:
    """Where a node keeps its copy of checkpoint ``step`` of ``uri`` (save staging and restore cache)."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:12]
    return Path(cache_dir) / "checkpoints" / key / f"step_{step:08d}"


# ---- DCP staging on local disk (every rank, collective over ``group``) ----
def write_shards(local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group=None,
                 asynchronous: bool = False):
    """Write this rank's DCP shards (collective over ``group``) into ``local_dir``. Asynchronously,
    the state is copied to CPU memory now and written by a background thread: the returned future
    completes when the files are on disk (None when synchronous)."""
    local_dir.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer)
    # staging, not the durable copy: skip fsync (the store holds the durable copy)
    writer = FileSystemWriter(str(local_dir), sync_files=False)
    state = {"model": msd, "optim": osd}
    if asynchronous:
        return dcp.async_save(state, storage_writer=writer, process_group=group)
    dcp.save(state, storage_writer=writer, process_group=group)
    return None


def stage_shards(local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, rank: int,
                 group=None) -> list[str]:
    """Write this rank's DCP shards and extra state into ``local_dir``; return the files it wrote."""
    write_shards(local_dir, model, optimizer, group)
    torch.save(extra, local_dir / f"extra_rank{rank}.pt")
    return rank_files(local_dir, rank)


def rank_files(local_dir: Path, rank: int) -> list[str]:
    names = [p.name for p in local_dir.glob(f"__{rank}_*.distcp")] + [f"extra_rank{rank}.pt"]
    if rank == 0 and (local_dir / ".metadata").is_file():
        names.append(".metadata")
    return sorted(names)


def load_local(local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int,
               group=None) -> dict:
    """Load tensors in place from a local copy of a checkpoint (DCP reshards as needed)."""
    reader = FileSystemReader(str(local_dir))
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=reader, process_group=group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        msd = model.state_dict()
        dcp.load({"model": msd}, storage_reader=reader, process_group=group)
        model.load_state_dict(msd)
    extra = local_dir / f"extra_rank{rank}.pt"
    if not extra.is_file():  # resharded to more ranks than saved: counters and cursor are global
        extra = local_dir / "extra_rank0.pt"
    return torch.load(extra, weights_only=False) if extra.is_file() else {}


def clear_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
