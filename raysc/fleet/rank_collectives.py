"""One rank's collective measurements, for ``RankWorker`` (``raysc.fleet.rank``): the all-reduce time
that calibrates the timeouts (``raysc.fleet.timeouts``), the process-group timeout itself, the
pre-flight probe (bus bandwidth per parallel group and the node's topology) and the stress test under
load. Every function but ``set_timeout`` is collective: every rank must call it. This module imports
torch; only the worker processes import it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from raysc.train.trainer import Trainer


def grad_sized(trainer: Trainer) -> torch.Tensor:
    """A buffer the size of the largest rank's gradient shard (capped at 64 MB); collective,
    since every rank must all-reduce the same shape (pipeline stages and shards differ)."""
    n = torch.tensor([sum(p.numel() for p in trainer.replicas.params)], device=trainer.device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return torch.ones(min(int(n.item()), 16 << 20), dtype=torch.float32, device=trainer.device)


def measure_collectives(trainer: Trainer, iters: int = 5) -> dict:
    """Median time of an all-reduce of this rank's gradient size over all ranks (collective)."""
    buf = grad_sized(trainer)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        if buf.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # the first one warms up
    return {"allreduce_s": times[len(times) // 2], "bytes": buf.numel() * 4}


def probe(trainer: Trainer, rank: int, nbytes: int, training: threading.Lock) -> dict:
    """Pre-flight measurements on this rank (collective: every rank must call it): bus bandwidth
    per parallel group and the node's topology (``raysc.train.probe``), the bandwidth measured under
    ``training`` (the rank's lock held while it trains)."""
    from raysc.parallel.expert_parallel import ShardedExperts
    from raysc.train.probe import group_bandwidth, node_topology

    dims = trainer.dims
    sizes = dims.as_dict()
    experts = [m for part in trainer.model_parts for m in part.modules() if isinstance(m, ShardedExperts)]
    ep_group = experts[0].ep_group if experts else None  # every MoE layer's is the same group
    with training:
        bandwidth = group_bandwidth(trainer.mesh, sizes, nbytes, trainer.device, ep_group=ep_group)
    return {
        "rank": rank,
        "coords": dims.coords(rank),
        "node": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "bandwidth": bandwidth,
        "topology": node_topology(trainer.device),
    }


def set_timeout(seconds: float, keep: dist.ProcessGroup | None) -> None:
    """The process-group timeout of every group this rank is in (the default group and each mesh
    group) but ``keep`` (the checkpoint group, which keeps its own, longer one)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    for g in list(dist.distributed_c10d._world.pg_map):  # every group this rank is in
        if g is not keep:
            _set_pg_timeout(timedelta(seconds=seconds), g)


def stress(trainer: Trainer, world_size: int, seconds: float) -> dict:
    """All-reduce and all-gather back to back for ``seconds`` while a thread keeps a core busy
    (load), under the calibrated timeout: counts operations, the slowest, and any timeout."""
    buf = grad_sized(trainer)
    stop = threading.Event()

    def burn() -> None:
        x = torch.randn(256, 256)
        while not stop.is_set():
            x = (x @ x).clamp_(-1, 1)

    burner = threading.Thread(target=burn, daemon=True)
    burner.start()
    ops, slowest, error = 0, 0.0, None
    t_end = time.monotonic() + seconds
    try:
        while True:
            go = torch.tensor([1 if time.monotonic() < t_end else 0], device=buf.device)
            dist.all_reduce(go, op=dist.ReduceOp.MIN)  # every rank runs the same number of rounds
            if not go.item():
                break
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            gathered = [torch.empty(1024, device=buf.device) for _ in range(world_size)]
            dist.all_gather(gathered, buf[:1024])
            slowest = max(slowest, time.perf_counter() - t0)
            ops += 2
    except RuntimeError as e:  # a collective that exceeded the process-group timeout
        error = str(e).splitlines()[0]
    finally:
        stop.set()
        burner.join()
    return {"ops": ops, "slowest_s": slowest, "timeouts": int(error is not None), "error": error}
