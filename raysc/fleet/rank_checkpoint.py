"""``RankCheckpoints``: one rank's part of every checkpoint, held by its ``RankWorker``
(``raysc.fleet.rank``): staging its shards to this node's disk, uploading them in a background thread
(the save in flight), fetching a checkpoint to this node and loading it, and the staged files the
supervisor keeps as a hot copy.

It owns the checkpoint store, the checkpoint group (a gloo group of its own, so checkpoint I/O cannot
deadlock with training collectives) and the save in flight; it reads the rank's config, trainer and
fault injector from its ``RankWorker`` each time it uses them (a spare's ``activate`` replaces the
config and the injector). This module imports torch; only the worker processes import it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch.distributed as dist

from raysc.checkpoint.failures import PermanentStorageError
from raysc.checkpoint.local_copies import local_copy_dir, prune_local_copies
from raysc.checkpoint.staging import Staged, load_local, rank_files, save_extra, write_shards
from raysc.checkpoint.store import CheckpointStore

if TYPE_CHECKING:
    from raysc.fleet.rank import RankWorker


def discard_staged(local: Path, rank: int) -> int:
    """Remove this rank's staged files of a save that failed (they will never be committed); bytes freed."""
    freed = 0
    for name in rank_files(local, rank):
        path = local / name
        if path.is_file():
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
    return freed


class RankCheckpoints:
    def __init__(self, worker: RankWorker) -> None:
        self._worker = worker
        self.store: CheckpointStore | None = None  # set by ``RankWorker.setup``
        self.group: dist.ProcessGroup | None = None  # checkpoint I/O's own gloo group, made in setup
        self._save: dict | None = None

    def local_dir(self, step: int, uri: str | None = None) -> Path:
        """This node's copy of checkpoint ``step`` (staging for saves, cache for restores)."""
        cfg = self._worker.cfg
        return local_copy_dir(
            cfg.data.cache_dir, uri or cfg.checkpoint_uri, step, ray.get_runtime_context().get_node_id()
        )

    def fetch(self, uri: str, step: int, hot: dict | None) -> dict:
        """Bring every file of checkpoint ``step`` under ``uri`` to this node, verifying sizes and
        SHA-256 (no collectives, so a corrupt file fails here, on every rank, before any load)."""
        cfg = self._worker.cfg
        getters = {name: (lambda ref=ref: ray.get(ref)) for name, ref in (hot or {}).items()}
        store = self.store if uri == cfg.checkpoint_uri else CheckpointStore.for_config(cfg, uri)
        t0 = time.perf_counter()
        _, source = store.fetch(step, self.local_dir(step, uri), getters, reuse_local=cfg.checkpoint.hot_copy)
        return {"rank": self._worker.rank, "source": source, "seconds": time.perf_counter() - t0}

    def load(self, uri: str, step: int) -> int:
        """Load a fetched checkpoint into the model, optimizer, scheduler, loader and RNG
        (DCP reshards it when it was written under another layout)."""
        trainer = self._worker.trainer
        extra = load_local(
            self.local_dir(step, uri), trainer.shard.state_module(), trainer.optimizer, self._worker.rank, step=step
        )
        trainer.load_extra_state(extra)
        return trainer.step

    def save_start(self, step: int) -> dict:
        """Stage this rank's shards for ``step`` to local disk (collective over the checkpoint
        group) and upload them in a background thread; returns the seconds training was held
        and the loader state recorded in the manifest."""
        cfg, trainer = self._worker.cfg, self._worker.trainer
        t0 = time.perf_counter()
        local = self.local_dir(step)
        prune_local_copies(local, cfg.checkpoint.keep_last)  # a cache of the store: the store's count
        local.mkdir(parents=True, exist_ok=True)
        for stale in rank_files(local, self._worker.rank):  # leftovers of an earlier attempt at this step
            (local / stale).unlink(missing_ok=True)
        extra = trainer.extra_state()
        staged = write_shards(
            local,
            trainer.shard.state_module(),
            trainer.optimizer,
            self.group,
            asynchronous=cfg.checkpoint.async_save,
        )
        self._save = {"step": step, "done": threading.Event(), "result": None}
        threading.Thread(target=self._finish_save, args=(step, local, staged, extra), daemon=True).start()
        held = time.perf_counter() - t0
        if not cfg.checkpoint.async_save:
            self._save["done"].wait()
        return {"held_s": held, "loader": extra["loader"], "detector": extra["detector"]}

    def _finish_save(self, step: int, local: Path, staged: Staged, extra: dict) -> None:
        rank = self._worker.rank
        retries: list[str] = []
        result: dict = {"rank": rank, "step": step, "retries": retries}
        try:
            self._worker.faults.before_upload(step)
            save_extra(staged, local, extra, rank)
            digests = staged.wait()
            entries = self.store.upload(
                step,
                local,
                rank_files(local, rank),
                digests,
                retries=self._worker.cfg.checkpoint.upload_retries,
                on_retry=lambda name, n, e: retries.append(f"{name} try {n}: {e}"),
                after_file=self._worker.faults.on_file_written(step),
            )
            self.store.write_receipt(step, rank, entries)  # the supervisor may commit it without us
            result.update(ok=True, files=entries)
        except Exception as e:  # reported to the supervisor, which records it and applies its policy
            result.update(
                ok=False,
                error=f"{type(e).__name__}: {e}",
                permanent=getattr(e, "reason", None) if isinstance(e, PermanentStorageError) else None,
                freed_local=discard_staged(local, rank),
            )
        self._save["result"] = result
        self._save["done"].set()

    def read_file(self, step: int, name: str) -> bytes:
        """Bytes of one staged checkpoint file. The supervisor calls this right after a commit and
        keeps the returned ObjectRefs: Ray makes the caller their owner, so the hot copy lives in
        the object store under the supervisor and survives this worker's death."""
        return (self.local_dir(step) / name).read_bytes()

    def save_wait(self) -> dict:
        """Block until the save in flight has uploaded; its files and hot-copy refs, or its error."""
        self._save["done"].wait()
        return self._save["result"]

    def save_pending(self) -> bool:
        return self._save is not None and not self._save["done"].is_set()
