"""``Supervisor``: the actor that owns a run, and conducts the parts that do the work.

``run`` claims the checkpoint store, starts the ``Fleet``'s workers (placement group,
workers, spares, quarantine) while it prepares the data, then drives training in chunks that end at checkpoint boundaries; the
``CheckpointCoordinator`` saves and restores, ``Timeouts`` calibrates the hang and
process-group timeouts, ``RunStats`` keeps the counters and builds the summary, and
``Watch`` turns a dead, raising or hung rank into a typed ``Failure``. A failure is
classified (``raysc.fleet.actions``) and the ``Healer`` restarts the fleet, rolls back,
repairs replicas, or ends the run (docs/resilience.md).

The actor runs threaded (``max_concurrency``) so that rank 0's metric reports, the driver's
polls and its stop / checkpoint requests are served while ``run`` waits on the workers; the reports
in a group of one thread (``reports``), so that rank 0's batches stay in step order.
``request_stop`` (the driver's SIGINT / SIGTERM) ends a chunk early at a step every rank
agrees on (``raysc.fleet.stopping``), saves that step (``train.save_on_stop``), waits for the
save in flight and returns a summary with ``stopped``; ``request_checkpoint`` saves at the
next step boundary and keeps training.
"""

from __future__ import annotations

import threading
import time
import traceback
from pathlib import Path

import ray

from raysc.checkpoint.storage import step_name
from raysc.config.load import config_from_dict, config_hash, dump_config
from raysc.data.prepare import prepare_data
from raysc.data.special_tokens import SpecialTokens, copy_tokenizer, write_special_tokens
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.elastic import Elastic
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.fleet import Fleet
from raysc.fleet.healing import Healer
from raysc.fleet.records import RunRecords
from raysc.fleet.stats import RunStats
from raysc.fleet.timeouts import Timeouts
from raysc.fleet.watch import Watch, typed_failure
from raysc.model.flops import param_count
from raysc.track.run_tracker import RunTracker, read_track_ids


@ray.remote(num_cpus=0, max_concurrency=8, concurrency_groups={"reports": 1})
class Supervisor:
    def __init__(
        self, cfg_dict: dict, resume: bool | str = False, probe_bytes: int = 0, overwrite: bool = False
    ) -> None:
        self.cfg = cfg = config_from_dict(cfg_dict, "driver")
        self.resume = resume
        self.overwrite = overwrite  # a fresh run may replace another run's checkpoints (--overwrite)
        self.probe_bytes = probe_bytes  # > 0: after training, the pre-flight probe (raysc preflight)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = RunRecords(self.run_dir, cfg.run.name)
        self._lock = threading.Lock()
        self._phase = "starting"
        self._events: list[dict] = []
        self._fired: set[str] = set()  # specs of injected faults that fired (a restart skips them)
        self._stop: str | None = None  # why the driver asked the run to stop (SIGINT, SIGTERM)
        self._ckpt_asked: str | None = None  # who asked for a checkpoint now (raysc ckpt now, SIGUSR1)
        self.stats = RunStats(cfg.train.steps)
        # parallel.elastic: pins the micro-batch before any worker's config is made; the size lives in cfg
        self.elastic = Elastic(cfg) if cfg.parallel.elastic else None
        self.fleet = Fleet(cfg, self.run_dir, self._event, ray.get_runtime_context().current_actor)
        self.watch = Watch(self._event, self.stats.silent_s, self.fleet.node, cfg.supervisor.hang_timeout_s)
        self.timeouts = Timeouts(cfg.supervisor, self._event, self.watch.wait)
        self.ckpt: CheckpointCoordinator | None = None
        self._last: dict | None = None  # rank 0's newest chunk result (its last step's metrics)
        self._trained_on: list | None = None  # the workers of the last chunk (a new fleet warms up first)
        self._warmup_step: int | None = None  # the step a new fleet is warming up on
        self.tracker: RunTracker | None = None  # the [track] trackers, once the run has its id
        self._final_phase = "evaluating"  # the phase after training that is running (or failed)

    # ---- called by workers and the driver while run() is busy ----
    @ray.method(concurrency_group="reports")
    def report(self, batch: list[dict]) -> None:
        """Per-step metrics from rank 0, a batch at a time (see ``TrainWorker.train``), in the order sent:
        on the shared threads two batches ran side by side, out of step order (TensorBoard showed 6, 7, 5)."""
        self.stats.ingest(batch)
        self.records.metrics_batch(batch)
        health = self.stats.health()
        durable = self.ckpt.durable_step if self.ckpt is not None else None
        health["checkpoint_lag_steps"] = batch[-1]["step"] - (durable or 0)
        self.records.health(health)
        if self.tracker is not None:
            self.tracker.metrics(batch, health)
        for m in batch:
            if m.get("skipped"):
                self._event(EventKind.UPDATE_SKIPPED, step=m["step"], action="skip", **m["skipped"])
            if m.get("domain_epochs"):
                self._event(
                    EventKind.DATA_EPOCH,
                    step=m["step"],
                    epochs=m["domain_epochs"],
                    note="a domain ran out of sequences and started a new seeded permutation",
                )
            normal = self.timeouts.is_slow(m["step_time"])
            if normal and m["step"] != self._warmup_step:  # a new fleet's first step is no straggler
                self._event(
                    EventKind.SLOW_STEP,
                    step=m["step"],
                    step_time_s=round(m["step_time"], 3),
                    normal_s=round(normal, 4),
                    action="none (within the hang timeout)",
                    note="a straggler: every rank waits for the slowest in each collective",
                )

    def fault_fired(self, spec: str, rank: int, step: int) -> None:
        """An injected fault is about to fire on ``rank`` before ``step`` (recorded so a restart
        skips it)."""
        with self._lock:
            self._fired.add(spec)
        self.stats.fault_fired(step)
        self._event(EventKind.FAULT_INJECTED, fault=spec, rank=rank)

    def _fired_faults(self) -> set[str]:
        with self._lock:
            return set(self._fired)

    def progress(self, events_seen: int = 0) -> dict:
        """Phase, newest step metrics, and the events after the first ``events_seen``."""
        with self._lock:
            return {
                "phase": self._phase,
                "last": self.stats.last,
                "total_steps": self.cfg.train.steps,
                "events": self._events[events_seen:],
            }

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary all ranks agree on, save that step, shut down (``run``
        returns a summary with ``stopped``)."""
        with self._lock:
            first, self._stop = self._stop is None, self._stop or reason
            workers = list(self.fleet.workers)
        if first:
            self._event(EventKind.STOP_REQUESTED, reason=reason, note="stopping at the next step boundary")
            for w in workers:
                w.request.remote("stop")

    def request_checkpoint(self, source: str) -> None:
        """Save a checkpoint at the next step boundary and keep training (a preemption notice)."""
        with self._lock:
            self._ckpt_asked = source
            workers = list(self.fleet.workers)
        self._event(EventKind.CHECKPOINT_REQUESTED, source=source)
        for w in workers:
            w.request.remote("checkpoint")

    def _checkpoint_asked(self) -> bool:
        """Whether a checkpoint was asked for since the last one (and forget the request)."""
        with self._lock:
            asked, self._ckpt_asked = self._ckpt_asked is not None, None
        return asked

    def _event(self, kind: EventKind, **fields) -> dict:
        rec = self.records.event(kind, **fields)
        with self._lock:
            self._events.append(rec)  # the driver prints them, in order with its own output
        if self.tracker is not None:
            self.tracker.event(rec)
        return rec

    def _set_phase(self, phase: str) -> None:
        self._phase = phase

    # ---- the run ----
    def run(self) -> dict:
        self.stats.t_start = time.time()
        self._event(
            EventKind.RUN_START,
            run_dir=str(self.run_dir),
            config_hash=config_hash(self.cfg),
            params=param_count(self.cfg.model)["total"],
            resume=bool(self.resume),
        )
        status = "FAILED"
        try:
            summary = self._run()
            status = "KILLED" if self._stop else "FINISHED"
            return summary
        except (RunFailed, ray.exceptions.RayError) as e:
            err = typed_failure(e, self._event)
            if self.ckpt is not None:
                self.ckpt.salvage()
            self._event(EventKind.RUN_FAILED, error=str(err))
            raise err from None
        except Exception as e:  # a defect of raysc's own: recorded with where it happened, saves kept
            if self.ckpt is not None:
                self.ckpt.salvage()
            self._event(
                EventKind.RUN_FAILED, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=-8)
            )
            raise
        finally:
            self._phase = "stopped"
            self.fleet.release(clean=status != "FAILED")
            if self.elastic:
                self.elastic.cancel()
            if self.tracker is not None:
                self.tracker.close(status)
            self.records.close()

    def _run(self) -> dict:
        total = self.cfg.train.steps
        data = self._prepare()
        start_step = step = self._start(data)
        healer = Healer(
            self.cfg,
            self.fleet,
            self.ckpt,
            self.stats,
            self.timeouts,
            self._event,
            self.watch.wait,
            self.stats.touch,
            self._fired_faults,
            self.elastic,
        )
        self._phase = "training"
        t_train = time.perf_counter()
        repaired = False  # replicas repaired in place at ``step``: it may still be due its checkpoint
        while True:
            while (step < total or repaired) and not self._stop:
                try:
                    if not repaired:
                        step = self._train_chunk(step)
                    repaired = False
                    step = self._checkpoint_if_due(step)
                    if healer.grow_due(step):
                        self._phase = "growing"
                        step = healer.grow(step, data)
                except (RunFailed, ray.exceptions.RayError) as e:
                    step = self._heal(healer, typed_failure(e, self._event), data)
                    repaired = healer.repaired_in_place
                self._phase = "training"
            if self._stop:
                return self._stopped(step, start_step)
            train_time = time.perf_counter() - t_train
            try:
                return self._finish(start_step, train_time, self._evaluate())
            except (RunFailed, ray.exceptions.RayError) as e:
                # a fault in the final phase is healed like any other: the fleet restored from the final
                # checkpoint (or training redone up to it, when that save failed) and the phase run again
                err = typed_failure(e, self._event)
                try:
                    step = self._heal(healer, err, data)
                except (RunFailed, ray.exceptions.RayError) as gave_up:
                    if self.ckpt.latest() != total:
                        raise
                    # training and its final checkpoint are complete: a success without the validation
                    self._event(
                        EventKind.VALIDATION_MISSING,
                        phase=self._final_phase,
                        error=str(gave_up),
                        checkpoint=self._checkpoint_uri(total),
                        note="the run's training and final checkpoint are complete; the final "
                        "validation could not be run (see the failure above)",
                    )
                    return self._finish(start_step, train_time, (None, None))
                repaired = healer.repaired_in_place
                self._phase = "training"

    def _heal(self, healer: Healer, err: RunFailed, data: dict) -> int:
        """Heal ``err``; a worker failure while healing (a replacement that dies in set-up, a rank
        lost during the restore) is healed in turn, each attempt a strike bounded by
        supervisor.max_restarts. An error with no worker failure behind it (no room to place the
        fleet, no checkpoint to roll back to) ends the run."""
        while True:
            try:
                return healer.heal(err, data, self._set_phase)
            except (RunFailed, ray.exceptions.RayError) as e:
                again = typed_failure(e, self._event)
                if again is err or again.failure is None:
                    raise again from None
                err = again

    def _prepare(self) -> dict:
        """Open the checkpoint store, claim it for this run, reserve and spawn the workers, pack the data;
        the data's object refs."""
        self.ckpt = CheckpointCoordinator(self.cfg, self._event, self.watch.wait)
        self.watch.poll = self.ckpt.poll
        self.ckpt.probe()
        # before anything in the run directory is written: a refused run leaves the other run's files alone
        self.ckpt.claim(self.resume, self.overwrite, self.run_dir)
        (self.run_dir / "config.toml").write_text(dump_config(self.cfg))
        # the workers' processes start (Python, Ray, torch: seconds) while the checkpoint to init from is
        # read and the data is packed; they are set up with the final config in ``_start``
        self._phase = "starting workers"
        self._start_size()
        self.fleet.reserve()
        if self.elastic:
            self.elastic.request_growth()
        self.fleet.spawn()
        self._track()
        if self.cfg.model.init_from:
            self._init_from()
        self._phase = "preparing data"
        packed, tok_path, data_info = prepare_data(self.cfg)
        # the tokenizer as it came (with the files beside it that name its special tokens) and the special
        # tokens this run packed with: exports, generation and serving read them from the run directory
        copy_tokenizer(tok_path, self.run_dir)
        write_special_tokens(self.run_dir, SpecialTokens.from_dict(data_info["special_tokens"]))
        self._event(
            EventKind.DATA_READY,
            **{
                k: data_info[k]
                for k in (
                    "tokens",
                    "documents",
                    "train_sequences",
                    "val_sequences",
                    "corpus_sha256",
                    "domains",
                    "schedule",
                )
                if k in data_info
            },
        )
        # the EOS id: with train.document_mask the ranks find document boundaries by it
        return {
            "train": ray.put(packed.train),
            "val": ray.put(packed.val),
            "eos_id": int(data_info["special_tokens"]["eos_id"]),
        }

    def _start_size(self) -> None:
        """An elastic run starts with the largest allowed size the alive nodes hold (the configured
        one when none does yet: the fleet waits for nodes as a fixed one does)."""
        el = self.elastic
        size = el.largest_fitting() if el else None
        if size is not None and size < el.size:
            full = el.size
            el.resize(size)
            self._event(
                EventKind.RESIZED,
                dim=el.dim,
                **{"from": full, "to": size},
                world_size=el.world(size),
                why=f"the cluster holds {el.world(size)} of the configured {el.world(full)} workers at the start",
                seconds=0.0,
                steps_lost=0,
                note="grows at a checkpoint boundary once its growth request is placed",
            )

    def _track(self) -> None:
        """Open the [track] trackers: a resumed run continues the tracker runs recorded in the run
        directory (or, resumed into a new one, in the checkpoint's manifest); a fresh run starts new."""
        if not (self.cfg.track.tensorboard or self.cfg.track.mlflow_uri or self.cfg.track.wandb_project):
            return
        ids = (read_track_ids(self.run_dir) or self.ckpt.tracker_ids(self.resume)) if self.resume else {}
        self.tracker = RunTracker(self.cfg, self.run_dir, self._event, ids)
        self.ckpt.trackers = self.tracker.ids
        self.tracker.start(self.ckpt.run_id, config_hash(self.cfg))

    def _init_from(self) -> None:
        """Check ``model.init_from`` against the config before any worker starts, take its tokenizer when
        ``data.tokenizer`` is empty, and record the checkpoint's content hash (workers read it themselves)."""
        from raysc.model.hf_checkpoint import check_init_from, content_sha256  # (torch: only when used)
        from raysc.model.hf_fetch import init_dir

        m = self.cfg.model
        local = init_dir(m.init_from, m.init_from_options, self.cfg.data.cache_dir)
        info = check_init_from(local, m)
        took = bool(info["tokenizer"]) and not self.cfg.data.tokenizer
        if took:
            self.cfg.data.tokenizer = info["tokenizer"]
        self._event(
            EventKind.INIT_FROM,
            source=m.init_from,
            sha256=content_sha256(local),
            tensors=info["tensors"],
            bytes=info["bytes"],
            tokenizer=info["tokenizer"] if took else None,
            note="weights from the checkpoint, optimizer and schedule fresh",
        )

    def _start(self, data: dict) -> int:
        """Set up the fleet ``_prepare`` spawned; the step it starts from (a resumed checkpoint's, else 0)."""
        self._phase = "starting workers"
        self.fleet.start(data, self.watch.wait, self.stats.touch)
        self.ckpt.workers = self.fleet.workers
        return self.ckpt.restore(self.resume) if self.resume else 0

    def _train_chunk(self, step: int) -> int:
        """Train up to the next checkpoint boundary (shorter while timeouts are uncalibrated, or
        when a stop or checkpoint request ends it early); returns the step every rank reached.

        A new fleet's first step warms up (allocator, the process group's first connections), as
        the run's first step does, which calibration leaves out: after a restart that step runs as a
        chunk of its own under ``supervisor.hang_timeout_s`` and the process groups' start-up timeout,
        not the calibrated ones (set after it), which a restart on a loaded machine would otherwise
        trip (a false hang or collective timeout, and another restart)."""
        every = self.cfg.checkpoint.every_steps or self.cfg.train.steps
        target = min(self.cfg.train.steps, (step // every + 1) * every)
        workers = self.fleet.workers
        calibrating, fresh = self.timeouts.pending, workers is not self._trained_on
        if calibrating:
            target = min(target, step + 1 + self.cfg.supervisor.calibrate_steps)
        elif fresh:
            target = min(target, step + 1)
        if fresh:  # kept after the chunk: rank 0's report of the step may arrive after it returns
            self._warmup_step = step + 1
        self.stats.touch()
        results = self.watch.wait(
            [w.train.remote(target) for w in workers],
            f"steps {step + 1}..{target}",
            hang_s=None if fresh else self.timeouts.hang_s,
        )
        if fresh and not calibrating:
            self.timeouts.apply(workers)
        self._trained_on = workers
        self._last = results[0] or self._last
        if results[0] and "memory" in results[0]:
            self.stats.memory = [r["memory"] for r in results]
        self.stats.strikes = 0  # training made progress
        self.fleet.ensure_spares()  # after a chunk, so their start-up does not compete with a restore
        first, step = step + 2, results[0]["step"] if results[0] else step
        if calibrating:
            self.timeouts.calibrate(self.stats, first, step, workers)
        return step

    def _checkpoint_if_due(self, step: int) -> int:
        """Save at a checkpoint boundary, the last step, or when a checkpoint was asked for (a stop
        saves after the loop instead)."""
        every = self.cfg.checkpoint.every_steps or self.cfg.train.steps
        if step % every and step < self.cfg.train.steps and not self._checkpoint_asked():
            return step
        self._phase = "checkpointing"
        self.ckpt.save(step, self._tokens())
        if step == self.cfg.train.steps:
            self.ckpt.finish()
        return step

    def _tokens(self) -> int:
        return self._last["tokens"] if self._last else 0

    def _checkpoint_uri(self, step: int | None) -> str | None:
        return f"{self.cfg.checkpoint_uri}/{step_name(step)}" if step is not None else None

    def _evaluate(self) -> tuple[float | None, list | None]:
        """The final validation loss and (``raysc preflight``) the pre-flight probe's measurements. Every
        rank takes part in their collectives: a worker failure here raises as in training."""
        workers = self.fleet.workers
        self._phase = self._final_phase = "evaluating"
        val = self.watch.wait([w.val_loss.remote() for w in workers], "validation")[0]
        probe = None
        if self.probe_bytes:
            self._phase = self._final_phase = "probing"
            probe = self.watch.wait([w.probe.remote(self.probe_bytes) for w in workers], "pre-flight probe")
        return val, probe

    def _finish(self, start_step: int, train_time: float, evaluated: tuple[float | None, list | None]) -> dict:
        """The ``run_end`` summary, with the validation loss and probe of ``_evaluate`` (None: missing)."""
        cfg = self.cfg
        val, probe = evaluated
        latest = self.ckpt.latest()
        steps_run = cfg.train.steps - start_step
        summary = {
            "run_dir": str(self.run_dir),
            "steps": cfg.train.steps,
            "steps_run": steps_run,
            "val_loss": val,
            **self.stats.run_summary(
                self._last,
                steps_run=steps_run,
                params=param_count(cfg.model)["total"],
                train_time=train_time,
                tokens_per_step=cfg.train.global_batch_sequences * cfg.train.seq_len,
            ),
            "checkpoint": self._checkpoint_uri(latest),
            "checkpoint_stall_s": round(sum(x["stall_s"] for x in self.ckpt.saves), 4),
            # steps of work the newest durable checkpoint lacks (> 0 only when saves failed): non-zero exit
            "checkpoint_lag_steps": cfg.train.steps - (latest if latest is not None else 0),
            "failed_saves": self.ckpt.failed_saves,
            "quarantined_nodes": self.fleet.quarantined_nodes(),
        }
        self._event(EventKind.RUN_END, **summary)
        if probe is not None:
            summary["probe"] = probe
        return summary

    def _stopped(self, step: int, start_step: int) -> dict:
        """After a stop request: save ``step`` unless it is committed (or nothing was trained), wait
        for the save in flight to commit; the fleet is shut down by ``run``."""
        self._phase = "stopping"
        t0 = time.monotonic()
        if self.cfg.train.save_on_stop and step > start_step:
            self.ckpt.save(step, self._tokens())  # waits for a save in flight first
        self.ckpt.finish()
        latest = self.ckpt.latest()
        summary = {
            "run_dir": str(self.run_dir),
            "stopped": self._stop,
            "step": step,
            "steps": self.cfg.train.steps,
            "step_in_flight": "finished",
            "checkpoint_step": latest,
            "checkpoint": self._checkpoint_uri(latest),
            "stop_s": round(time.monotonic() - t0, 3),
            "wall_s": round(time.time() - self.stats.t_start, 2),
        }
        self._event(EventKind.RUN_STOPPED, reason=self._stop, **{k: v for k, v in summary.items() if k != "stopped"})
        return summary
