"""``Supervisor``: the actor that owns a run, and conducts the parts that do the work.

``run`` has ``RunPreparation`` claim the checkpoint store, start the ``Fleet``'s workers (placement
group, workers, spares, quarantine) while it prepares the data, then drives training in chunks that
end at checkpoint boundaries; the ``CheckpointCoordinator`` saves and restores, ``Timeouts``
calibrates the hang and process-group timeouts, ``RunStats`` keeps the counters and builds the
summary, ``Bookkeeping`` keeps the phase, the events and the driver's requests, and ``Watch`` turns
a dead, raising or hung rank into a typed ``Failure``. A failure is classified
(``raysc.fleet.actions``) and the ``Healer`` restarts the fleet, rolls back, repairs replicas, or
ends the run (docs/resilience.md).

The actor runs threaded (``max_concurrency``) so that rank 0's metric reports, the driver's
polls and its stop / checkpoint requests are served while ``run`` waits on the workers; the reports
in a group of one thread (``reports``), so that rank 0's batches stay in step order.
``request_stop`` (the driver's SIGINT / SIGTERM) ends a chunk early at a step every rank
agrees on (``raysc.fleet.stopping``), saves that step (``train.save_on_stop``), waits for the
save in flight and returns a summary with ``stopped``; ``request_checkpoint`` saves at the
next step boundary and keeps training.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import ray

from raysc.checkpoint.storage import step_name
from raysc.config.load import config_from_dict, config_hash
from raysc.fleet.bookkeeping import Bookkeeping
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.elastic import Elastic
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.fleet import Fleet
from raysc.fleet.healing import Healer
from raysc.fleet.preparing import RunPreparation
from raysc.fleet.records import RunRecords
from raysc.fleet.router_watch import RouterWatch
from raysc.fleet.stats import RunStats
from raysc.fleet.timeouts import Timeouts
from raysc.fleet.watch import Watch, typed_failure
from raysc.model.flops import param_count


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
        self.stats = RunStats(cfg.train.steps)
        # phase, events, fired faults, stop / checkpoint requests: shared with the remote methods' threads
        self.book = Bookkeeping(self.records, self.stats)
        # parallel.elastic: pins the micro-batch before any worker's config is made; the size lives in cfg
        self.elastic = Elastic(cfg) if cfg.parallel.elastic else None
        self.fleet = Fleet(cfg, self.run_dir, self.book.event, ray.get_runtime_context().current_actor)
        self.watch = Watch(self.book.event, self.stats.silent_s, self.fleet.node, cfg.supervisor.hang_timeout_s)
        self.timeouts = Timeouts(cfg.supervisor, self.book.event, self.watch.wait)
        self.preparation = RunPreparation(
            cfg, self.run_dir, resume, overwrite, self.book, self.fleet, self.elastic, self.watch
        )
        self.ckpt: CheckpointCoordinator | None = None
        self._last: dict | None = None  # rank 0's newest chunk result (its last step's metrics)
        self._trained_on: list | None = None  # the workers of the last chunk (a new fleet warms up first)
        self._warmup_step: int | None = None  # the step a new fleet is warming up on
        self._final_phase = "evaluating"  # the phase after training that is running (or failed)
        sup = cfg.supervisor
        self.router_watch = RouterWatch(sup.router_window, sup.router_collapse_load, cfg.model.moe_top_k)

    # ---- called by workers and the driver while run() is busy ----
    @ray.method(concurrency_group="reports")
    def report(self, batch: list[dict]) -> None:
        """Per-step metrics from rank 0, a batch at a time (see ``TrainWorker.train``), in the order sent:
        on the shared threads two batches ran side by side, out of step order (TensorBoard showed 6, 7, 5)."""
        batch = self.stats.unrecovered(batch)
        if not batch:
            return
        self.stats.ingest(batch)
        self.records.metrics_batch(batch)
        health = self.stats.health()
        durable = self.ckpt.durable_step if self.ckpt is not None else None
        health["checkpoint_lag_steps"] = batch[-1]["step"] - (durable or 0)
        self.records.health(health)
        if self.book.tracker is not None:
            self.book.tracker.metrics(batch, health)
        for m in batch:
            if m.get("skipped"):
                self.book.event(EventKind.UPDATE_SKIPPED, step=m["step"], action="skip", **m["skipped"])
            if m.get("domain_epochs"):
                self.book.event(
                    EventKind.DATA_EPOCH,
                    step=m["step"],
                    epochs=m["domain_epochs"],
                    note="a domain ran out of sequences and started a new seeded permutation",
                )
            if m.get("moe_tokens"):
                self._check_routing(m["step"], m["moe_tokens"])
            normal = self.timeouts.is_slow(m["step_time"])
            if normal and m["step"] != self._warmup_step:  # a new fleet's first step is no straggler
                self.book.event(
                    EventKind.SLOW_STEP,
                    step=m["step"],
                    step_time_s=round(m["step_time"], 3),
                    normal_s=round(normal, 4),
                    action="none (within the hang timeout)",
                    note="a straggler: every rank waits for the slowest in each collective",
                )

    def _check_routing(self, step: int, tokens: dict[str, list[int]]) -> None:
        """A mixture of experts' step: a router collapse is an event, and a stop when the config says so."""
        action = self.cfg.supervisor.router_collapse
        for found in self.router_watch.observe(step, tokens):
            self.book.event(EventKind.ROUTER_COLLAPSE, action=action, **found)
            if action == "stop":
                self.book.request_stop(f"router collapse in layer {found['layer']}", self.fleet)

    def fault_fired(self, spec: str, rank: int, step: int) -> None:
        """An injected fault is about to fire on ``rank`` before ``step`` (recorded so a restart
        skips it)."""
        self.book.fault_fired(spec, rank, step)

    def progress(self, events_seen: int = 0) -> dict:
        """Phase, newest step metrics, and the events after the first ``events_seen``."""
        return self.book.progress(events_seen)

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary all ranks agree on, save that step, shut down (``run``
        returns a summary with ``stopped``)."""
        self.book.request_stop(reason, self.fleet)

    def request_checkpoint(self, source: str) -> None:
        """Save a checkpoint at the next step boundary and keep training (a preemption notice)."""
        self.book.request_checkpoint(source, self.fleet)

    # ---- the run ----
    def run(self) -> dict:
        self.stats.t_start = time.time()
        self.book.event(
            EventKind.RUN_START,
            run_dir=str(self.run_dir),
            config_hash=config_hash(self.cfg),
            params=param_count(self.cfg.model)["total"],
            resume=bool(self.resume),
        )
        status = "FAILED"
        try:
            summary = self._run()
            status = "KILLED" if self.book.stop else "FINISHED"
            return summary
        except (RunFailed, ray.exceptions.RayError) as e:
            err = typed_failure(e, self.book.event)
            if self.ckpt is not None:
                self.ckpt.salvage()
            self.book.event(EventKind.RUN_FAILED, error=str(err))
            raise err from None
        except Exception as e:  # a defect of raysc's own: recorded with where it happened, saves kept
            if self.ckpt is not None:
                self.ckpt.salvage()
            self.book.event(
                EventKind.RUN_FAILED, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=-8)
            )
            raise
        finally:
            self.book.phase = "stopped"
            self.fleet.release(clean=status != "FAILED")
            if self.elastic:
                self.elastic.cancel()
            if self.book.tracker is not None:
                self.book.tracker.close(status)
            self.records.close()

    def _run(self) -> dict:
        total = self.cfg.train.steps
        self.ckpt = self.preparation.open_store()  # held at once: a failure from here on salvages its saves
        data = self.preparation.prepare()
        start_step = step = self.preparation.start(data, self.stats.touch)
        healer = Healer(
            self.cfg,
            self.fleet,
            self.ckpt,
            self.stats,
            self.timeouts,
            self.book.event,
            self.watch.wait,
            self.stats.touch,
            self.book.fired_faults,
            self.report,  # (a plain call inside this actor: metrics a lost rank 0 had not sent)
            self.elastic,
        )
        self.book.phase = "training"
        t_train = time.perf_counter()
        repaired = False  # replicas repaired in place at ``step``: it may still be due its checkpoint
        while True:
            while (step < total or repaired) and not self.book.stop:
                try:
                    if not repaired:
                        step = self._train_chunk(step)
                    repaired = False
                    step = self._checkpoint_if_due(step)
                    if healer.grow_due(step):
                        self.book.phase = "growing"
                        step = healer.grow(step, data)
                except (RunFailed, ray.exceptions.RayError) as e:
                    step = self._heal(healer, typed_failure(e, self.book.event), data)
                    repaired = healer.repaired_in_place
                self.book.phase = "training"
            if self.book.stop:
                return self._stopped(step, start_step)
            train_time = time.perf_counter() - t_train
            try:
                return self._finish(start_step, train_time, self._evaluate())
            except (RunFailed, ray.exceptions.RayError) as e:
                # a fault in the final phase is healed like any other: the fleet restored from the final
                # checkpoint (or training redone up to it, when that save failed) and the phase run again
                err = typed_failure(e, self.book.event)
                try:
                    step = self._heal(healer, err, data)
                except (RunFailed, ray.exceptions.RayError) as gave_up:
                    if self.ckpt.latest() != total:
                        raise
                    # training and its final checkpoint are complete: a success without the validation
                    self.book.event(
                        EventKind.VALIDATION_MISSING,
                        phase=self._final_phase,
                        error=str(gave_up),
                        checkpoint=self._checkpoint_uri(total),
                        note="the run's training and final checkpoint are complete; the final "
                        "validation could not be run (see the failure above)",
                    )
                    return self._finish(start_step, train_time, (None, None))
                repaired = healer.repaired_in_place
                self.book.phase = "training"

    def _heal(self, healer: Healer, err: RunFailed, data: dict) -> int:
        """Heal ``err``; a worker failure while healing (a replacement that dies in set-up, a rank
        lost during the restore) is healed in turn, each attempt a strike bounded by
        supervisor.max_restarts. An error with no worker failure behind it (no room to place the
        fleet, no checkpoint to roll back to) ends the run."""
        while True:
            try:
                return healer.heal(err, data, self.book.set_phase)
            except (RunFailed, ray.exceptions.RayError) as e:
                again = typed_failure(e, self.book.event)
                if again is err or again.failure is None:
                    raise again from None
                err = again

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
            self.router_watch.rewind(step)  # the steps after ``step`` run again
        self.stats.touch()
        self.fleet.train_calls = [w.train.remote(target) for w in workers]
        results = self.watch.wait(
            self.fleet.train_calls, f"steps {step + 1}..{target}", hang_s=None if fresh else self.timeouts.hang_s
        )
        self.fleet.train_calls = None
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
        if step % every and step < self.cfg.train.steps and not self.book.checkpoint_asked():
            return step
        self.book.phase = "checkpointing"
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
        self.book.phase = self._final_phase = "evaluating"
        val = self.watch.wait([w.val_loss.remote() for w in workers], "validation")[0]
        probe = None
        if self.probe_bytes:
            self.book.phase = self._final_phase = "probing"
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
        self.book.event(EventKind.RUN_END, **summary)
        if probe is not None:
            summary["probe"] = probe
        return summary

    def _stopped(self, step: int, start_step: int) -> dict:
        """After a stop request: save ``step`` unless it is committed (or nothing was trained), wait
        for the save in flight to commit; the fleet is shut down by ``run``."""
        self.book.phase = "stopping"
        t0 = time.monotonic()
        if self.cfg.train.save_on_stop and step > start_step:
            self.ckpt.save(step, self._tokens())  # waits for a save in flight first
        self.ckpt.finish()
        latest = self.ckpt.latest()
        summary = {
            "run_dir": str(self.run_dir),
            "stopped": self.book.stop,
            "step": step,
            "steps": self.cfg.train.steps,
            "step_in_flight": "finished",
            "checkpoint_step": latest,
            "checkpoint": self._checkpoint_uri(latest),
            "stop_s": round(time.monotonic() - t0, 3),
            "wall_s": round(time.time() - self.stats.t_start, 2),
        }
        self.book.event(
            EventKind.RUN_STOPPED, reason=self.book.stop, **{k: v for k, v in summary.items() if k != "stopped"}
        )
        return summary
