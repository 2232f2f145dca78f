"""``Fleet``: the workers of a run, from their start to their release.

It starts ``TrainWorker`` actors in the bundles that ``Placement`` (``placement.py``) reserves, or
lent by the cluster's worker pool, forms their process group, replaces them (re-reserving after a
node loss or away from quarantined nodes), and stops and releases them. ``WarmSpares``
(``spares.py``) keeps the replacement workers that take over the bundles of a failed fleet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raysc.config.load import config_to_dict
from raysc.config.schema import Config
from raysc.fleet.events import EventKind
from raysc.fleet.messages import WorkerInfo
from raysc.fleet.placement import Placement
from raysc.fleet.spares import WarmSpares
from raysc.fleet.start_bound import START_BOUND, start_bound_s
from raysc.fleet.worker import TrainWorker
from raysc.parallel.dims import rank_table


class Fleet:
    def __init__(self, cfg: Config, run_dir: Path, event: Callable[..., dict], supervisor) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.event = event
        self.supervisor = supervisor  # the actor handle workers report to
        self.placement = Placement(cfg, run_dir, event)  # the placement group and the quarantine
        self.workers: list = []
        self.train_calls: list | None = (
            None  # the ranks' calls of the chunk of steps under way (a peer heal drains them)
        )
        self.warm_spares = WarmSpares(cfg, event, partial(self._new_worker, spare=True))
        self.data: dict | None = None  # the run's data (object refs) the workers set up with
        self.infos: list[WorkerInfo] = []
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

    # ---- placement (``Placement``) ----
    def reserve(self, timeout_s: float | None = None) -> None:
        """``Placement.reserve``: one bundle per rank, away from quarantined nodes when the cluster allows."""
        self.placement.reserve(timeout_s)

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
        if not self.placement.needs_new_group(node_lost):
            return
        self.kill_spares()
        self.placement.rereserve(self.cfg.supervisor.node_wait_s if node_lost else None)

    def quarantine_rank(self, rank: int, why: str) -> None:
        """Record the node of ``rank`` as suspect: later placements avoid it when the cluster has
        other nodes (``quarantine.json`` in the run directory lists them)."""
        self.placement.quarantine_rank(rank, self.infos[rank], why)

    def quarantined_nodes(self) -> list[str]:
        return self.placement.quarantined_nodes()

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
                self.placement.pg, placement_group_bundle_index=self.placement.bundles[rank]
            ),
        ).remote(config_to_dict(self.cfg), rank, self.world, self.supervisor)

    def replacements(self, ranks: list[int]) -> tuple[dict[int, object], list[int]]:
        """Workers to replace ``ranks`` alone (a peer heal): the warm spare in each one's bundle when it
        answers, else a new worker there; and the ranks that got a spare."""
        spares = self.warm_spares.take_some(ranks)
        return {r: spares.get(r) or self._new_worker(r) for r in ranks}, sorted(spares)

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

            table = placement_group_table(self.placement.pg).get("bundles_to_node_id", {})
            self.pool = self.pool or worker_pool(idle_s)
            if self.pool is not None and len(table) == self.world:
                try:
                    lent = ray.get(
                        self.pool.lend.remote(
                            [table[self.placement.bundles[r]] for r in range(self.world)], self.supervisor, idle_s
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
        cfg_dict = self.cfg_dict()
        spares, prepared = (self.warm_spares.take(cfg_dict) if warm else None) or (None, None)
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
        dims, ep = self.cfg.parallel.dims, self.cfg.parallel.ep
        self.event(
            EventKind.LAYOUT,
            layout=dims.describe(),
            world_size=dims.world_size,
            **({"ep": ep} if ep > 1 else {}),  # expert-parallel groups, carved from dp_shard
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

    def cfg_dict(self) -> dict:
        """The config workers get at setup: the run's, with the first fleet's measured peak FLOP/s."""
        cfg_dict = config_to_dict(self.cfg)
        cfg_dict["train"]["peak_flops"] = self.peak_flops
        return cfg_dict

    def ensure_spares(self) -> None:
        """Start the next set of warm spares in the background (after a chunk of training, so their
        start-up does not compete with a restore): ``WarmSpares.ensure``, prepared on CPU."""
        self.warm_spares.ensure(self.data, self.cfg_dict)

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
        self.warm_spares.kill()

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
        self.placement.remove()
