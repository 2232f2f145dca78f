"""The supervisor's side of checkpointing: probe, save, commit, retain, hot copy, restore.

Workers stage their shards on local disk and upload them (in the background when ``checkpoint.async``);
this coordinator keeps at most one save in flight, commits the manifest once every rank's files are durable,
applies retention, keeps the newest checkpoint's files in Ray's object store (owned by the supervisor, so
they outlive any worker) and, on resume, walks back from the newest checkpoint until one fetches intact.

A failed save deletes what it uploaded (and each rank its staged files), is recorded with how much it
freed and whether retrying could have helped (``raysc.checkpoint.failures``), and raises a
``checkpoint_lagging`` event with the newest durable step; ``checkpoint.on_save_failure`` /
``max_failed_saves`` decide when the run stops instead of training on with its work unsaved.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from raysc.checkpoint.failures import permanent_reason
from raysc.checkpoint.storage import StorageError
from raysc.checkpoint.store import RUN_FILE, CheckpointStore, CorruptCheckpoint, read_run_id
from raysc.config.load import config_hash, dump_config
from raysc.config.schema import Config
from raysc.fleet.errors import Failure, FailureKind, RunFailed
from raysc.fleet.events import EventKind
from raysc.model.flops import param_count


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval √(2·MTBF·save_time)."""
    return math.sqrt(2.0 * mtbf_s * save_s)


def parse_resume_from(spec: str) -> tuple[str, int]:
    """'s3://bucket/run/step_00000100' -> ('s3://bucket/run', 100)."""
    m = re.match(r"^(?P<root>.*?)/?step_(?P<step>\d+)/?$", spec)
    if not m:
        raise RunFailed(f"--resume-from {spec!r}: expected URI/step_NNNNNNNN (see `raysc ckpt list URI`)")
    return m["root"], int(m["step"])


class CheckpointCoordinator:
    def __init__(self, cfg: Config, event: Callable[..., dict], wait: Callable[..., list]) -> None:
        self.cfg, self.event, self.wait = cfg, event, wait
        self.store = CheckpointStore.for_config(cfg)
        self.load_store = self.store  # where a restore reads from (--resume-from may point elsewhere)
        self.workers: list = []
        self.inflight: dict | None = None
        self.hot: dict[str, object] = {}  # file name -> ObjectRef of the newest committed checkpoint
        self.hot_step: int | None = None
        self.saves: list[dict] = []
        self._polling = False
        self.durable_step: int | None = None  # newest checkpoint this run committed or restored
        self.failed_in_row = 0  # failed saves since the last commit (checkpoint.max_failed_saves)
        self.failed_saves = 0
        self.run_id = ""  # recorded in run.json and every manifest (``claim``)
        self.trackers: dict[str, str] = {}  # the [track] trackers' run ids, in every manifest
        self.replacing: list[int] = []  # another run's steps, deleted once this run commits (--overwrite)
        self._run_of: dict[int, str | None] = {}  # a committed step's run id (its manifest never changes)

    # ---- whose checkpoints these are ----
    def claim(self, resume: bool | str, overwrite: bool, run_dir: Path) -> str:
        """Decide this run's id before any worker starts, and refuse to start a fresh run over another
        run's committed checkpoints unless ``overwrite`` (which deletes nothing until this run commits).
        The id goes to ``run_dir/run.json`` and into every manifest; restores take only this run's."""
        committed = self.store.steps()
        own_store = not isinstance(resume, str) or parse_resume_from(resume)[0].rstrip(
            "/"
        ) == self.cfg.checkpoint_uri.rstrip("/")
        if resume is False or not own_store:
            if committed and not overwrite:
                owners = sorted({o or "unknown" for o in self._owners(committed).values()})
                raise RunFailed(
                    f"checkpoint.uri {self.cfg.checkpoint_uri} already holds committed checkpoints (steps "
                    f"{committed}) of run {', '.join(owners)}; a fresh run would mix its checkpoints with them. "
                    f"Continue that run with --resume, start a new one with another run.dir or checkpoint.uri, "
                    f"or pass --overwrite to replace them (nothing is deleted until this run commits its first "
                    f"checkpoint)."
                )
            self.run_id = uuid.uuid4().hex[:12]
            self.replacing = committed if overwrite else []
            if self.replacing:
                self.event(
                    EventKind.CHECKPOINT_OVERWRITE_PENDING,
                    steps=committed,
                    note="--overwrite: these are deleted once this run commits its first checkpoint",
                )
        else:
            recorded = read_run_id(run_dir)
            newest = self._owners(committed[-1:]).get(committed[-1]) if committed else None
            self.run_id = recorded or newest or uuid.uuid4().hex[:12]
        (run_dir / RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "checkpoint_uri": self.cfg.checkpoint_uri}))
        return self.run_id

    def tracker_ids(self, resume: bool | str) -> dict[str, str]:
        """The trackers' run ids in the manifest of the checkpoint ``resume`` names (the newest
        committed one for ``True``); empty when there is none."""
        if isinstance(resume, str):
            root, step = parse_resume_from(resume)
            store = (
                self.store
                if root.rstrip("/") == self.cfg.checkpoint_uri.rstrip("/")
                else CheckpointStore.for_config(self.cfg, root)
            )
        else:
            store, steps = self.store, self.store.steps()
            if not steps:
                return {}
            step = steps[-1]
        ids = (store.read_manifest(step) or {}).get("trackers") or {}
        return {k: v for k, v in ids.items() if isinstance(v, str)}

    def _owners(self, steps: list[int]) -> dict[int, str | None]:
        """Each step's run id; a manifest is read once (retention asks at every save), an unreadable one again."""
        for s in set(steps) - self._run_of.keys():
            manifest = self.store.read_manifest(s)
            if manifest is not None:
                self._run_of[s] = manifest.get("run_id")
        return {s: self._run_of.get(s) for s in steps}

    def own_steps(self) -> list[int]:
        """Committed steps written by this run (or by a raysc that recorded no run id), oldest first."""
        return [s for s, o in self._owners(self.store.steps()).items() if o in (None, self.run_id)]

    def latest(self) -> int | None:
        """This run's newest committed checkpoint that verifies (sizes), or None."""
        return next((s for s in reversed(self.own_steps()) if self.store.verify(s) is None), None)

    # ---- before step 1 ----
    def probe(self) -> None:
        """Write-read-delete probe of checkpoint.uri, and Young's interval advice when every_steps is unset."""
        t0 = time.perf_counter()
        try:
            self.store.storage.probe()
        except StorageError as e:
            raise RunFailed(str(e)) from None
        self.event(
            EventKind.CHECKPOINT_STORE_OK, uri=self.cfg.checkpoint_uri, probe_s=round(time.perf_counter() - t0, 3)
        )
        if not self.cfg.checkpoint.every_steps:
            self._advise_interval()

    def _advise_interval(self) -> None:
        ckpt_bytes = param_count(self.cfg.model)["total"] * 4 * 3  # fp32 parameters + two AdamW moments
        sample, rel = min(ckpt_bytes, 32 << 20), f".raysc-throughput-{time.time_ns()}"
        t0 = time.perf_counter()
        self.store.storage.write_bytes(rel, bytes(sample))
        dt = max(time.perf_counter() - t0, 1e-6)
        self.store.storage.delete(rel)
        save_s, mtbf_s = ckpt_bytes / (sample / dt), self.cfg.checkpoint.mtbf_hours * 3600
        self.event(
            EventKind.CHECKPOINT_INTERVAL_ADVICE,
            estimated_save_s=round(save_s, 3),
            mtbf_hours=self.cfg.checkpoint.mtbf_hours,
            young_interval_s=round(young_interval_s(save_s, mtbf_s), 1),
            note="checkpoint.every_steps is unset: set it to about this many seconds of training",
        )

    # ---- saving ----
    def save(self, step: int, tokens: int) -> None:
        """Start saving ``step`` (waiting first for the save in flight, if any)."""
        if self.inflight is not None:
            waiting_for = self.inflight["step"]  # the watch's poll may commit it while the status is asked
            if any(self.wait([w.save_pending.remote() for w in self.workers], "checkpoint status")):
                self.event(EventKind.CHECKPOINT_SAVE_DELAYED, step=step, waiting_for=waiting_for)
            self.finish()
        if not self.store.discard_uncommitted(step):
            owner = self._owners([step])[step]
            if owner in (None, self.run_id):
                return  # already committed by this run (a resumed run reaching a step it had saved)
            if step not in self.replacing:  # never deleted without --overwrite: this save cannot happen
                self._save_failed(
                    step,
                    f"step {step} already holds a checkpoint of run {owner}",
                    [],
                    "another run's checkpoint is in the way (move it, or start with --overwrite)",
                    0,
                )
                return
            self.store.delete_committed(step)  # --overwrite: another run's checkpoint at a step this run saves
            self.replacing.remove(step)
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

    def salvage(self, timeout_s: float = 30.0) -> None:
        """After a failure: commit the save in flight if every rank finished its upload (as ``poll``
        recorded, as a dead rank's upload receipt in the store says, or within ``timeout_s`` now);
        else abandon it, its uploaded files deleted and no manifest written."""
        if self.inflight is None:
            return
        import ray

        kept = dict(self.inflight["results"])
        asked = {w.save_wait.remote(): r for r, w in enumerate(self.workers) if r not in kept}
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
            freed_bytes=self._discard(step),
            note="a rank failed before its upload finished; no manifest written, its files deleted",
        )

    def finish(self) -> None:
        """Wait for the save in flight; commit it if every rank uploaded, else record the failure."""
        if self.inflight is None:
            return
        job, self.inflight = self.inflight, None
        results = self.wait([w.save_wait.remote() for w in self.workers], f"checkpoint upload of step {job['step']}")
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
            self._save_failed(
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
            "run_id": self.run_id,
            "trackers": dict(self.trackers),
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
            self._save_failed(step, f"manifest: {type(e).__name__}: {e}", [], permanent_reason(e), 0)
            return
        self.durable_step, self.failed_in_row, self._run_of[step] = step, 0, self.run_id
        if self.replacing:  # --overwrite: this run has a checkpoint of its own now
            for old in self.replacing:
                self.store.delete_committed(old)
            self.event(
                EventKind.PREVIOUS_RUN_DELETED, steps=self.replacing, note="--overwrite, after this run's first commit"
            )
            self.replacing = []
        total_s = time.perf_counter() - job["t0"]
        deleted = self.store.retention(
            self.cfg.checkpoint.keep_last, self.cfg.checkpoint.keep_every_steps, protect=step, steps=self.own_steps()
        )  # never another run's
        if self.cfg.checkpoint.hot_copy and hot:
            self._keep_hot(step, results)
        rec = {
            "step": step,
            "bytes": sum(f["size"] for f in manifest["files"]),
            "stall_s": round(job["stall_s"], 4),
            "total_s": round(total_s, 3),
        }
        self.saves.append(rec)
        self.event(EventKind.CHECKPOINT_SAVED, **rec, uri=self.cfg.checkpoint_uri, files=len(files), deleted=deleted)

    def _discard(self, step: int) -> int | None:
        """Delete what a failed save of ``step`` uploaded (never a committed checkpoint); bytes freed."""
        try:
            return self.store.discard_failed(step)
        except Exception as e:  # the store may refuse even deletes; the next save of this step retries it
            self.event(EventKind.CHECKPOINT_CLEANUP_FAILED, step=step, error=f"{type(e).__name__}: {e}")
            return None

    def _save_failed(self, step: int, error: str, ranks: list[int], permanent: str | None, freed_local: int) -> None:
        """Record a failed save, clean up after it and apply ``checkpoint.on_save_failure``."""
        ck = self.cfg.checkpoint
        self.failed_in_row, self.failed_saves = self.failed_in_row + 1, self.failed_saves + 1
        self.event(
            EventKind.CHECKPOINT_SAVE_FAILED,
            step=step,
            ranks=ranks,
            error=error,
            failure=f"permanent: {permanent}" if permanent else "transient (retried)",
            freed_bytes=self._discard(step),
            freed_local_bytes=freed_local,
            note="no manifest written; the previous checkpoint stands",
        )
        stop = ck.on_save_failure == "stop" or self.failed_in_row >= ck.max_failed_saves
        at_risk = step - (self.durable_step or 0)
        self.event(
            EventKind.CHECKPOINT_LAGGING,
            step=step,
            durable_step=self.durable_step,
            steps_at_risk=at_risk,
            failed_in_row=self.failed_in_row,
            max_failed_saves=ck.max_failed_saves,
            action="stop the run" if stop else "keep training; the next checkpoint step tries again",
        )
        if stop:
            why = (
                f"{self.failed_in_row} checkpoint save(s) in a row failed"
                if ck.on_save_failure == "continue"
                else "a checkpoint save failed and checkpoint.on_save_failure = 'stop'"
            )
            raise RunFailed(
                f"{why} (last: step {step}: {error}). The newest durable checkpoint is "
                f"{'step ' + str(self.durable_step) if self.durable_step is not None else 'none'} "
                f"({at_risk} steps of work unsaved). Free space or raise the quota/permissions of "
                f"{self.cfg.checkpoint_uri} (see docs/checkpointing.md), then continue with --resume.",
                Failure(FailureKind.STORAGE),
            )  # a restart would hit the same store

    def _keep_hot(self, step: int, results: list[dict]) -> None:
        """Keep the newest checkpoint's files in Ray's object store, owned by the supervisor."""
        import ray

        refs = {
            f["path"]: self.workers[r["rank"]].read_file.remote(step, f["path"]) for r in results for f in r["files"]
        }
        ray.wait(list(refs.values()), num_returns=len(refs), fetch_local=False)
        self.hot, self.hot_step = refs, step  # the previous step's refs are dropped and freed

    # ---- restoring ----
    def rollback_to_before(self, first_bad_step: int) -> int:
        """Restore, in place, the newest committed checkpoint taken before ``first_bad_step``."""
        self.finish()
        step = next(
            (s for s in reversed(self.own_steps()) if s < first_bad_step and self.store.verify(s) is None), None
        )
        if step is None:
            raise RunFailed(f"rollback: no committed checkpoint before step {first_bad_step}")
        restored, self.durable_step = self._fetch_and_load(self.store, step)[0], step
        return restored

    def _fetch_and_load(self, store: CheckpointStore, step: int) -> tuple[int, list[dict]]:
        """Every rank fetches ``step`` (verifying each file; no collectives, so a corrupt file
        fails everywhere before anything is loaded), then loads it. The hot copy is used when it
        holds that step. Returns (restored step, per-rank fetch info)."""
        hot = self.hot if step == self.hot_step and store is self.store else None
        infos = self.wait([w.fetch.remote(store.uri, step, hot) for w in self.workers], f"fetch of checkpoint {step}")
        restored = self.wait([w.load.remote(store.uri, step) for w in self.workers], f"load of checkpoint {step}")[0]
        return restored, infos

    def candidates(self, resume: bool | str) -> Iterator[int]:
        """The checkpoints a restore may load, newest first, each verified (sizes) only when the newer
        ones failed: a restart reads one manifest and its files' sizes, not every checkpoint's."""
        if isinstance(resume, str):
            root, step = parse_resume_from(resume)
            if root.rstrip("/") != self.cfg.checkpoint_uri.rstrip("/"):
                self.load_store = CheckpointStore.for_config(self.cfg, root)
            reason = self.load_store.verify(step)
            if reason:
                raise RunFailed(f"cannot resume from {resume}: {reason}")
            yield step
            return
        for step in reversed(self.store.steps()):
            owner = self._owners([step])[step]
            reason = (
                self.store.verify(step)
                if owner in (None, self.run_id)
                else f"written by run {owner}, not by this run ({self.run_id}); name it with --resume-from to use it"
            )
            if reason is None:
                yield step
            else:
                self.event(EventKind.CHECKPOINT_SKIPPED, step=step, reason=reason)

    def restore(self, resume: bool | str, fresh_ok: bool = False) -> int:
        """Fetch (verifying every file) the newest usable checkpoint on every rank, then load it; with
        ``fresh_ok`` (a restart) and no checkpoint of this run, 0: the fresh workers start over."""
        tried = False
        for step in self.candidates(resume):
            tried = True
            try:
                restored, infos = self._fetch_and_load(self.load_store, step)
            except RunFailed as e:
                if e.failure is not None and isinstance(e.failure.cause, CorruptCheckpoint):
                    self.event(
                        EventKind.CHECKPOINT_CORRUPT,
                        step=step,
                        error=str(e),
                        action="falling back to the previous checkpoint",
                    )
                    continue
                raise
            if self.load_store is self.store:
                self.durable_step = step
            manifest = self.load_store.read_manifest(step) or {}
            self.event(
                EventKind.RESUMED,
                step=restored,
                uri=self.load_store.uri,
                from_layout=manifest.get("layout"),
                source=sorted({i["source"] for i in infos}),
                fetch_s=round(max(i["seconds"] for i in infos), 3),
            )
            if manifest.get("config_hash") and manifest["config_hash"] != config_hash(self.cfg):
                self.event(
                    EventKind.RESUME_CONFIG_CHANGED,
                    step=step,
                    saved_hash=manifest["config_hash"],
                    hash=config_hash(self.cfg),
                    note="the configuration differs from the one that wrote the checkpoint",
                )
            return restored
        if not tried:
            if fresh_ok:
                return 0
            raise RunFailed(
                f"--resume: no committed checkpoint of run {self.run_id} under "
                f"{self.cfg.checkpoint_uri}; start without --resume (or --resume-from URI/step_N)."
            )
        raise RunFailed(
            f"every checkpoint under {self.load_store.uri} failed verification; see the "
            f"checkpoint_corrupt events. Start without --resume or restore the files."
        )
