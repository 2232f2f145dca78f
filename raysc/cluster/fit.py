"""Whether the connected Ray cluster can hold a command's actors: one rule for every command that
places them (a training fleet: ``raysc train``, ``raysc preflight``'s probe, ``raysc parity``, each
proxy of ``raysc mix tune``; ``raysc curate``'s perplexity scorers).

A request that the alive nodes cannot hold by their *total* resources (not what is free now: a run
may wait for another to finish) either stops at once or is waited for:
- on a Ray instance this process started (``ray.init()`` with no address: a laptop, a CI machine),
  nothing can add a node, so the command stops before any work with ``ClusterTooSmall``, naming
  what it needs, what the nodes have and the setting that fixes it;
- on a joined cluster an autoscaler may add nodes, so the command says what it waits for and the
  fleet waits up to ``supervisor.start_timeout_s`` (its error then names the same numbers).

Ray has no public call for "this cluster can grow"; whether this process started the instance is
read from Ray's driver node (``ray._private.worker._global_node.head``), and an instance joined by
address counts as one that may grow.
"""

from __future__ import annotations

from collections.abc import Callable

from raysc.config.schema import ParallelConfig


class ClusterTooSmall(RuntimeError):
    """The cluster can never hold the request; the message names need, have and the fix."""


def worker_bundle(par: ParallelConfig) -> dict[str, float]:
    """The resources of one training worker: ``parallel.cpus_per_worker`` CPUs, and a GPU on cuda."""
    bundle = {"CPU": float(par.cpus_per_worker)}
    if par.device == "cuda":
        bundle["GPU"] = 1.0
    return bundle


def workers_fit(resources: dict[str, float], bundle: dict[str, float]) -> int:
    """How many ``bundle`` workers a node with total ``resources`` holds."""
    return min(int(resources.get(r, 0) // need) for r, need in bundle.items())


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of each alive node of the connected cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def describe_nodes(nodes: list[dict[str, float]]) -> str:
    """``2 node(s): 8 CPU, 4 CPU + 1 GPU``, for an error message."""
    sizes = [f"{n.get('CPU', 0):g} CPU" + (f" + {n['GPU']:g} GPU" if n.get("GPU") else "") for n in nodes]
    return f"{len(nodes)} node(s): {', '.join(sizes) or 'none'}"


def started_here() -> bool:
    """Whether this process started the Ray instance it is connected to (so no autoscaler adds nodes)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return bool(getattr(node, "head", False))


def shortfall(bundle: dict[str, float], count: int, nodes: list[dict[str, float]]) -> str:
    """'' when ``nodes`` hold ``count`` workers of ``bundle``; else what is missing, in words."""
    held = sum(workers_fit(n, bundle) for n in nodes)
    if held >= count:
        return ""
    total = {r: sum(n.get(r, 0) for n in nodes) for r in bundle}
    need = ", ".join(f"{count * v:g} {r}" for r, v in bundle.items())
    have = ", ".join(f"{total[r]:g} {r}" for r in bundle)
    return (
        f"{count} actor(s) of {_bundle_text(bundle)} ({need} in all), but the cluster's "
        f"{describe_nodes(nodes)} hold {held} (in all {have})"
    )


def _bundle_text(bundle: dict[str, float]) -> str:
    return " + ".join(f"{v:g} {r}" for r, v in bundle.items())


def require_fleet_fit(what: str, par: ParallelConfig, count: int, log: Callable[[str], None] = print) -> None:
    """``require_fit`` for ``count`` training workers of ``par``'s size, with the parallel.* fixes."""
    fixes = [f"lower parallel.cpus_per_worker (now {par.cpus_per_worker:g})"] if par.cpus_per_worker > 1 else []
    if par.device == "cuda":
        fixes.append("set parallel.device=cpu to run on CPUs")
    if count > 1:
        fixes.append(f"use a layout of fewer workers (parallel.*: now {count})")
    require_fit(what, worker_bundle(par), count, fixes, log)


def require_fit(
    what: str, bundle: dict[str, float], count: int, fixes: list[str], log: Callable[[str], None] = print
) -> None:
    """Stop (``ClusterTooSmall``) when the connected cluster can never hold ``count`` actors of
    ``bundle`` and nothing can add nodes, naming ``fixes``; say what it waits for when something may."""
    missing = shortfall(bundle, count, alive_nodes())
    if not missing:
        return
    if started_here():
        raise ClusterTooSmall(
            f"{what} needs {missing}. This command started its own local Ray, which no "
            f"autoscaler grows: {'; or '.join(fixes)}; or start a cluster with room and set "
            f"RAY_ADDRESS to it (`raysc cluster local up`, `ray up cluster.yaml`)."
        )
    log(
        f"[raysc] {what} needs {missing}: waiting for the cluster to add nodes (up to "
        f"supervisor.start_timeout_s for a training fleet); otherwise {'; or '.join(fixes) or 'add nodes'}"
    )
