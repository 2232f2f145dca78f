"""What a worker process must forget before it serves another run (``raysc.fleet.pool``): torch's
process-wide caches. Imports torch; only worker processes import it."""

from __future__ import annotations

import functools
import sys

import torch


def forget_rank_caches() -> None:
    """Empty torch's process-wide caches before this process serves another run, maybe as another rank.

    torch assumes a process keeps one rank: DTensor caches redistribution plans (with this rank's shard
    shapes) and sharding decisions keyed by device mesh, whose equality ignores the process's rank, so a
    process that was rank 0 would reuse rank 0's plans as rank 1 (found: a DCP save of a dp_shard=2 run
    in swapped processes failed its global-plan check). Every ``functools`` cache of torch.distributed's
    modules (and their classes) is cleared, the per-thread sharding cache is replaced, and dynamo's
    compiled code (``train.compile``) is dropped (a run's blocks would count toward its recompile limit).
    """
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            for obj in [value, *(vars(value).values() if isinstance(value, type) else ())]:
                obj = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
                if isinstance(obj, functools._lru_cache_wrapper):  # what @cache and @lru_cache make
                    obj.cache_clear()
    dispatch = sys.modules.get("torch.distributed.tensor._api")
    if dispatch is not None:
        from torch.distributed.tensor._sharding_prop import LocalLRUCache

        prop = dispatch.DTensor._op_dispatcher.sharding_propagator
        prop.propagate_op_sharding = LocalLRUCache(prop.propagate_op_sharding_non_cached)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
