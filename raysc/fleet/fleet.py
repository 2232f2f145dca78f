"""``Fleet``: the workers of a run and where they are placed.

It reserves a placement group (one bundle per rank, ranks of a TP×CP group on one node
when the node has room), starts ``TrainWorker`` actors in it and forms their process
group, keeps a set of warm spares (``supervisor.warm_spares``) that take over the bundles
of a failed fleet, and keeps a quarantine of suspect nodes (``quarantine.json``) that
later placements avoid while the cluster has another node alive.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysc.cluster.fit import alive_nodes, describe_nodes, worker_bundle, workers_fit
from raysc.config.load import config_to_dict
from raysc.config.schema import Config
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.groups import group_name
from raysc.fleet.messages import WorkerInfo
from raysc.fleet.start_bound import START_BOUND, start_bound_s
from raysc.fleet.worker import TrainWorker
from raysc.parallel.dims import rank_table


class Fleet:
    def __init__(self, cfg: Config, run_dir: Path, event: Callable[..., dict], supervisor) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.event = event
        self.supervisor = supervisor  # the actor handle workers report to
        self.pg = None
        self.bundles: list[int] = []  # bundle index of each rank
        self.workers: list = []
        self.spares: list = []  # warm replacement workers
        self.spare_setup: list = []  # their setup calls (ObjectRefs of WorkerInfo) when prepared
        self.data: dict | None = None  # the run's data (object refs) the workers set up with
        self.infos: list[WorkerInfo] = []
        self.quarantine: dict[str, dict] = {}  # node id -> why
        # the peak FLOP/s MFU is measured against: the first fleet's (a measured CPU matmul) for every
        # later fleet too, so a restart on a busy machine does not re-measure a lower peak (MFU > 100%)
        self.peak_flops = cfg.train.peak_flops
        self._spawned = False  # ``spawn`` created the workers ``start`` is to set up
        self.pool = None  # the cluster's WorkerPool, for CPU runs with supervisor.worker_pool_idle_s > 0
        self.lent: list = []  # the workers of self.workers the pool lent (they get a rank in ``setup``)
        self.reused = 0  # how many of them ran a run before
        self._created_at = 0.0  # when the current cold fleet's workers were created (``_new_fleet``)
        self.start_measured_s = 0.0  # the longest a cold fleet of this run took from creation to all up
        self._last_start_s = 0.0  # the latest cold fleet's

    @property
    def world(self) -> int:
        return self.cfg.parallel.world_size

    def node(self, rank: int) -> str | None:
        return self.infos[rank].node if rank < len(self.infos) else None

    # ---- placement ----
    def reserve(self, timeout_s: float | None = None) -> None:
        """Reserve one bundle per rank, away from quarantined nodes when the cluster allows; fail
        after ``timeout_s`` (default supervisor.start_timeout_s)."""
        timeout_s = timeout_s or self.cfg.supervisor.start_timeout_s
        bundle = self._bundle()
        if self.cfg.parallel.tp_within_node:
            self._check_groups_fit(bundle)
        avoid = self._avoid_nodes(bundle)
        if self.quarantine and not avoid:
            self._quarantine_ignored()
        selector = [{"ray.io/node-id": f"!in({','.join(avoid)})"} for _ in range(self.world)] if avoid else None
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.world)],
            strategy="PACK",
            bundle_label_selector=selector,
            name=group_name("fleet"),
        )
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            avail = ray.available_resources()
            remove_placement_group(self.pg)
            self.pg = None
            raise RunFailed(
                f"could not reserve {self.world} worker(s) with {bundle} each within {timeout_s:.0f}s; the cluster "
                f"has {avail} free on {self._node_sizes()}. Lower parallel.cpus_per_worker, add nodes, or raise "
                f"supervisor.start_timeout_s (supervisor.node_wait_s after a node loss)."
            )
        self.bundles = self._bundles_in_node_order()

    def _bundle(self) -> dict[str, float]:
        """The resources of one worker."""
        return worker_bundle(self.cfg.parallel)

    def _avoid_nodes(self, bundle: dict[str, float]) -> list[str]:
        """Quarantined node ids to keep workers off, when the other alive nodes can hold the whole
        fleet (by their total resources); else none."""
        if not self.quarantine:
            return []
        alive = [n for n in ray.nodes() if n.get("Alive")]
        room = sum(workers_fit(n["Resources"], bundle) for n in alive if n["NodeID"] not in self.quarantine)
        if room < self.world:
            return []
        return sorted(set(self.quarantine) & {n["NodeID"] for n in alive})

    def _bundles_in_node_order(self) -> list[int]:
        """Bundle index for each rank: consecutive ranks on the same node, so TP (then CP) groups,
        which are runs of consecutive ranks, stay inside a node whenever the node has room."""
        table = placement_group_table(self.pg).get("bundles_to_node_id", {})
        if len(table) != self.world:
            return list(range(self.world))
        by_node: dict[str, list[int]] = {}
        for idx in sorted(table):
            by_node.setdefault(table[idx], []).append(idx)
        order = [i for node in sorted(by_node, key=lambda n: min(by_node[n])) for i in by_node[node]]
        dims = self.cfg.parallel.dims
        block = dims.tp * dims.cp
        for start in range(0, self.world, block):
            if len({table[i] for i in order[start : start + block]}) > 1:
                self.event(
                    EventKind.LAYOUT_WARNING,
                    ranks=f"{start}..{start + block - 1}",
                    note="a tensor/context-parallel group spans nodes; give nodes a multiple of tp×cp workers",
                )
        return order

    def _check_groups_fit(self, bundle: dict[str, float]) -> None:
        """parallel.tp_within_node: some alive node must hold a whole TP×CP group of workers."""
        dims = self.cfg.parallel.dims
        group = dims.tp * dims.cp
        fits = [workers_fit(n["Resources"], bundle) for n in ray.nodes() if n.get("Alive")]
        if max(fits, default=0) < group:
            raise RunFailed(
                f"parallel.tp_within_node: a tensor×context-parallel group is {group} workers of {bundle}, but the "
                f"largest node holds {max(fits, default=0)} ({self._node_sizes()}). Use nodes with at least "
                f"{group * bundle['CPU']:g} CPUs{f' and {group} GPUs' if 'GPU' in bundle else ''}, lower "
                f"parallel.tp/cp or parallel.cpus_per_worker, or set parallel.tp_within_node=false."
            )

    @staticmethod
    def _node_sizes() -> str:
        """The alive nodes' CPU and GPU counts, for an error message."""
        return describe_nodes([n for n in alive_nodes() if n.get("CPU")])

    def lost_nodes(self) -> dict[str, list[int]]:
        """The fleet's nodes that Ray's GCS reports dead: node id -> the ranks that were on it."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        lost: dict[str, list[int]] = {}
        for info in self.infos:
            if info.node_id not in alive:
                lost.setdefault(info.node_id, []).append(info.rank)
        return lost

    def replace(self, node_lost: bool) -> None:
        """Before a restart: re-reserve the placement group after a node loss (on the surviving
        nodes or a replacement, waiting up to supervisor.node_wait_s), or when a bundle sits on a
        quarantined node that can be avoided."""
        on_quarantined = set(placement_group_table(self.pg).get("bundles_to_node_id", {}).values()) & set(
            self.quarantine
        )
        if not node_lost and not on_quarantined:
            return
        if not node_lost and not self._avoid_nodes(self._bundle()):
            self._quarantine_ignored()
            return
        self.kill_spares()
        remove_placement_group(self.pg)
        self.pg = None
        self.reserve(self.cfg.supervisor.node_wait_s if node_lost else None)

    def _quarantine_ignored(self) -> None:
        self.event(
            EventKind.QUARANTINE_IGNORED,
            nodes=self.quarantined_nodes(),
            note="the nodes outside the quarantine cannot hold the fleet; placing workers on quarantined nodes too",
        )

    def quarantine_rank(self, rank: int, why: str) -> None:
        """Record the node of ``rank`` as suspect: later placements avoid it when the cluster has
        other nodes (``quarantine.json`` in the run directory lists them)."""
        info = self.infos[rank]
        self.quarantine[info.node_id] = {"node": info.node, "rank": rank, "reason": why, "time": time.time()}
        (self.run_dir / "quarantine.json").write_text(json.dumps(self.quarantine, indent=1))
        self.event(EventKind.NODE_QUARANTINED, rank=rank, node=info.node, node_id=info.node_id, reason=why)

    def quarantined_nodes(self) -> list[str]:
        return sorted(q["node"] for q in self.quarantine.values())

    # ---- workers ----
    def _new_worker(self, rank: int, spare: bool = False):
        """A TrainWorker in the bundle of ``rank``. A spare takes no resources of its own (the
        worker it will replace holds them until it dies) and waits, warm, until ``setup``."""
        par = self.cfg.parallel
        cpus, gpus = (0, 0) if spare else (par.cpus_per_worker, 1 if par.device == "cuda" else 0)
        return TrainWorker.options(
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.bundles[rank]
            ),
        ).remote(config_to_dict(self.cfg), rank, self.world, self.supervisor)

    def _all_answer(self, refs: list, extra_s: float = 0.0) -> bool:
        """Whether every call of ``refs`` returns within supervisor.start_timeout_s (+ ``extra_s``); the
        first error (a spare died: its node was lost) ends the wait."""
        pending, deadline = list(refs), time.monotonic() + self.cfg.supervisor.start_timeout_s + extra_s
        try:
            while pending:
                ready, pending = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    return False
                ray.get(ready)
        except ray.exceptions.RayError:
            return False
        return True

    def _take_spares(self, cfg_dict: dict) -> tuple[list, list[WorkerInfo] | None] | None:
        """The warm spares, if every one of them is alive and ready, with their ``WorkerInfo``s when
        they were prepared (``ensure_spares``: then they take the run's current config, whose injected
        faults that fired are gone, here); else None (they are discarded and a cold fleet starts)."""
        spares, prepared, self.spares, self.spare_setup = self.spares, self.spare_setup, [], []
        if len(spares) == self.world and self._all_answer(
            prepared or [s.address.remote() for s in spares], extra_s=60 if prepared else 0.0
        ):
            if not prepared:
                return spares, None
            if self._all_answer([s.activate.remote(cfg_dict) for s in spares]):
                return spares, ray.get(prepared)
        for s in spares:
            ray.kill(s, no_restart=True)
        return None

    def spawn(self) -> None:
        """Create the first fleet's workers in the reserved bundles now: their processes start and
        import torch while the supervisor prepares the data; ``start`` then sets them up."""
        self.workers = self._new_fleet()
        self._spawned = True

    def _new_fleet(self) -> list:
        """A worker for each rank: lent by the cluster's pool (``raysc.fleet.pool``) on the node of the
        rank's bundle, or, without a pool, a new process in the bundle."""
        self.lent, self.reused = [], 0
        self._created_at = time.monotonic()
        idle_s = self.cfg.supervisor.worker_pool_idle_s
        if idle_s and self.cfg.parallel.device == "cpu":
            from raysc.fleet.pool import worker_pool

            table = placement_group_table(self.pg).get("bundles_to_node_id", {})
            self.pool = self.pool or worker_pool(idle_s)
            if self.pool is not None and len(table) == self.world:
                try:
                    lent = ray.get(
                        self.pool.lend.remote(
                            [table[self.bundles[r]] for r in range(self.world)], self.supervisor, idle_s
                        ),
                        timeout=30,
                    )
                except ray.exceptions.RayError:
                    self.pool = None  # gone (its idle time ran out meanwhile): this fleet starts its own
                else:
                    self.lent = [w for w, _ in lent]
                    self.reused = sum(r for _, r in lent)
                    return list(self.lent)
        return [self._new_worker(rank) for rank in range(self.world)]

    def start(
        self, data: dict, wait: Callable[..., list], touch: Callable[[], None], warm: bool = False
    ) -> list[WorkerInfo]:
        """Create the workers in the reserved bundles (unless ``spawn`` did, or activate the warm
        spares) and form their process group; ``wait`` watches the setup calls, whose hang clock
        ``touch`` restarts."""
        self.data = data
        cfg_dict = self._cfg_dict()
        spares, prepared = (self._take_spares(cfg_dict) if warm else None) or (None, None)
        gpu_ids = [i.gpu_ids for i in self.infos] if spares and len(self.infos) == self.world else [None] * self.world
        spawned, self._spawned = self._spawned, False
        self.workers = spares or (self.workers if spawned else self._new_fleet())
        lent = {w._actor_id.hex() for w in self.lent} if not spares else set()
        start_s = self.start_bound_s()
        if prepared:  # past the rendezvous and the model build, and given the current config
            infos, (ip, port) = prepared, prepared[0].master
        else:
            ip, port = self._started(wait, touch, start_s)
            if not spares:  # a cold fleet: how long its processes took to start calibrates the next one's bound
                self._last_start_s = time.monotonic() - self._created_at
                self.start_measured_s = max(self.start_measured_s, self._last_start_s)
            infos = wait(
                [
                    w.setup.remote(
                        (ip, port),
                        data,
                        cfg_dict,
                        gpu_ids[r],
                        (r, self.world, self.supervisor) if w._actor_id.hex() in lent else None,
                    )
                    for r, w in enumerate(self.workers)
                ],
                "setup (rendezvous and model build)",
                timeout=start_s + 60,
                hang_s=start_s + 61,
                hang_why=f"{START_BOUND} + 60 s",
            )
            # (bounded by the start-up timeout alone, as the start above: a fleet setting up beside other
            # work is slow, not hung; a small hang_timeout_s, meant for steps, failed a CI run in setup)
        self.infos = infos
        self.peak_flops = self.peak_flops or infos[0].peak_flops
        self.event(
            EventKind.WORKERS_READY,
            workers=len(infos),
            warm=bool(spares),
            prepared=bool(prepared),
            pooled=len(lent),
            reused=self.reused if lent else 0,
            master=f"{ip}:{port}",
            started_s=None if spares else round(self._last_start_s, 2),
            start_bound_s=round(start_s, 1),
            pids=[i.pid for i in infos],
            setup_s=max((i.setup_s for i in infos), key=lambda d: sum(d.values())),
            device=infos[0].device,
            threads=infos[0].threads,
            peak_flops=infos[0].peak_flops,
        )
        dims = self.cfg.parallel.dims
        self.event(
            EventKind.LAYOUT,
            layout=dims.describe(),
            world_size=dims.world_size,
            node_ids=[i.node_id for i in infos],
            built=infos[0].built,
            table="\n" + rank_table(dims, [i.node for i in infos]),
        )
        if self.cfg.supervisor.sdc_every_steps and not infos[0].replicas:
            self.event(
                EventKind.SDC_UNAVAILABLE,
                note="supervisor.sdc_every_steps is set but parallel.dp_replicate=1: "
                "no rank holds a replica of another's parameters to compare",
            )
        return infos

    def start_bound_s(self) -> float:
        """``raysc.fleet.start_bound``'s bound for this run's next cold fleet."""
        return start_bound_s(self.cfg.supervisor, self.start_measured_s)

    def _started(self, wait: Callable[..., list], touch: Callable[[], None], start_s: float) -> tuple[str, int]:
        """Wait until every worker's process has started and done its imports (its constructor ran), then
        rank 0's rendezvous address. The rendezvous (each rank's ``setup``, which waits up to
        supervisor.start_timeout_s for its peers) starts only then: on a loaded 2-core machine a fleet of
        eight new processes starts a few at a time, and rank 0, up first, once waited out its 60 s with 1
        of 8 peers joined (a CI run). Each rank through ``wait`` (a worker dead at birth is a typed failure,
        healed), bounded by the start-up timeout since the previous rank was up: a process starting and
        importing is not a hang, and neither is a fleet that keeps starting. Rank 0 is asked last, so
        that the free port it names is still free when its ``setup`` binds it."""
        address = None
        for rank in [*range(1, len(self.workers)), 0]:
            address = wait(
                [self.workers[rank].address.remote()],
                f"start of rank {rank}",
                timeout=start_s,
                hang_s=start_s + 1,
                ranks=[rank],
                hang_why=START_BOUND,
            )[0]
            touch()
        ip, port, _ = address
        return ip, port

    def _cfg_dict(self) -> dict:
        """The config workers get at setup: the run's, with the first fleet's measured peak FLOP/s."""
        cfg_dict = config_to_dict(self.cfg)
        cfg_dict["train"]["peak_flops"] = self.peak_flops
        return cfg_dict

    def ensure_spares(self) -> None:
        """Start the next set of warm spares in the background (after a chunk of training, so their
        start-up does not compete with a restore). On CPU (``supervisor.prepare_spares``) they are also
        prepared: they join a process group of their own and build their shards now (``setup``), so that
        a restart only restores the checkpoint into them. (A GPU spare gets its device, the failed
        worker's, only when it takes over: it stops at its imports.)"""
        if self.cfg.supervisor.warm_spares and not self.spares:
            self.spares = [self._new_worker(rank, spare=True) for rank in range(self.world)]
            self.spare_setup = []
            if self.data is not None and self.cfg.supervisor.prepare_spares and self.cfg.parallel.device == "cpu":
                # every spare's address, resolved by Ray before each setup runs: the rendezvous (spare rank 0
                # waits supervisor.start_timeout_s for its peers) starts once every spare is up, as in ``start``
                up = [s.address.remote() for s in self.spares]
                self.spare_setup = [
                    s.setup.remote(up[0], self.data, self._cfg_dict(), None, None, *up[1:]) for s in self.spares
                ]
            refs = self.spare_setup or [s.address.remote() for s in self.spares]
            threading.Thread(
                target=self._announce_spares, args=(refs, time.monotonic()), daemon=True, name="spares-ready"
            ).start()

    def _announce_spares(self, refs: list, t0: float) -> None:
        """``spares_ready`` once every spare of this set answers (``refs``: their addresses, or their
        setups when prepared), whether or not a restart has taken them meanwhile (benchmarks measure
        the steady state from there; nothing waits on it)."""
        if not self._all_answer(refs, extra_s=60):
            return  # not up in time, or a spare died: _take_spares discards them (a cold fleet starts)
        try:
            self.event(
                EventKind.SPARES_READY,
                spares=len(refs),
                seconds=round(time.monotonic() - t0, 2),
                prepared=isinstance(ray.get(refs[0]), WorkerInfo),
            )
        except ValueError:
            pass  # the run's records were closed meanwhile

    def _settle(self, ended: list) -> None:
        """Give the pool back the workers of ``ended`` it lent, on this node, that detach within 30 s; the
        others are killed with the fleet."""
        ids = {w._actor_id.hex() for w in self.lent}
        # only on the supervisor's own node (the driver's: the head for `ray job submit`): an idle process,
        # though it holds no resources, keeps an autoscaler from removing its node
        here = ray.get_runtime_context().get_node_id()
        nodes = {w._actor_id.hex(): i.node_id for w, i in zip(self.workers, self.infos)}
        mine = [w for w in ended if w._actor_id.hex() in ids and nodes.get(w._actor_id.hex()) == here]
        keep = []
        if mine:
            refs = [w.detach.remote() for w in mine]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
            for w, ref in zip(mine, refs):
                try:
                    if ref in ready and ray.get(ref):
                        keep.append(w)
                except ray.exceptions.RayError:
                    pass
        try:
            ray.get(self.pool.settle.remote(self.supervisor._actor_id.hex(), keep), timeout=30)
        except ray.exceptions.RayError:
            keep = []
        kept = {w._actor_id.hex() for w in keep}
        self.workers = [w for w in self.workers if w._actor_id.hex() not in kept]
        self.lent = []

    def kill_spares(self) -> None:
        for s in self.spares:
            ray.kill(s, no_restart=True)
        self.spares, self.spare_setup = [], []

    def stop_workers(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []

    def release(self, clean: bool = False) -> None:
        """Kill every worker and spare and return the placement group; after a ``clean`` end (finished
        or stopped) the pool's workers that detach from the run go back to it instead."""
        if self.pool is not None:
            self._settle(self.workers if clean else [])
        self.stop_workers()
        self.kill_spares()
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
