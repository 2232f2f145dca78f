"""``Supervisor``: the actor that owns a run.

It prepares the data, reserves a placement group (one bundle per rank),
starts the ``TrainWorker`` actors, forms their process group, drives training
in chunks that end at checkpoint boundaries, commits checkpoints, writes
``metrics.jsonl`` / ``events.jsonl`` and answers progress queries from the
driver. It runs threaded (``max_concurrency``) so that workers' metric reports,
the driver's polls and its stop / checkpoint requests are served while ``run``
waits on the workers.

A worker that dies, raises or hangs is replaced with the whole fleet and the run
continues from the newest checkpoint (``_recover``), up to
``supervisor.max_restarts`` times; loss spikes and replica disagreement roll
back or repair (docs/resilience.md). ``request_stop`` (the driver's SIGINT /
SIGTERM) ends a chunk early at a step every rank agrees on
(``raysc.fleet.stopping``), saves that step (``train.save_on_stop``), waits for
the save in flight and returns a summary with ``stopped``; ``request_checkpoint``
saves at the next step boundary and keeps training.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysc.config.load import config_from_dict, config_hash, config_to_dict, dump_config
from raysc.data.prepare import prepare_data
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.errors import RunFailed
from raysc.fleet.faults import consume_faults
from raysc.fleet.records import RunRecords
from raysc.fleet.status import goodput
from raysc.train.sdc import SilentCorruption
from raysc.train.stability import SpikeRollback
from raysc.fleet.worker import REPORT_EVERY_S, TrainWorker
from raysc.model.flops import param_count
from raysc.parallel.dims import ParallelDims, rank_table


def is_peer_failure(exc: BaseException | None) -> bool:
    """Whether a rank's exception is a collective failing because of a peer (closed connection,
    timeout): the symptom, not the cause."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(
        k in str(exc) for k in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out"))


SLOW_FACTOR = 3.0  # a step this many times the calibrated median is reported as slow


@ray.remote(num_cpus=0, max_concurrency=8)
class Supervisor:
    def __init__(self, cfg_dict: dict, resume: bool | str = False, probe_bytes: int = 0,
                 overwrite: bool = False) -> None:
        self.cfg = config_from_dict(cfg_dict, "driver")
        self.resume = resume
        self.overwrite = overwrite  # a fresh run may replace another run's checkpoints (--overwrite)
        self.probe_bytes = probe_bytes  # > 0: after training, the pre-flight probe (raysc preflight)
        self.run_dir = Path(self.cfg.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = RunRecords(self.run_dir, self.cfg.run.name)
        self._lock = threading.Lock()
        self._last = None
        self._last_report = time.monotonic()
        self._phase = "starting"
        self._tps: list[float] = []
        self._events: list[dict] = []
        self._steps: dict[int, dict] = {}
        self.workers: list = []
        self.pg = None
        self.ckpt: CheckpointCoordinator | None = None
        self.restarts = 0  # every restart and rollback of the run
        self._strikes = 0  # restarts and rollbacks since training last made progress
        self._fired: set[str] = set()
        self._fault_step = 0
        self.infos: list[dict] = []  # per rank: node, node id, pid (from setup)
        self.spares: list = []  # warm replacement workers (supervisor.warm_spares)
        self.sdc = {"checks": 0, "mismatches": 0, "repairs": 0, "rollbacks": 0, "check_s": 0.0,
                    "step_s": 0.0, "clean_step": 0}
        self.quarantine: dict[str, dict] = {}  # node id -> why
        self.rollbacks = 0
        self.timeouts: dict | None = None  # calibrated hang and process-group timeouts
        self.memory: list[dict] | None = None  # per-rank peak memory (CUDA, or train.measure_memory)
        self._t_start: float | None = None
        self._stop: str | None = None  # why the driver asked the run to stop (SIGINT, SIGTERM)
        self._ckpt_asked: str | None = None  # who asked for a checkpoint now (raysc ckpt now, SIGUSR1)

    # ---- called by workers and the driver while run() is busy ----
    def report(self, batch: list[dict]) -> None:
        """Per-step metrics from rank 0, a batch at a time (see ``TrainWorker.train``)."""
        with self._lock:
            self._last = batch[-1]
            self._last_report = time.monotonic()
            self._tps.extend(m["tokens_per_s"] for m in batch)
            self._steps.update((m["step"], m) for m in batch)  # re-run steps replace earlier attempts
            for m in batch:
                if "sdc_s" in m:  # a passing replica check at this step
                    self.sdc["checks"] += 1
                    self.sdc["check_s"] += m["sdc_s"]
                    self.sdc["step_s"] += m["step_time"]
                    self.sdc["clean_step"] = max(self.sdc["clean_step"], m["step"])
        self.records.metrics_batch(batch)
        self._publish_health()
        normal = self.timeouts["step_s"] if self.timeouts else None
        for m in batch:
            if m.get("skipped"):
                self._event("update_skipped", step=m["step"], action="skip", **m["skipped"])
            if m.get("domain_epochs"):
                self._event("data_epoch", step=m["step"], epochs=m["domain_epochs"],
                            note="a domain ran out of sequences and started a new seeded permutation")
            if normal and m["step_time"] > max(SLOW_FACTOR * normal, normal + 0.5):
                self._event("slow_step", step=m["step"], step_time_s=round(m["step_time"], 3),
                            normal_s=round(normal, 4), action="none (within the hang timeout)",
                            note="a straggler: every rank waits for the slowest in each collective")

    def _publish_health(self) -> None:
        with self._lock:
            skipped = sum(1 for m in self._steps.values() if m.get("skipped"))
        self.records.health({"restarts": self.restarts - self.rollbacks, "rollbacks": self.rollbacks,
                             "skipped_steps": skipped, "sdc_checks": self.sdc["checks"],
                             "sdc_mismatches": self.sdc["mismatches"],
                             "goodput": self._goodput(self._t_start) if self._t_start else None})

    def _goodput(self, t_start: float) -> float | None:
        """Goodput of this supervisor's run, from the steps reported to it (last attempt wins)."""
        with self._lock:
            g = goodput(list(self._steps.values()), time.time() - t_start)
        return round(g, 4) if g is not None else None

    def fault_fired(self, spec: str, rank: int, step: int) -> None:
        """An injected fault is about to fire on ``rank`` before ``step`` (recorded so a restart
        skips it)."""
        with self._lock:
            self._fired.add(spec)
            self._fault_step = max(self._fault_step, step)
        self._event("fault_injected", fault=spec, rank=rank)

    def progress(self, events_seen: int = 0) -> dict:
        """Phase, newest step metrics, and the events after the first ``events_seen``."""
        with self._lock:
            return {"phase": self._phase, "last": self._last, "total_steps": self.cfg.train.steps,
                    "events": self._events[events_seen:]}

    def request_stop(self, reason: str) -> None:
        """Stop at the next step boundary all ranks agree on, save that step, shut down (``run``
        returns a summary with ``stopped``)."""
        with self._lock:
            first, self._stop = self._stop is None, self._stop or reason
            workers = list(self.workers)
        if first:
            self._event("stop_requested", reason=reason, note="stopping at the next step boundary")
            for w in workers:
                w.request.remote("stop")

    def request_checkpoint(self, source: str) -> None:
        """Save a checkpoint at the next step boundary and keep training (a preemption notice)."""
        with self._lock:
            self._ckpt_asked = source
            workers = list(self.workers)
        self._event("checkpoint_requested", source=source)
        for w in workers:
            w.request.remote("checkpoint")

    def _checkpoint_asked(self) -> bool:
        """Whether a checkpoint was asked for since the last one (and forget the request)."""
        with self._lock:
            asked, self._ckpt_asked = self._ckpt_asked is not None, None
        return asked

    # ---- the run ----
    def _event(self, kind: str, **fields) -> dict:
        rec = self.records.event(kind, **fields)
        with self._lock:
            self._events.append(rec)  # the driver prints them, in order with its own output
        return rec

    def _reserve(self, world: int) -> None:
        par = self.cfg.parallel
        bundle = {"CPU": par.cpus_per_worker}
        if par.device == "cuda":
            bundle["GPU"] = 1
        avoid = self._avoid_nodes()
        selector = [{"ray.io/node-id": f"!in({','.join(avoid)})"} for _ in range(world)] if avoid else None
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK",
                                  bundle_label_selector=selector)
        ready, _ = ray.wait([self.pg.ready()], timeout=self.cfg.supervisor.start_timeout_s)
        if not ready:
            avail = ray.available_resources()
            remove_placement_group(self.pg)
            self.pg = None
            raise RunFailed(
                f"could not reserve {world} worker(s) with {bundle} each within "
                f"{self.cfg.supervisor.start_timeout_s:.0f}s; the cluster has {avail} free. "
                f"Lower parallel.cpus_per_worker, add nodes, or raise supervisor.start_timeout_s.")
        self._bundles = self._bundles_in_node_order(world)

    def _avoid_nodes(self) -> list[str]:
        """Quarantined node ids to keep workers off, when the cluster has another node alive."""
        if not self.quarantine:
            return []
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if not alive - set(self.quarantine):
            self._event("quarantine_ignored", nodes=sorted(q["node"] for q in self.quarantine.values()),
                        note="every node of the cluster is quarantined; placing workers on them anyway")
            return []
        return sorted(set(self.quarantine) & alive)

    def _new_worker(self, rank: int, world: int, spare: bool = False):
        """A TrainWorker in the bundle of ``rank``. A spare takes no resources of its own (the
        worker it will replace holds them until it dies) and waits, warm, until ``setup``."""
        par = self.cfg.parallel
        cpus, gpus = (0, 0) if spare else (par.cpus_per_worker, 1 if par.device == "cuda" else 0)
        return TrainWorker.options(
            num_cpus=cpus, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self._bundles[rank]),
        ).remote(config_to_dict(self.cfg), rank, world, ray.get_runtime_context().current_actor)

    def _take_spares(self, world: int) -> list | None:
        """The warm spares, if every one of them is alive and ready; else None (they are discarded)."""
        spares, self.spares = self.spares, []
        if len(spares) != world:
            return None
        refs = [s.address.remote() for s in spares]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.supervisor.start_timeout_s)
        try:
            if len(ready) == len(refs):
                ray.get(refs)
                return spares
        except ray.exceptions.RayError:
            pass  # a spare died (its node was lost): start a cold fleet
        for s in spares:
            ray.kill(s, no_restart=True)
        return None

    def _start_workers(self, world: int, data: dict, warm: bool = False) -> list[dict]:
        """Create the workers in the reserved bundles (or activate the warm spares) and form their
        process group."""
        cfg_dict = config_to_dict(self.cfg)
        spares = self._take_spares(world) if warm else None
        gpu_ids = [i.get("gpu_ids") for i in self.infos] if spares and len(self.infos) == world else [None] * world
        self.workers = spares or [self._new_worker(rank, world) for rank in range(world)]
        ip, port, _ = ray.get(self.workers[0].address.remote())
        self._touch()
        infos = self._wait([w.setup.remote((ip, port), data, cfg_dict, gpu_ids[r]) for r, w in enumerate(self.workers)],
                           "setup (rendezvous and model build)", timeout=self.cfg.supervisor.start_timeout_s + 60)
        self.infos = infos
        self._event("workers_ready", workers=len(infos), warm=bool(spares), master=f"{ip}:{port}",
                    pids=[i["pid"] for i in infos],
                    setup_s=max((i["setup_s"] for i in infos), key=lambda d: sum(d.values())),
                    device=infos[0]["device"],
                    threads=infos[0]["threads"], peak_flops=infos[0]["peak_flops"])
        if self.cfg.supervisor.sdc_every_steps and not infos[0]["replicas"]:
            self._event("sdc_unavailable", note="supervisor.sdc_every_steps is set but parallel.dp_replicate=1: "
                                                "no rank holds a replica of another's parameters to compare")
        if self.ckpt is not None:
            self.ckpt.workers = self.workers
        return infos

    def _ensure_spares(self) -> None:
        """Start the next set of warm spares in the background (after a chunk of training, so their
        start-up does not compete with a restore)."""
        if self.cfg.supervisor.warm_spares and not self.spares:
            world = self.cfg.parallel.world_size
            self.spares = [self._new_worker(rank, world, spare=True) for rank in range(world)]

    def _strike(self, err: RunFailed) -> None:
        """Count a restart or rollback; after supervisor.max_restarts of them with no chunk of
        training completed in between, stop the run with ``err``."""
        self.restarts += 1
        self._strikes += 1
        if self._strikes > self.cfg.supervisor.max_restarts:
            self._event("restarts_exhausted", restarts=self._strikes - 1, error=str(err))
            raise err

    def _kill_spares(self) -> None:
        for s in self.spares:
            ray.kill(s, no_restart=True)
        self.spares = []

    def _rollback(self, spike: SpikeRollback) -> int:
        """PaLM-style: restore the checkpoint before the flagged steps, skip data, continue."""
        self._strike(RunFailed(f"too many rollbacks/restarts without progress; last: {spike}"))
        step = self.ckpt.rollback_to_before(spike.first_step)
        self.rollbacks += 1
        n = self.cfg.supervisor.skip_batches
        cursor = self._wait([w.skip_batches.remote(n) for w in self.workers], "data skip")[0]
        self._event("spike_rollback", step=spike.step, first_flagged=spike.first_step, resumed_step=step,
                    skipped_batches=n, cursor=cursor, steps_lost=spike.step - step, evidence=spike.evidence)
        return step

    def _heal_sdc(self, err: SilentCorruption) -> int:
        """Replicas disagreed at ``err.step``: restore the minority from a healthy replica (majority
        vote), or roll every replica back to a checkpoint no later than the last passing check."""
        verdicts = self._wait([w.sdc_verdict.remote() for w in self.workers], "SDC verdicts")
        bad = sorted({v["verdict"]["global_ranks"][b] for v in verdicts if v["verdict"] and not v["verdict"]["ok"]
                      for b in v["verdict"]["bad"]})
        majority = all(v["verdict"]["ok"] or v["verdict"]["source"] is not None for v in verdicts if v["verdict"])
        nodes = sorted({self.infos[r]["node"] for r in bad})
        self.sdc["mismatches"] += 1
        evidence = [v["verdict"] for v in verdicts if v["verdict"] and not v["verdict"]["ok"]]
        self._event("sdc_mismatch", step=err.step, ranks=bad, nodes=nodes,
                    evidence=[{k: e[k] for k in ("bad", "source", "replicas", "global_ranks", "tensors")}
                              for e in evidence[:4]],
                    action="restore_from_replica" if majority else "rollback")
        if majority:
            t0 = time.monotonic()
            self._wait([w.sdc_repair.remote() for w in self.workers], "SDC repair (broadcast from healthy replicas)")
            self._wait([w.sdc_check.remote() for w in self.workers], "SDC re-check after repair")
            self.sdc["repairs"] += 1
            self.sdc["clean_step"] = err.step
            for r in bad:
                self._quarantine(r, f"parameters diverged from the replica majority at step {err.step}")
            self._event("sdc_repaired", step=err.step, ranks=bad, steps_lost=0,
                        seconds=round(time.monotonic() - t0, 3))
            return err.step
        self._strike(RunFailed(f"too many rollbacks/restarts without progress; last: {err}"))
        step = self.ckpt.rollback_to_before(self.sdc["clean_step"] + 1)
        self.sdc["rollbacks"] += 1
        self.rollbacks += 1
        self._event("sdc_rollback", step=err.step, resumed_step=step, last_clean_check=self.sdc["clean_step"],
                    steps_lost=err.step - step, suspects=nodes,
                    note="two replicas disagree and neither has a majority: both restored from the checkpoint")
        return step

    def _calibrate(self, first: int, last: int) -> None:
        """Set the hang timeout and the process-group timeout from measured times: the median step
        time of steps ``first..last`` (the first step of a fleet, which warms up, is left out) and
        an all-reduce of gradient size, each times supervisor.timeout_factor, at least
        supervisor.timeout_floor_s. Optionally stress collectives under the new timeout."""
        sup = self.cfg.supervisor
        deadline = time.monotonic() + 5.0
        while last not in self._steps and time.monotonic() < deadline:  # rank 0's last report in flight
            time.sleep(0.05)
        with self._lock:
            times = sorted(m["step_time"] for s, m in self._steps.items() if first <= s <= last)
        if not times:
            return
        step_s = times[len(times) // 2]
        coll = self._wait([w.measure_collectives.remote() for w in self.workers], "collective calibration")
        coll_s = max(c["allreduce_s"] for c in coll)
        silence_s = max(step_s, REPORT_EVERY_S)  # rank 0 reports once a step, at most once a second
        self.timeouts = {"step_s": step_s, "collective_s": coll_s, "collective_bytes": coll[0]["bytes"],
                         "hang_s": max(sup.timeout_floor_s, sup.timeout_factor * silence_s),
                         "pg_s": max(sup.timeout_floor_s, sup.timeout_factor * max(step_s, coll_s))}
        self._apply_pg_timeout()
        self._event("timeouts_calibrated", steps=f"{first}..{last}", step_time_s=round(step_s, 4),
                    allreduce_s=round(coll_s, 5), allreduce_bytes=coll[0]["bytes"], factor=sup.timeout_factor,
                    floor_s=sup.timeout_floor_s, hang_timeout_s=round(self.timeouts["hang_s"], 3),
                    pg_timeout_s=round(self.timeouts["pg_s"], 3))
        if sup.stress_s:
            res = self._wait([w.stress.remote(sup.stress_s) for w in self.workers], "collective stress test",
                             hang_s=sup.stress_s + self.timeouts["pg_s"] + 30)
            self._event("collective_stress", seconds=sup.stress_s, ops=sum(r["ops"] for r in res),
                        slowest_op_s=round(max(r["slowest_s"] for r in res), 4),
                        timeouts=sum(r["timeouts"] for r in res), pg_timeout_s=round(self.timeouts["pg_s"], 3),
                        errors=[r["error"] for r in res if r["error"]][:2])

    def _apply_pg_timeout(self) -> None:
        if self.timeouts is not None:
            self._wait([w.set_timeout.remote(self.timeouts["pg_s"]) for w in self.workers], "set timeouts")

    def _quarantine(self, rank: int, why: str) -> None:
        """Record the node of ``rank`` as suspect: later restarts place workers elsewhere when the
        cluster has other nodes (``quarantine.json`` in the run directory lists them)."""
        info = self.infos[rank]
        self.quarantine[info["node_id"]] = {"node": info["node"], "rank": rank, "reason": why, "time": time.time()}
        (self.run_dir / "quarantine.json").write_text(json.dumps(self.quarantine, indent=1))
        self._event("node_quarantined", rank=rank, node=info["node"], node_id=info["node_id"], reason=why)

    def _recover(self, err: RunFailed, data: dict) -> int:
        """Replace the whole fleet after a failure and continue from the newest checkpoint.

        Bounded by ``supervisor.max_restarts`` with exponential backoff; the hot copy makes the
        restore fast. Returns the step training resumes from."""
        self._strike(err)
        t0 = time.monotonic()
        with self._lock:
            failed_at = max((self._last or {}).get("step", 0) + 1, self._fault_step)
        self.ckpt.salvage(timeout_s=5.0)
        self._event("recovery_start", attempt=self.restarts, failed_step=failed_at, error=str(err))
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self._strikes > 1:  # the first restart is immediate; repeated failures back off
            time.sleep(self.cfg.supervisor.restart_backoff_s * 2 ** (self._strikes - 2))
        on_quarantined = {b for b in placement_group_table(self.pg).get("bundles_to_node_id", {}).values()}
        if self._avoid_nodes() and on_quarantined & set(self.quarantine):
            self._kill_spares()
            remove_placement_group(self.pg)  # re-reserve away from the quarantined node(s)
            self._reserve(self.cfg.parallel.world_size)
        with self._lock:
            self.cfg.supervisor.inject = consume_faults(self.cfg.supervisor.inject, self._fired)
        self._start_workers(self.cfg.parallel.world_size, data, warm=True)
        self._apply_pg_timeout()
        step = self.ckpt.restore(True) if self.ckpt.own_steps() else 0
        self._event("recovered", attempt=self.restarts, resumed_step=step, steps_lost=failed_at - 1 - step,
                    seconds=round(time.monotonic() - t0, 3))
        return step

    def _bundles_in_node_order(self, world: int) -> list[int]:
        """Bundle index for each rank: consecutive ranks on the same node, so TP (then CP) groups,
        which are runs of consecutive ranks, stay inside a node whenever the node has room."""
        table = placement_group_table(self.pg).get("bundles_to_node_id", {})
        if len(table) != world:
            return list(range(world))
        by_node: dict[str, list[int]] = {}
        for idx in sorted(table):
            by_node.setdefault(table[idx], []).append(idx)
        order = [i for node in sorted(by_node, key=lambda n: min(by_node[n])) for i in by_node[node]]
        dims = ParallelDims.from_config(self.cfg.parallel)
        block = dims.tp * dims.cp
        for start in range(0, world, block):
            if len({table[i] for i in order[start:start + block]}) > 1:
                self._event("layout_warning", ranks=f"{start}..{start + block - 1}",
                            note="a tensor/context-parallel group spans nodes; give nodes a multiple of "
                                 "tp×cp workers")
        return order

    def _wait(self, refs: list, what: str, timeout: float | None = None, hang_s: float | None = None) -> list:
        """ray.get with hang detection: no report and no result for ``hang_s`` (default
        supervisor.hang_timeout_s), or no result within ``timeout``, fails the run, naming the
        ranks that did not finish."""
        hang_s = hang_s or self.cfg.supervisor.hang_timeout_s
        pending = list(refs)
        t0 = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if pending and self.ckpt is not None:
                self.ckpt.poll()
            for ref in self._root_cause_first(done, pending):
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    rank = refs.index(ref)
                    self._event("worker_died", rank=rank, node=self._node(rank), during=what,
                                error=str(e).splitlines()[0])
                    raise RunFailed(f"worker rank {rank} died during {what}: {str(e).splitlines()[0]}. "
                                    f"Resume with `raysc train ... --resume`.") from None
                except ray.exceptions.RayTaskError as e:
                    rank = refs.index(ref)
                    cause = str(e.cause) if e.cause is not None else str(e)
                    self._event("worker_error", rank=rank, node=self._node(rank), during=what, error=cause)
                    err = RunFailed(f"worker rank {rank} raised during {what}: {cause}")
                    err.worker_cause = e.cause
                    raise err from None
            with self._lock:
                silent = time.monotonic() - self._last_report
            if pending and timeout is not None and time.monotonic() - t0 > timeout:
                ranks = sorted(refs.index(r) for r in pending)
                self._event("worker_timeout", during=what, ranks=ranks, seconds=round(timeout, 1))
                raise RunFailed(f"ranks {ranks} did not finish {what} within {timeout:.0f}s.")
            if pending and silent > hang_s:
                ranks = sorted(refs.index(r) for r in pending)
                self._event("worker_hang", during=what, silent_s=round(silent, 1), ranks=ranks,
                            nodes=sorted({self._node(r) for r in ranks}), timeout_s=round(hang_s, 2))
                raise RunFailed(f"no progress for {silent:.0f}s during {what}; waiting on ranks {ranks} "
                                f"(hang timeout {hang_s:.1f}s: "
                                + ("calibrated" if hang_s != self.cfg.supervisor.hang_timeout_s
                                   else "supervisor.hang_timeout_s") + ").")
        return ray.get(refs)

    @staticmethod
    def _root_cause_first(done: list, pending: list) -> list:
        """``done`` with dead actors first. When a rank failed inside a collective (its peer
        vanished), the others get a moment to report: a dead peer is the root cause."""

        def outcome(ref):
            try:
                ray.get(ref, timeout=0)
                return "ok"
            except ray.exceptions.RayActorError:
                return "dead"
            except ray.exceptions.RayTaskError as e:
                return e.cause
            except ray.exceptions.RayError:
                return "error"

        results = {ref: outcome(ref) for ref in done}
        dead = [ref for ref in done if results[ref] == "dead"]
        if not dead and pending and any(is_peer_failure(r) for r in results.values() if not isinstance(r, str)):
            late, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            dead = [ref for ref in late if outcome(ref) == "dead"]
        return dead + [ref for ref in done if ref not in dead]

    def _node(self, rank: int) -> str | None:
        return self.infos[rank]["node"] if rank < len(self.infos) else None

    def _touch(self) -> None:
        with self._lock:
            self._last_report = time.monotonic()

    def run(self) -> dict:
        t_start = self._t_start = time.time()
        cfg = self.cfg
        self._event("run_start", run_dir=str(self.run_dir), config_hash=config_hash(cfg),
                    params=param_count(cfg.model)["total"], resume=bool(self.resume))
        try:
            return self._run(t_start)
        except RunFailed as e:
            if self.ckpt is not None:
                self.ckpt.salvage()
            self._event("run_failed", error=str(e))
            raise
        finally:
            self._phase = "stopped"
            for w in self.workers:
                ray.kill(w, no_restart=True)
            self.workers = []
            self._kill_spares()
            if self.pg is not None:
                remove_placement_group(self.pg)
            self.records.close()

    def _run(self, t_start: float) -> dict:
        cfg = self.cfg
        self.ckpt = CheckpointCoordinator(cfg, self._event, self._wait)
        self.ckpt.probe()
        # before anything in the run directory is written: a refused run leaves the other run's files alone
        self.ckpt.claim(self.resume, self.overwrite, self.run_dir)
        (self.run_dir / "config.toml").write_text(dump_config(cfg))
        self._phase = "preparing data"
        packed, tok_path, data_info = prepare_data(cfg)
        (self.run_dir / "tokenizer.json").write_bytes(Path(tok_path).read_bytes())
        self._event("data_ready", **{k: data_info[k] for k in ("tokens", "documents", "train_sequences",
                                                               "val_sequences", "corpus_sha256", "domains",
                                                               "schedule") if k in data_info})
        data = {"train": ray.put(packed.train), "val": ray.put(packed.val)}

        self._phase = "starting workers"
        world = cfg.parallel.world_size
        self._reserve(world)
        infos = self._start_workers(world, data)
        dims = ParallelDims.from_config(cfg.parallel)
        self._event("layout", layout=dims.describe(), world_size=world,
                    table="\n" + rank_table(dims, [i["node"] for i in infos]))
        start_step = self.ckpt.restore(self.resume) if self.resume else 0

        self._phase = "training"
        every = cfg.checkpoint.every_steps or cfg.train.steps
        step, last = start_step, None
        t_train = time.perf_counter()
        while step < cfg.train.steps and not self._stop:
            target = min(cfg.train.steps, (step // every + 1) * every)
            try:
                self._touch()
                if self.timeouts is None and cfg.supervisor.calibrate_steps:
                    target = min(target, step + 1 + cfg.supervisor.calibrate_steps)
                results = self._wait([w.train.remote(target) for w in self.workers],
                                     f"steps {step + 1}..{target}",
                                     hang_s=self.timeouts["hang_s"] if self.timeouts else None)
                last = results[0] or last
                if results[0] and "memory" in results[0]:
                    self.memory = [r["memory"] for r in results]
                self._strikes = 0
                self._ensure_spares()
                # a stop or checkpoint request ends a chunk early, after the same step on every rank
                first, step = step + 2, results[0]["step"] if results[0] else step
                if self.timeouts is None and cfg.supervisor.calibrate_steps:
                    self._calibrate(first, step)
                asked = self._checkpoint_asked()
                if step % every and step < cfg.train.steps and not asked:
                    continue  # not a checkpoint boundary (a stop saves after the loop)
                self._phase = "checkpointing"
                self.ckpt.save(step, last["tokens"] if last else 0)
                if step == cfg.train.steps:
                    self.ckpt.finish()
            except RunFailed as e:
                if not getattr(e, "recoverable", True):
                    raise
                if isinstance(getattr(e, "worker_cause", None), SpikeRollback):
                    self._phase = "rolling back"
                    step = self._rollback(e.worker_cause)
                    continue
                if isinstance(getattr(e, "worker_cause", None), SilentCorruption):
                    self._phase = "repairing replicas"
                    step = self._heal_sdc(e.worker_cause)
                    self._phase = "training"
                    continue
                self._phase = "recovering"
                step = self._recover(e, data)
            self._phase = "training"
        if self._stop:
            return self._stopped(step, start_step, last)
        train_time = time.perf_counter() - t_train

        self._phase = "evaluating"
        val = self._wait([w.val_loss.remote() for w in self.workers], "validation")[0]
        probe = None
        if self.probe_bytes:
            self._phase = "probing"
            probe = self._wait([w.probe.remote(self.probe_bytes) for w in self.workers], "pre-flight probe")
        latest = self.ckpt.latest()
        with self._lock:
            tps = self._tps[len(self._tps) // 10:] or [0.0]  # skip warm-up steps
        steps_run = cfg.train.steps - start_step
        summary = {
            "run_dir": str(self.run_dir), "steps": cfg.train.steps, "steps_run": steps_run,
            "final_loss": last["loss"] if last else None, "val_loss": val,
            "tokens": last["tokens"] if last else None,
            "tokens_per_s": sorted(tps)[len(tps) // 2],
            "tokens_per_s_wall": (steps_run * cfg.train.global_batch_sequences * cfg.train.seq_len) / train_time
            if steps_run else 0.0,
            "mfu": last["mfu"] if last else None, "params": param_count(cfg.model)["total"],
            "checkpoint": f"{cfg.checkpoint_uri}/step_{latest:08d}" if latest is not None else None,
            "checkpoint_stall_s": round(sum(x["stall_s"] for x in self.ckpt.saves), 4),
            # steps of work the newest durable checkpoint lacks (> 0 only when saves failed): non-zero exit
            "checkpoint_lag_steps": cfg.train.steps - (latest if latest is not None else 0),
            "failed_saves": self.ckpt.failed_saves,
            "restarts": self.restarts - self.rollbacks, "rollbacks": self.rollbacks,
            "sdc": {"checks": self.sdc["checks"], "mismatches": self.sdc["mismatches"],
                    "repairs": self.sdc["repairs"], "rollbacks": self.sdc["rollbacks"],
                    "overhead": round(self.sdc["check_s"] / self.sdc["step_s"], 4) if self.sdc["step_s"] else None},
            "quarantined_nodes": sorted(q["node"] for q in self.quarantine.values()),
            "goodput": self._goodput(t_start),
            "skipped_updates": sum(1 for m in self._steps.values() if m.get("skipped")),
            "wall_s": round(time.time() - t_start, 2),
            "peak_memory_gb": [round(m["peak_bytes"] / 1e9, 4) for m in self.memory] if self.memory else None,
        }
        if probe is not None:
            summary["probe"] = probe
        self._event("run_end", **{k: v for k, v in summary.items() if k != "probe"})
        return summary

    def _stopped(self, step: int, start_step: int, last: dict | None) -> dict:
        """After a stop request: save ``step`` unless it is committed (or nothing was trained), wait
        for the save in flight to commit; the fleet is shut down by ``run``."""
        self._phase = "stopping"
        t0 = time.monotonic()
        if self.cfg.train.save_on_stop and step > start_step:
            self.ckpt.save(step, last["tokens"] if last else 0)  # waits for a save in flight first
        self.ckpt.finish()
        latest = self.ckpt.latest()
        summary = {"run_dir": str(self.run_dir), "stopped": self._stop, "step": step, "steps": self.cfg.train.steps,
                   "step_in_flight": "finished", "checkpoint_step": latest,
                   "checkpoint": f"{self.cfg.checkpoint_uri}/step_{latest:08d}" if latest is not None else None,
                   "stop_s": round(time.monotonic() - t0, 3), "wall_s": round(time.time() - self._t_start, 2)}
        self._event("run_stopped", reason=self._stop, **{k: v for k, v in summary.items() if k != "stopped"})
        return summary
