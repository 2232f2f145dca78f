"""FSDP2 (``fully_shard``) over the data-parallel dims.

Parameters are sharded over ``dp_shard × cp`` (context-parallel ranks hold the
same weights, so they share the sharding, as in torchtitan); with
``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP: shard inside a
replica group, all-reduce across groups. ``dp_shard = cp = 1`` with
``dp_replicate > 1`` is plain data parallelism (replicate, all-reduce grads).
Each block is its own FSDP unit so its parameters are gathered just in time. With expert
parallelism a block's experts are a unit of their own, sharded over ``efsdp`` (the FSDP ranks of
other EP groups holding the same experts) and replicated over ``dp_replicate``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raysc.config.dims import ParallelDims
from raysc.parallel.expert_parallel import ShardedExperts


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh | None:
    if dims.dp_replicate * dims.fsdp_size == 1:
        return None
    if dims.dp_replicate > 1:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp_shard_cp"]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    bf16: bool,
    reshard_after_forward: bool,
    experts_mesh: DeviceMesh | None = None,
) -> None:
    """Each block an FSDP unit over ``dp_mesh``; with expert parallelism, each block's experts (EP
    DTensors) a unit of their own over ``experts_mesh`` first (``raysc.parallel.expert_parallel``)."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        if experts_mesh is not None:
            for experts in [m for m in block.modules() if isinstance(m, ShardedExperts)]:
                fully_shard(experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
