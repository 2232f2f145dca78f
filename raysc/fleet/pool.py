"""``WorkerPool``: worker processes past their imports, kept idle between runs on one cluster.

Most of a rank's start is its process's: Python, Ray, then torch and raysc's training modules
(about 2 s of CPU per rank on this project's 2-core machine; 4 or 8 ranks to a node queue for the
cores). A CPU run's ranks are lent by this pool: a process a finished run gave back (its process
groups destroyed, its model and threads gone: ``RankWorker.detach``) for the same global rank on the
same node, or, when there is none idle, a new one the pool starts. The run's placement group still reserves each rank's CPUs; the
pooled processes hold no resources of their own (as warm spares do), pinned to their node.

- One pool per cluster and code: a detached actor named after a fingerprint of raysc's source
  files, the Python, Ray's version and the job's runtime environment, so a changed checkout or
  environment never reuses a process that imported the old one.
- ``supervisor.worker_pool_idle_s`` bounds idleness: a process idle that long is stopped, and the
  pool stops itself once it has held nothing for that long (0: runs start their own processes).
- Only processes on the supervisor's node (the driver's: the head for ``ray job submit``) are kept:
  an idle process holds no resources, yet Ray's autoscaler does not remove a node that runs one.
- A worker goes back only from a run that ended cleanly (finished or stopped) and on the CPU; a
  worker of a failed run, or one that touched a GPU (its CUDA context holds device memory), is
  killed. When a run's supervisor dies without giving its workers back (its driver was killed),
  the pool finds it dead within ``_CHECK_S`` and kills what it lent.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysc.fleet.worker import TrainWorker

POOL_NAMESPACE = "raysc"
MAX_IDLE_PER_RANK = 2  # idle processes kept for one rank on one node (each holds torch's imports: ~300 MB)
_CHECK_S = 2.0  # the reaper's period


def pool_name() -> str:
    """The pool of this code and environment: raysc's source files (paths, sizes, mtimes), the
    interpreter, Ray's version and the job's runtime environment."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    env = ray.get_runtime_context().runtime_env
    h.update(json.dumps([sys.executable, ray.__version__, dict(env or {})], sort_keys=True, default=str).encode())
    return f"raysc-worker-pool-{h.hexdigest()[:12]}"


def worker_pool(idle_s: float):
    """The cluster's pool for this code (started on this node, the supervisor's, when there is none: not
    on a node an autoscaler may remove); None when it cannot be reached."""
    try:
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return WorkerPool.options(
            name=pool_name(),
            namespace=POOL_NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=here,
        ).remote(idle_s)
    except (ray.exceptions.RayError, ValueError):
        return None


@ray.remote(num_cpus=0, max_concurrency=4)
class WorkerPool:
    def __init__(self, idle_s: float) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[object, float]]] = {}  # (node id, rank) -> (worker, idle since)
        self._by_supervisor: dict[str, list[tuple[object, str, int]]] = {}  # supervisor id -> (worker, node, rank) lent
        self._supervisors: dict[str, object] = {}
        self._idle_s = idle_s
        self._touched = time.monotonic()
        self._reused = 0
        threading.Thread(target=self._reap, daemon=True, name="pool-reaper").start()

    def lend(self, node_ids: list[str], supervisor, idle_s: float) -> list[tuple[object, bool]]:
        """A worker for each rank of ``supervisor``'s run, on the node given for it in ``node_ids``:
        (worker, whether it ran a run before). A process only ever serves one global rank (torch keeps
        rank-dependent caches keyed by device mesh, whose equality ignores the process's rank: a process
        that was rank 0 failed a DCP save as rank 1). New ones start pinned to their node, with no
        resources."""
        sup_id = supervisor._actor_id.hex()
        out = []
        with self._lock:
            self._idle_s = idle_s
            self._touched = time.monotonic()
            for rank, node in enumerate(node_ids):
                idle = self._idle.get((node, rank))
                if idle:
                    worker, reused = idle.pop()[0], True
                    self._reused += 1
                else:
                    worker, reused = (
                        TrainWorker.options(
                            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                        ).remote(),
                        False,
                    )
                self._by_supervisor.setdefault(sup_id, []).append((worker, node, rank))
                out.append((worker, reused))
            self._supervisors[sup_id] = supervisor
        return out

    def settle(self, supervisor_id: str, keep: list) -> int:
        """The run of ``supervisor_id`` ended: ``keep`` (detached workers it lent) go idle, the rest of
        what it lent is forgotten (the run killed them). How many are idle now."""
        keep_ids = {w._actor_id.hex() for w in keep}
        now = time.monotonic()
        with self._lock:
            self._touched = now
            self._supervisors.pop(supervisor_id, None)
            for worker, node, rank in self._by_supervisor.pop(supervisor_id, []):
                if worker._actor_id.hex() not in keep_ids:
                    continue
                idle = self._idle.setdefault((node, rank), [])
                if len(idle) < MAX_IDLE_PER_RANK:
                    idle.append((worker, now))
                else:
                    ray.kill(worker, no_restart=True)
            return sum(len(v) for v in self._idle.values())

    def stats(self) -> dict:
        """Idle workers per node, lent ones, and how many lends reused a process."""
        with self._lock:
            return {
                "idle": {f"{n}:{r}": len(v) for (n, r), v in self._idle.items() if v},
                "lent": sum(len(v) for v in self._by_supervisor.values()),
                "reused": self._reused,
                "idle_s": self._idle_s,
            }

    def idle_workers(self) -> list:
        with self._lock:
            return [w for v in self._idle.values() for w, _ in v]

    # ---- the reaper ----
    def _reap(self) -> None:
        while True:
            time.sleep(_CHECK_S)
            self._reap_dead_lenders()
            with self._lock:
                now = time.monotonic()
                for idle in self._idle.values():
                    for worker, since in [e for e in idle if now - e[1] > self._idle_s]:
                        ray.kill(worker, no_restart=True)
                        idle.remove((worker, since))
                empty = not any(self._idle.values()) and not self._by_supervisor
                if empty and now - self._touched > self._idle_s:
                    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                    return

    def _reap_dead_lenders(self) -> None:
        """Kill what was lent to a supervisor that is gone without settling (its driver was killed)."""
        with self._lock:
            sups = dict(self._supervisors)
        for sup_id, sup in sups.items():
            try:
                ray.get(sup.__ray_ready__.remote(), timeout=_CHECK_S)
                continue
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not dead
            except ray.exceptions.RayError:
                pass
            with self._lock:
                self._supervisors.pop(sup_id, None)
                for worker, *_ in self._by_supervisor.pop(sup_id, []):
                    ray.kill(worker, no_restart=True)
