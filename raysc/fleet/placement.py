"""``Placement``: where a run's workers go.

It reserves the fleet's placement group (one bundle per rank, ranks of a TP×CP group on one node
when the node has room), checks ``parallel.tp_within_node`` against the alive nodes, and keeps the
quarantine of suspect nodes (``quarantine.json`` in the run directory) that later reservations avoid
while the cluster's other alive nodes can hold the whole fleet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from raysc.cluster.fit import alive_nodes, describe_nodes, worker_bundle, workers_fit
from raysc.config.schema import Config
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.groups import group_name
from raysc.fleet.messages import WorkerInfo


class Placement:
    """The fleet's placement group (``pg``), each rank's bundle in it (``bundles``) and the
    quarantine (node id -> why)."""

    def __init__(self, cfg: Config, run_dir: Path, event: Callable[..., dict]) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.event = event
        self.pg = None
        self.bundles: list[int] = []  # bundle index of each rank
        self.quarantine: dict[str, dict] = {}  # node id -> why

    @property
    def world(self) -> int:
        return self.cfg.parallel.world_size

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

    def needs_new_group(self, node_lost: bool) -> bool:
        """Whether a restart must re-reserve the placement group: after a node loss, or when a
        bundle sits on a quarantined node that can be avoided (one that cannot is reported,
        ``quarantine_ignored``, and kept)."""
        on_quarantined = set(placement_group_table(self.pg).get("bundles_to_node_id", {}).values()) & set(
            self.quarantine
        )
        if not node_lost and not on_quarantined:
            return False
        if not node_lost and not self._avoid_nodes(self._bundle()):
            self._quarantine_ignored()
            return False
        return True

    def rereserve(self, timeout_s: float | None) -> None:
        """Return the placement group and reserve a new one (``reserve``)."""
        remove_placement_group(self.pg)
        self.pg = None
        self.reserve(timeout_s)

    def remove(self) -> None:
        """Return the placement group, if one is held."""
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def _quarantine_ignored(self) -> None:
        self.event(
            EventKind.QUARANTINE_IGNORED,
            nodes=self.quarantined_nodes(),
            note="the nodes outside the quarantine cannot hold the fleet; placing workers on quarantined nodes too",
        )

    def quarantine_rank(self, rank: int, info: WorkerInfo, why: str) -> None:
        """Record the node of ``rank`` (``info``, its worker's) as suspect: later placements avoid it
        when the cluster has other nodes (``quarantine.json`` in the run directory lists them)."""
        self.quarantine[info.node_id] = {"node": info.node, "rank": rank, "reason": why, "time": time.time()}
        (self.run_dir / "quarantine.json").write_text(json.dumps(self.quarantine, indent=1))
        self.event(EventKind.NODE_QUARANTINED, rank=rank, node=info.node, node_id=info.node_id, reason=why)

    def quarantined_nodes(self) -> list[str]:
        return sorted(q["node"] for q in self.quarantine.values())
