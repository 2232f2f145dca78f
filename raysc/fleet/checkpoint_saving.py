"""The save in flight and its commit: at most one save at a time, committed once every rank's files are durable.

Workers stage their shards on local disk and upload them (in the background when ``checkpoint.async``).
``SaveInFlight`` starts a save (waiting first for the one in flight), polls it while training runs,
commits its manifest once every rank has uploaded, then applies retention (never to another run's
checkpoints) and refreshes the hot copy; after a failure ``salvage`` commits a save whose uploads all
finished or abandons it. A failed save goes to ``FailedSaves``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raysc.checkpoint.failures import permanent_reason
from raysc.checkpoint.store import CheckpointStore
from raysc.config.load import config_hash, dump_config
from raysc.config.schema import Config
from raysc.fleet.checkpoint_failed_saves import FailedSaves
from raysc.fleet.checkpoint_hot import HotCopy
from raysc.fleet.checkpoint_runs import RunOwnership
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind


class SaveInFlight:
    """The workers saving, the save in flight (``inflight``), the committed saves' records and the newest
    durable step."""

    def __init__(
        self,
        cfg: Config,
        event: Callable[..., dict],
        wait: Callable[..., list],
        store: CheckpointStore,
        runs: RunOwnership,
        failures: FailedSaves,
        hot: HotCopy,
    ) -> None:
        self.cfg, self.event, self.wait, self.store = cfg, event, wait, store
        self.runs, self.failures, self.hot = runs, failures, hot
        self.workers: list = []
        self.inflight: dict | None = None
        self.saves: list[dict] = []
        self._polling = False
        self.durable_step: int | None = None  # newest checkpoint this run committed or restored

    def save(self, step: int, tokens: int) -> None:
        """Start saving ``step`` (waiting first for the save in flight, if any)."""
        if self.inflight is not None:
            waiting_for = self.inflight["step"]  # the watch's poll may commit it while the status is asked
            if any(self.wait([w.save_pending.remote() for w in self.workers], "checkpoint status")):
                self.event(EventKind.CHECKPOINT_SAVE_DELAYED, step=step, waiting_for=waiting_for)
            self.finish()
        if not self.store.discard_uncommitted(step):
            owner = self.runs.owners([step])[step]
            if owner in (None, self.runs.run_id):
                return  # already committed by this run (a resumed run reaching a step it had saved)
            if step not in self.runs.replacing:  # never deleted without --overwrite: this save cannot happen
                self._failed(
                    step,
                    f"step {step} already holds a checkpoint of run {owner}",
                    [],
                    "another run's checkpoint is in the way (move it, or start with --overwrite)",
                    0,
                )
                return
            self.store.delete_committed(step)  # --overwrite: another run's checkpoint at a step this run saves
            self.runs.replacing.remove(step)
            self.event(
                EventKind.CHECKPOINT_REPLACED, step=step, note="--overwrite: the other run's checkpoint at this step"
            )
        t0 = time.perf_counter()
        started = self.wait([w.save_start.remote(step) for w in self.workers], f"checkpoint staging at step {step}")
        self.inflight = {
            "step": step,
            "tokens": tokens,
            "loader": started[0]["loader"],
            "detector": started[0]["detector"],
            "t0": t0,
            "stall_s": max(s["held_s"] for s in started),
            "results": {},
        }
        if not self.cfg.checkpoint.async_save:
            self.finish()

    def poll(self) -> None:
        """Commit the save in flight as soon as every rank has uploaded (called while training runs).

        Only once every rank has answered does it look at the answers, and then through ``wait``: a
        rank that died or raised meanwhile becomes a typed ``RunFailed`` (healed by the supervisor),
        never a raw Ray error. Each rank's result is kept as soon as it has one, so a rank that dies
        after its upload finished still counts as uploaded (``salvage``)."""
        if self.inflight is None or self._polling:
            return
        import ray

        self._polling = True
        try:
            refs = [w.save_pending.remote() for w in self.workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
            if len(ready) < len(refs):
                return
            pending = self.wait(refs, f"checkpoint status of step {self.inflight['step']}")
            kept = self.inflight["results"]
            new = [r for r, busy in enumerate(pending) if not busy and r not in kept]
            if new:
                got = self.wait(
                    [self.workers[r].save_wait.remote() for r in new],
                    f"checkpoint upload of step {self.inflight['step']}",
                )
                kept.update(zip(new, got))
            if not any(pending):
                self.finish()
        finally:
            self._polling = False

    def salvage(self, timeout_s: float = 30.0, gone: set[int] = frozenset()) -> None:
        """After a failure: commit the save in flight if every rank finished its upload (as ``poll``
        recorded, as a dead rank's upload receipt in the store says, or within ``timeout_s`` now);
        else abandon it, its uploaded files deleted and no manifest written. The ranks of ``gone`` are
        known dead: only their receipts are read."""
        if self.inflight is None:
            return
        import ray

        kept = dict(self.inflight["results"])
        for rank in sorted(gone - set(kept)):
            files = self.store.read_receipt(self.inflight["step"], rank)
            if files is not None:
                kept[rank] = {"rank": rank, "ok": True, "files": files, "retries": []}
        asked = {w.save_wait.remote(): r for r, w in enumerate(self.workers) if r not in kept and r not in gone}
        deadline = time.monotonic() + timeout_s
        while asked:
            done, _ = ray.wait(list(asked), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                break  # a rank still uploading (or hung) past the deadline
            rank = asked.pop(done[0])
            try:
                kept[rank] = ray.get(done[0])
            except ray.exceptions.RayError:  # a rank is gone: whole only if it left its upload receipt
                files = self.store.read_receipt(self.inflight["step"], rank)
                if files is None:
                    break
                kept[rank] = {"rank": rank, "ok": True, "files": files, "retries": []}
        if len(kept) == len(self.workers) and all(r["ok"] for r in kept.values()):
            job, self.inflight = self.inflight, None
            try:
                self._commit(job, [kept[r] for r in range(len(self.workers))], hot=False)
            except RunFailed:
                pass  # the commit failed and its policy says stop: already recorded; the caller's error stands
            return
        step, self.inflight = self.inflight["step"], None
        self.event(
            EventKind.CHECKPOINT_SAVE_ABANDONED,
            step=step,
            freed_bytes=self.failures.discard(step),
            note="a rank failed before its upload finished; no manifest written, its files deleted",
        )

    def finish(self) -> None:
        """Wait for the save in flight; commit it if every rank uploaded, else record the failure.

        The save stays in flight until every rank has answered: a rank that dies meanwhile raises
        ``RunFailed`` with the save still held, so the healer's ``salvage`` commits or abandons it
        (and records which), never forgets it."""
        if self.inflight is None:
            return
        job, polling, self._polling = self.inflight, self._polling, True  # no poll commits it meanwhile
        try:
            results = self.wait(
                [w.save_wait.remote() for w in self.workers], f"checkpoint upload of step {job['step']}"
            )
        finally:
            self._polling = polling
        self.inflight = None
        self._commit(job, results)

    def _commit(self, job: dict, results: list[dict], hot: bool = True) -> None:
        """Write the manifest of ``job`` from every rank's upload ``results`` (or record the failed
        save); retention, and the hot copy when ``hot`` (its workers are alive)."""
        step = job["step"]
        failed = [r for r in results if not r["ok"]]
        for r in results:
            for note in r.get("retries", []):
                self.event(EventKind.CHECKPOINT_UPLOAD_RETRY, step=step, rank=r["rank"], detail=note)
        if failed:
            self._failed(
                step,
                failed[0]["error"],
                [r["rank"] for r in failed],
                failed[0].get("permanent"),
                sum(r.get("freed_local", 0) for r in failed),
            )
            return
        files = [f for r in results for f in r["files"]]
        par = self.cfg.parallel
        meta = {
            "run_id": self.runs.run_id,
            "trackers": dict(self.runs.trackers),
            "tokens": job["tokens"],
            "config_hash": config_hash(self.cfg),
            "config": dump_config(self.cfg),
            "layout": {**par.dims.as_dict(), "pp_virtual_stages": par.pp_virtual_stages, "world_size": par.world_size},
            "loader": job["loader"],
            "detectors": {"spike": job["detector"]},
            "state": {
                "model": "DCP key 'model' in .metadata + __*.distcp",
                "optimizer": "DCP key 'optim' in .metadata + __*.distcp",
                "scheduler_rng_loader": "extra_rank{r}.safetensors (JSON + tensors), one per rank",
            },
        }
        try:
            manifest = self.store.commit(step, files, meta)
        except Exception as e:  # the manifest itself could not be written (a full store, a lost endpoint)
            self._failed(step, f"manifest: {type(e).__name__}: {e}", [], permanent_reason(e), 0)
            return
        self.durable_step = step
        self.failures.committed()
        self.runs.committed(step)
        self.runs.delete_replaced()  # --overwrite: this run has a checkpoint of its own now
        total_s = time.perf_counter() - job["t0"]
        deleted = self.store.retention(
            self.cfg.checkpoint.keep_last,
            self.cfg.checkpoint.keep_every_steps,
            protect=step,
            steps=self.runs.own_steps(),
        )  # never another run's
        if self.cfg.checkpoint.hot_copy and hot:
            self.hot.keep(self.workers, step, results)
        rec = {
            "step": step,
            "bytes": sum(f["size"] for f in manifest["files"]),
            "stall_s": round(job["stall_s"], 4),
            "total_s": round(total_s, 3),
        }
        self.saves.append(rec)
        self.event(EventKind.CHECKPOINT_SAVED, **rec, uri=self.cfg.checkpoint_uri, files=len(files), deleted=deleted)

    def _failed(self, step: int, error: str, ranks: list[int], permanent: str | None, freed_local: int) -> None:
        """Hand a failed save to the failed-save policy, with the newest durable step."""
        self.failures.record(step, error, ranks, permanent, freed_local, self.durable_step)
