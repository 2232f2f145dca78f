"""``Elastic``: the data-parallel size of an elastic run (``parallel.elastic``), and its growth request.

The size is ``parallel.<elastic_dim>`` in the run's ``cfg``, which the supervisor, ``Fleet`` (its
``world``), ``Healer`` and ``CheckpointCoordinator`` share: ``resize`` changes it there, and the next
fleet is built at that size. What a size may be (``sizes``): from ``parallel.min_dp`` to the configured
size, those that split the global batch into whole micro-batches of the configured layout's size. The
per-forward micro-batch never changes (``train.micro_batch`` is pinned to the configured local batch,
the pipeline's microbatch count scales), so a smaller fleet accumulates more micro-batches: the global
batch, the learning-rate schedule and the data order (``raysc.data.loader``: a function of the global
cursor only) are the run's own at every size, and checkpoints reshard on load (``raysc.checkpoint``).

While the run is below its configured size it keeps a *growth request*: a placement group of the
missing workers' bundles, left pending. A pending placement group is the resource demand Ray's
autoscaler launches nodes for, and Ray places it as soon as a returning node has room; once it is
placed, the supervisor grows the fleet at its next checkpoint boundary (``grow_ready``). The request
is for the whole configured size (a partial return does not grow the run: one request, not one per
size, so an autoscaler is never asked for more than the run can use).
"""

from __future__ import annotations

from raysc.cluster.fit import workers_fit
from raysc.config.checks import ConfigError
from raysc.config.faults import parse_faults
from raysc.config.schema import Config


def configured_sizes(cfg: Config, full: int | None = None) -> list[int]:
    """The sizes of ``parallel.elastic_dim`` an elastic run may take, largest first (``full``: the
    configured size, when ``cfg`` has been resized since)."""
    par, gb = cfg.parallel, cfg.train.global_batch_sequences
    full = full or getattr(par, par.elastic_dim)
    other = par.dp // getattr(par, par.elastic_dim)
    micro = cfg.parallel.micro_batch(cfg.train.global_batch_sequences, cfg.train.micro_batch)
    out = []
    for size in range(full, par.min_dp - 1, -1):
        dp = other * size
        if gb % dp == 0 and (gb // dp) % micro == 0:
            out.append(size)
    return out


def min_world(cfg: Config) -> int:
    """The fewest workers the run can train with: the whole layout unless it is elastic."""
    par = cfg.parallel
    if not par.elastic:
        return par.world_size
    sizes = configured_sizes(cfg)
    return par.world_size // getattr(par, par.elastic_dim) * (sizes[-1] if sizes else getattr(par, par.elastic_dim))


class Elastic:
    """An elastic run's size rules, its current size and its growth request (``None``: not elastic)."""

    def __init__(self, cfg: Config) -> None:
        par = cfg.parallel
        self.cfg = cfg
        self.dim = par.elastic_dim
        self.full = getattr(par, self.dim)
        self.micro = cfg.parallel.micro_batch(cfg.train.global_batch_sequences, cfg.train.micro_batch)
        self.sizes = configured_sizes(cfg)
        self.request = None  # the pending placement group of the missing workers
        self._placed = None  # the object ref that resolves once ``request`` is placed
        self._pp_micro = par.pp_microbatches or par.pp
        for f in parse_faults(cfg.supervisor.inject):
            if f.rank >= par.world_size:
                raise ConfigError(
                    f"supervisor.inject: rank {f.rank} in {f.spec!r} does not exist (world size "
                    f"{par.world_size} at the configured size; name a rank below it)."
                )
        if par.pp == 1:
            cfg.train.micro_batch = self.micro  # pinned: a smaller fleet accumulates, never grows its forward

    @property
    def size(self) -> int:
        return getattr(self.cfg.parallel, self.dim)

    def world(self, size: int) -> int:
        return self.cfg.parallel.world_size // self.size * size

    def resize(self, size: int) -> None:
        """Make ``size`` the run's size (the next fleet's): ``parallel.<dim>`` and, under pipeline
        parallelism, the microbatch count that keeps each microbatch at the configured size."""
        par = self.cfg.parallel
        setattr(par, self.dim, size)
        if par.pp > 1:
            par.pp_microbatches = self._pp_micro * self.full // size

    def largest_fitting(self, below: int | None = None) -> int | None:
        """The largest allowed size (smaller than ``below`` when given) whose workers the alive nodes
        hold by their total resources; None when not even ``parallel.min_dp`` fits."""
        import ray

        from raysc.cluster.fit import worker_bundle

        bundle = worker_bundle(self.cfg.parallel)
        held = sum(workers_fit(n["Resources"], bundle) for n in ray.nodes() if n.get("Alive"))
        return next((s for s in self.sizes if (below is None or s < below) and self.world(s) <= held), None)

    # ---- the growth request ----
    def request_growth(self) -> None:
        """Below the configured size: ask for the missing workers' bundles (a pending placement
        group: the autoscaler's demand, placed when a node returns). No-op at full size."""
        if self.size >= self.full or self.request is not None:
            return
        from ray.util.placement_group import placement_group

        from raysc.cluster.fit import worker_bundle
        from raysc.fleet.groups import group_name

        bundle = worker_bundle(self.cfg.parallel)
        missing = self.world(self.full) - self.world(self.size)
        self.request = placement_group([dict(bundle) for _ in range(missing)], strategy="PACK", name=group_name("grow"))
        self._placed = self.request.ready()

    def grow_ready(self) -> bool:
        """Whether the growth request is placed: the cluster holds the configured size again.

        One ``ready()`` per request, asked once: each ``ready()`` is a new asynchronous question to the
        GCS, whose answer never arrives within a ``timeout=0`` wait, so asking anew at every checkpoint
        boundary saw a placed request only by chance (an elastic run stayed small for minutes)."""
        if self._placed is None:
            return False
        import ray

        ready, _ = ray.wait([self._placed], timeout=0)
        return bool(ready)

    def cancel(self) -> None:
        """Drop the growth request (before the fleet takes its room, and when the run ends)."""
        if self.request is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.request)
            self.request = self._placed = None
