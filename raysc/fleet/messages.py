"""Typed messages from workers to the supervisor (Ray pickles dataclasses like any value)."""

from __future__ import annotations

from dataclasses import dataclass, field

REPORT_EVERY_S = 1.0  # rank 0 sends its step metrics to the supervisor at most this often


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's answer to ``setup``: where it runs and what it built."""

    rank: int
    pid: int
    node: str  # node IP
    node_id: str  # Ray node id (quarantine is by node id)
    replicas: bool  # whether another rank holds a replica of this rank's parameters (SDC checks)
    gpu_ids: list  # the devices Ray gave it (a warm spare takes them over)
    coords: dict  # this rank's coordinate in each parallel dimension
    threads: int
    device: str
    peak_flops: float
    setup_s: dict  # seconds per setup phase: process group, data, model, checkpoint group
    built: dict = field(default_factory=dict)  # what the plans built (raysc.parallel.describe)
    master: tuple = ()  # (IP, port) of the rendezvous it joined
