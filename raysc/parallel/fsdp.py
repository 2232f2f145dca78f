"""FSDP2 (``fully_shard``) over the data-parallel dims.

Parameters are sharded over ``dp_shard × cp`` (context-parallel ranks hold the
same weights, so they share the sharding, as in torchtitan); with
``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP: shard inside a
replica group, all-reduce across groups. ``dp_shard = cp = 1`` with
``dp_replicate > 1`` is plain data parallelism (replicate, all-reduce grads).
Each block is its own FSDP unit so its parameters are gathered just in time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from raysc.config.dims import ParallelDims


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh | None:
    if dims.dp_replicate * dims.fsdp_size == 1:
        return None
    if dims.dp_replicate > 1:
        return mesh[("dp_replicate", "dp_shard_cp")]
    return mesh["dp_shard_cp"]


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, bf16: bool, reshard_after_forward: bool) -> None:
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
