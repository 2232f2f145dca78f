"""What a worker measures for the pre-flight checklist: collective bandwidth per parallel group
and the node's topology (runs inside ``TrainWorker.probe`` on every rank at once).

Bandwidths follow nccl-tests' definitions (``doc/PERFORMANCE.md``): algorithm bandwidth
``algbw = S / t`` for a buffer of ``S`` bytes, bus bandwidth ``busbw = algbw × 2(n−1)/n`` for
all-reduce and ``algbw × (n−1)/n`` for all-gather and reduce-scatter (``S`` = the gathered /
scattered whole), ``busbw = algbw`` for point-to-point. Each figure is the median of 5 timed
operations after a warm-up. Every rank walks the groups in the same order, so the collectives
of one mesh dimension run in all its groups at once, as in training.

It sits in train, beside the worker's other measurements (``memory``, ``throughput``), so the
worker never imports the pre-flight package that reads these figures.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from raysc.config.dims import DIM_NAMES

GROUP_ORDER = tuple(reversed(DIM_NAMES))  # innermost (fastest-varying, most local) group first


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def _timed(fn, buf: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        fn()
        _sync(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def group_bandwidth(
    mesh, sizes: dict[str, int], nbytes: int, device: torch.device, iters: int = 5, ep_group=None
) -> list[dict]:
    """Bus bandwidth of all-reduce, all-gather, reduce-scatter (and P2P for pp) on each group; with
    ``ep_group`` (a mixture of experts' expert-parallel group), its all-to-all's too."""
    out = []
    for name in GROUP_ORDER:
        n = sizes.get(name, 1)
        if n < 2 or mesh is None:
            continue
        out.append(_group_row(name, n, mesh[name].get_group(), nbytes, device, iters))
    if ep_group is not None:
        out.append(_all_to_all_row(ep_group, nbytes, device, iters))
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()} for row in out]


def _all_to_all_row(group, nbytes: int, device: torch.device, iters: int) -> dict:
    """The EP group's all-to-all (even splits, what a balanced router sends): nccl-tests' alltoall
    bus bandwidth, ``algbw × (n−1)/n`` with ``S`` the bytes each rank sends in all."""
    n = dist.get_world_size(group)
    elems = max(n, nbytes // 4 // n * n)
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    recv = torch.empty_like(buf)
    t = _timed(lambda: dist.all_to_all_single(recv, buf, group=group), buf, iters)
    return {"group": "ep", "size": n, "bytes": elems * 4, "all_to_all_busbw_gbps": elems * 4 / t * (n - 1) / n / 1e9}


def _group_row(name: str, n: int, group, nbytes: int, device: torch.device, iters: int) -> dict:
    """One group's bus bandwidths (collective over ``group``)."""
    elems = max(n, nbytes // 4 // n * n)
    buf = torch.ones(elems, dtype=torch.float32, device=device)
    size = elems * 4
    shard = torch.empty(elems // n, dtype=torch.float32, device=device)
    row = {"group": name, "size": n, "bytes": size}
    t = _timed(lambda: dist.all_reduce(buf, group=group), buf, iters)
    row["all_reduce_busbw_gbps"] = size / t * 2 * (n - 1) / n / 1e9
    t = _timed(lambda: dist.all_gather_into_tensor(buf, shard, group=group), buf, iters)
    row["all_gather_busbw_gbps"] = size / t * (n - 1) / n / 1e9
    t = _timed(lambda: dist.reduce_scatter_tensor(shard, buf, group=group), buf, iters)
    row["reduce_scatter_busbw_gbps"] = size / t * (n - 1) / n / 1e9
    if name == "pp":
        me = dist.get_group_rank(group, dist.get_rank())
        nxt = dist.get_global_rank(group, (me + 1) % n)
        prv = dist.get_global_rank(group, (me - 1) % n)
        recv = torch.empty_like(buf)

        def p2p() -> None:
            for req in dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, buf, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
            ):
                req.wait()

        t = _timed(p2p, buf, iters)
        row["p2p_busbw_gbps"] = size / t / 1e9
    return row


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def node_topology(device: torch.device) -> dict:
    """Devices on this node and what the platform reports about links and ECC (None where it does not)."""
    info: dict = {"device_type": device.type}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["node_gpus"] = _run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"])
        info["topo"] = _run(["nvidia-smi", "topo", "-m"])
        info["ecc"] = _run(
            [
                "nvidia-smi",
                "--query-gpu=index,ecc.mode.current,ecc.errors.uncorrected.volatile.total",
                "--format=csv,noheader",
            ]
        )
    else:
        info["topo"] = None
        info["ecc"] = None  # CPUs' ECC state is not visible to an unprivileged process
    return info
