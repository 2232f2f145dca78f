"""Whether a serve deployment fits the Ray cluster it lands on, and the CPU shares that make it fit.

Ray Serve LLM places each replica as a placement group of its engine's bundles, with the replica's
own actor (``LLMServer``, 1 CPU by default) merged into the first bundle, and adds an OpenAI ingress
deployment of 1 CPU. On a 2-CPU laptop the engine and its replica actor take both CPUs and the
ingress never schedules: Serve only logs it every 30 s, and ``raysc serve`` never answered. The
replica actor and the ingress only relay requests (asyncio); the engine does the work. So when the
defaults do not fit, both get an equal share of what the engines leave (at least ``MIN_SHARE``
CPU each), and when even that does not fit, ``ServeDoesNotFit`` names what is needed against what
the cluster has and the settings that change it, before anything is deployed. (Ray computes none
of this up front: a request that cannot be placed just waits.)
"""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.serve_schema import ServeConfig

DEFAULT_SHARE = 1.0  # Ray Serve's CPUs for the replica actor and for the ingress
MIN_SHARE = 0.1


class ServeDoesNotFit(ValueError):
    """The deployment needs more than the cluster has; the message says what and how to fix it."""


class ServeNotReady(RuntimeError):
    """The application did not answer within ``serve.ready_timeout_s``; what was deployed is removed."""


@dataclass(frozen=True)
class ServeFit:
    replicas: int  # replicas placed at start
    engine_cpus: float  # per replica, every rank's bundle
    engine_gpus: float
    share: float  # CPUs of each replica actor and of the ingress

    @property
    def cpus(self) -> float:
        return round(self.replicas * (self.engine_cpus + self.share) + self.share, 4)

    @property
    def shrunk(self) -> bool:
        return self.share < DEFAULT_SHARE

    def describe(self) -> str:
        return (
            f"{self.replicas} replica(s) × ({self.engine_cpus:g} CPU engine + {self.share:g} CPU replica actor) "
            f"+ {self.share:g} CPU ingress = {self.cpus:g} CPU"
            + (f", {self.replicas * self.engine_gpus:g} GPU" if self.engine_gpus else "")
        )


def fit(
    cfg: ServeConfig, cluster_cpus: float, cluster_gpus: float = 0.0, largest_node_cpus: float | None = None
) -> ServeFit:
    """The shares that fit ``cfg`` onto a cluster of ``cluster_cpus`` (its largest node
    ``largest_node_cpus``: a replica's first bundle, engine rank and replica actor, is on one node)."""
    ranks = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    replicas = max(1, cfg.autoscale_min if cfg.autoscale_max else cfg.replicas)
    engine_cpus, engine_gpus = cfg.cpus_per_replica * ranks, cfg.gpus_per_replica * ranks
    largest = cluster_cpus if largest_node_cpus is None else largest_node_cpus
    spare = cluster_cpus - replicas * engine_cpus
    share = min(DEFAULT_SHARE, spare / (replicas + 1), largest - cfg.cpus_per_replica)
    share = int(share * 100) / 100  # Ray's resource granularity is finer; whole hundredths read better
    chosen = ServeFit(replicas, engine_cpus, engine_gpus, max(share, MIN_SHARE))
    if share < MIN_SHARE or replicas * engine_gpus > cluster_gpus:
        least = ServeFit(replicas, engine_cpus, engine_gpus, MIN_SHARE)
        has = f"{cluster_cpus:g} CPU (largest node {largest:g})" + (f", {cluster_gpus:g} GPU" if engine_gpus else "")
        raise ServeDoesNotFit(
            f"raysc serve needs at least {least.describe()}; the cluster has {has}. Lower serve.cpus_per_replica, "
            f"serve.replicas (or serve.autoscale_min) or serve.tensor_parallel_size, or add nodes "
            f"(`ray up cluster.yaml`, or RAY_ADDRESS of a bigger cluster)."
        )
    return chosen
