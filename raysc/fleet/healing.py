"""``Healer``: carries out what ``classify`` decided about a failure, and bounds how often.

- peer heal (``supervisor.peer_heal``): replace only the lost rank, its state copied from a surviving
  replica, no rollback (``raysc.fleet.peer_healing``); where it does not apply, a restart:
- restart: replace the whole fleet (warm spares when ready, away from quarantined nodes),
  restore the newest checkpoint of this run, skip the injected faults that already fired;
- rollback: restore, in place, the checkpoint before a loss spike and skip data (PaLM-style);
- repair: restore replicas that disagree from the healthy majority and quarantine their
  nodes, or roll every replica back when there is no majority;
- resize (``parallel.elastic``): a restart after a node loss that finds no room for the fleet
  within ``supervisor.node_wait_s`` continues at the largest data-parallel size that fits
  (``raysc.fleet.elastic``); ``grow`` brings the run back to its configured size at a committed
  checkpoint once the growth request is placed.

Each restart or rollback is a strike; more than ``supervisor.max_restarts`` strikes without a
chunk of training in between stop the run. Repeated restarts back off exponentially.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from raysc.config.faults import consume_faults
from raysc.config.schema import Config
from raysc.fleet.actions import Action, classify
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.elastic import Elastic
from raysc.fleet.errors import FailureKind, RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.fleet import Fleet
from raysc.fleet.nodes import raylet_answers
from raysc.fleet.peer_healing import PeerHealer, PeerHealRefused
from raysc.fleet.stats import RunStats
from raysc.fleet.timeouts import Timeouts
from raysc.train.signals import SilentCorruption
from raysc.train.stability import SpikeRollback

NODE_DEATH_WAIT_S = 3.0
PHASES = {Action.RESTART: "recovering", Action.ROLLBACK: "rolling back", Action.REPAIR: "repairing replicas"}


class Healer:
    def __init__(
        self,
        cfg: Config,
        fleet: Fleet,
        ckpt: CheckpointCoordinator,
        stats: RunStats,
        timeouts: Timeouts,
        event: Callable[..., dict],
        wait: Callable[..., list],
        touch: Callable[[], None],
        fired: Callable[[], set[str]],
        report: Callable[[list[dict]], None],
        elastic: Elastic | None = None,
    ) -> None:
        """``report``: the supervisor's, for the metrics a lost rank 0 had not sent (a peer heal)."""
        self.cfg, self.fleet, self.ckpt, self.stats, self.timeouts = cfg, fleet, ckpt, stats, timeouts
        self.event, self.wait, self.touch, self.fired = event, wait, touch, fired
        self.elastic = elastic
        # supervisor.peer_heal: a lost rank healed from a replica, before any restart
        self.peer = (
            PeerHealer(cfg, fleet, ckpt, stats, event, wait, report, fired) if cfg.supervisor.peer_heal else None
        )
        self._peer_resumed_at = -1  # the step the last peer heal resumed from
        self.repaired_in_place = False  # the last heal restored replicas without leaving their step

    def heal(self, err: RunFailed, data: dict, set_phase: Callable[[str], None]) -> int:
        """Act on ``err`` (or re-raise it when it is fatal); returns the step training goes on from."""
        action = classify(err.failure)
        self.repaired_in_place = False
        if action is Action.FATAL:
            raise err
        set_phase(PHASES[action])
        if action is Action.ROLLBACK:
            return self.rollback(err.failure.cause)
        if action is Action.REPAIR:
            return self.repair(err.failure.cause)
        if self.peer is None:
            return self.restart(err, data)
        why = self.peer.why_not(err)
        if why is None:
            if self.stats.failed_step() - 1 > self._peer_resumed_at:
                self.stats.strikes = 0  # steps were trained since the last peer heal (within a chunk): progress
            self._strike(err)
            try:
                self._peer_resumed_at = self.peer.heal(err, data, self.stats.restarts)
                return self._healed_in_place(self._peer_resumed_at)
            except (PeerHealRefused, RunFailed, ray.exceptions.RayError) as e:
                why = f"the peer heal failed: {e}"
        return self.restart(err, data, why=why, struck=why.startswith("the peer heal failed"))

    def _healed_in_place(self, step: int) -> int:
        """After a peer heal to ``step``: a checkpoint boundary whose save was lost with the rank is saved
        again before training goes on (``repaired_in_place``)."""
        every = self.cfg.checkpoint.every_steps or self.cfg.train.steps
        ckpt = self.ckpt
        self.repaired_in_place = step % every == 0 and ckpt.durable_step != step and ckpt.inflight is None
        return step

    def _strike(self, err: RunFailed) -> None:
        """Count a restart or rollback; past supervisor.max_restarts of them with no chunk of
        training completed in between, stop the run with ``err``."""
        self.stats.restarts += 1
        self.stats.recovered.clear()  # the steps after the checkpoint run (and report) again
        self.stats.strikes += 1
        if self.stats.strikes > self.cfg.supervisor.max_restarts:
            self.event(EventKind.RESTARTS_EXHAUSTED, restarts=self.stats.strikes - 1, error=str(err))
            raise err

    def restart(self, err: RunFailed, data: dict, why: str | None = None, struck: bool = False) -> int:
        """Replace the whole fleet and continue from the newest checkpoint (the hot copy makes
        the restore fast). Returns the step training resumes from. ``why``: why a peer heal did not
        do it (supervisor.peer_heal); ``struck``: this failure was counted already."""
        if not struck:
            self._strike(err)
        t0 = time.monotonic()
        failed_at = self.stats.failed_step()
        self.ckpt.salvage(timeout_s=5.0)
        peer = {"healed_by": "checkpoint", "peer_heal": why} if why else {"healed_by": "checkpoint"}
        self.fleet.train_calls = None
        self.event(EventKind.RECOVERY_START, attempt=self.stats.restarts, failed_step=failed_at, error=str(err), **peer)
        lost = self._lost_nodes(err)
        self.fleet.stop_workers()
        if self.stats.strikes > 1:  # the first restart is immediate; repeated failures back off
            time.sleep(self.cfg.supervisor.restart_backoff_s * 2 ** (self.stats.strikes - 2))
        size = self.elastic.size if self.elastic else None
        self._replace(bool(lost))
        self.cfg.supervisor.inject = consume_faults(self.cfg.supervisor.inject, self.fired())
        self.fleet.start(data, self.wait, self.touch, warm=True)
        self.ckpt.workers = self.fleet.workers  # (the calibrated timeouts reach it after its warm-up step)
        step = self.ckpt.restore(True, fresh_ok=True)
        seconds = round(time.monotonic() - t0, 3)
        self.event(
            EventKind.RECOVERED,
            attempt=self.stats.restarts,
            resumed_step=step,
            steps_lost=failed_at - 1 - step,
            seconds=seconds,
            healed_by="checkpoint",
        )
        if size is not None and self.elastic.size != size:
            self._resized(
                size,
                f"a node was lost and the cluster had no room for {self.elastic.world(size)} "
                f"workers within supervisor.node_wait_s={self.cfg.supervisor.node_wait_s:g}s",
                seconds,
                failed_at - 1 - step,
            )
        return step

    def _replace(self, node_lost: bool) -> None:
        """``Fleet.replace``; an elastic run that finds no room after a node loss shrinks to the
        largest size the alive nodes hold (at least parallel.min_dp, else the run fails as a fixed one
        does) and asks for the missing workers' room back (its growth request)."""
        el = self.elastic
        if el is not None:
            el.cancel()  # the room it holds is the new fleet's first (asked for again below)
        try:
            self.fleet.replace(node_lost=node_lost)
        except RunFailed:
            size = el.largest_fitting(below=el.size) if el is not None and node_lost else None
            if size is None:
                raise
            el.resize(size)
            self.timeouts.reset()
            self.fleet.reserve()
        if el is not None:
            el.request_growth()

    def grow_due(self, step: int) -> bool:
        """An elastic run below its size, at a step whose checkpoint was just saved (in flight or
        committed), whose growth request is placed: grow now."""
        el, ckpt = self.elastic, self.ckpt
        saved = step in (ckpt.durable_step, (ckpt.inflight or {}).get("step"))
        return el is not None and step < self.cfg.train.steps and saved and el.grow_ready()

    def grow(self, step: int, data: dict) -> int:
        """At ``step``, a checkpoint boundary, once the growth request is placed: commit the save in
        flight, replace the fleet with one of the configured size and restore ``step`` into it (the hot
        copy, resharded). Returns the step training goes on from (``step``: nothing is lost)."""
        el, t0, size = self.elastic, time.monotonic(), self.elastic.size
        self.ckpt.finish()
        if self.ckpt.durable_step != step:
            return step  # the save failed: grow at a later boundary, with a checkpoint to restore
        self.fleet.release()
        el.cancel()
        el.resize(el.full)
        self.timeouts.reset()
        try:
            self.fleet.reserve()
        except RunFailed:  # the room went again meanwhile: the size the run had, and ask again
            el.resize(size)
            self.fleet.reserve()
            el.request_growth()
        self.fleet.start(data, self.wait, self.touch)
        self.ckpt.workers = self.fleet.workers
        restored = self.ckpt.restore(True)
        self._resized(
            size,
            "the growth request was placed: the cluster has room for the configured size again",
            round(time.monotonic() - t0, 3),
            step - restored,
        )
        return restored

    def _resized(self, size: int, why: str, seconds: float, steps_lost: int) -> None:
        el = self.elastic
        self.event(
            EventKind.RESIZED,
            dim=el.dim,
            **{"from": size, "to": el.size},
            world_size=el.world(el.size),
            why=why,
            seconds=seconds,
            steps_lost=steps_lost,
            note="the global batch, schedule and data order are the run's own at every size",
        )

    def _lost_nodes(self, err: RunFailed) -> dict[str, list[int]]:
        """The fleet's nodes Ray reports dead (node id -> ranks), recorded as ``node_lost``. After a
        worker died, Ray's GCS is given up to NODE_DEATH_WAIT_S to declare its node dead: the death
        of a worker's process reaches the supervisor before the node's missed health checks do. No
        wait when the dead worker's raylet still answers: that worker died alone (killed, OOM)."""
        failure = err.failure
        died = failure is not None and failure.kind is FailureKind.DIED
        if died and failure.rank is not None and failure.rank < len(self.fleet.infos):
            died = not raylet_answers(self.fleet.infos[failure.rank].node_id)
        deadline = time.monotonic() + (NODE_DEATH_WAIT_S if died else 0.0)
        while not (lost := self.fleet.lost_nodes()) and time.monotonic() < deadline:
            time.sleep(0.25)
        for node_id, ranks in lost.items():
            self.event(
                EventKind.NODE_LOST,
                node_id=node_id,
                node=self.fleet.node(ranks[0]),
                ranks=ranks,
                action=f"re-placing the fleet on the surviving nodes (or a replacement), waiting up "
                f"to supervisor.node_wait_s={self.cfg.supervisor.node_wait_s:g}s",
            )
        return lost

    def rollback(self, spike: SpikeRollback) -> int:
        """PaLM-style: restore the checkpoint before the flagged steps, skip data, continue."""
        self._strike(RunFailed(f"too many rollbacks/restarts without progress; last: {spike}"))
        step = self.ckpt.rollback_to_before(spike.first_step)
        self.stats.rollbacks += 1
        n = self.cfg.supervisor.skip_batches
        cursor = self.wait([w.skip_batches.remote(n) for w in self.fleet.workers], "data skip")[0]
        self.event(
            EventKind.SPIKE_ROLLBACK,
            step=spike.step,
            first_flagged=spike.first_step,
            resumed_step=step,
            skipped_batches=n,
            cursor=cursor,
            steps_lost=spike.step - step,
            evidence=spike.evidence,
        )
        return step

    def repair(self, err: SilentCorruption) -> int:
        """Replicas disagreed at ``err.step``: restore the minority from a healthy replica (majority
        vote), or roll every replica back to a checkpoint no later than the last passing check."""
        workers, sdc = self.fleet.workers, self.stats.sdc
        verdicts = [
            v["verdict"] for v in self.wait([w.sdc_verdict.remote() for w in workers], "SDC verdicts") if v["verdict"]
        ]
        failing = [v for v in verdicts if not v["ok"]]
        bad = sorted({v["global_ranks"][b] for v in failing for b in v["bad"]})
        majority = all(v["source"] is not None for v in failing)
        nodes = sorted({self.fleet.node(r) for r in bad})
        sdc.mismatches += 1
        self.event(
            EventKind.SDC_MISMATCH,
            step=err.step,
            ranks=bad,
            nodes=nodes,
            evidence=[{k: e[k] for k in ("bad", "source", "replicas", "global_ranks", "tensors")} for e in failing[:4]],
            action="restore_from_replica" if majority else "rollback",
        )
        if majority:
            t0 = time.monotonic()
            self.wait([w.sdc_repair.remote() for w in workers], "SDC repair (broadcast from healthy replicas)")
            self.wait([w.sdc_check.remote() for w in workers], "SDC re-check after repair")
            sdc.repairs += 1
            sdc.clean_step = err.step
            for r in bad:
                self.fleet.quarantine_rank(r, f"parameters diverged from the replica majority at step {err.step}")
            self.event(
                EventKind.SDC_REPAIRED, step=err.step, ranks=bad, steps_lost=0, seconds=round(time.monotonic() - t0, 3)
            )
            self.repaired_in_place = True
            return err.step
        self._strike(RunFailed(f"too many rollbacks/restarts without progress; last: {err}"))
        step = self.ckpt.rollback_to_before(sdc.clean_step + 1)
        sdc.rollbacks += 1
        self.stats.rollbacks += 1
        self.event(
            EventKind.SDC_ROLLBACK,
            step=err.step,
            resumed_step=step,
            last_clean_check=sdc.clean_step,
            steps_lost=err.step - step,
            suspects=nodes,
            note="two replicas disagree and neither has a majority: both restored from the checkpoint",
        )
        return step
