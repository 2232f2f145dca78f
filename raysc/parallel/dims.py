"""The named device mesh of a ``ParallelDims`` layout and the rank table printed at start.

The degrees, their order and each rank's coordinates come from ``raysc.config.dims``: ranks
are laid out row-major over ``(pp, dp_replicate, dp_shard, cp, tp)``, so ``tp`` varies
fastest (a TP group is a run of consecutive ranks and, with one bundle per rank packed node
by node, lives on one node), then CP, then the data-parallel dims, and PP varies slowest,
crossing nodes last.

The mesh is built once per worker with ``init_device_mesh`` and these names; its three
flattened views are made here, in one place: ``dp`` = dp_replicate×dp_shard (the data
loader's ranks), ``dp_shard_cp`` = dp_shard×cp (the FSDP shard group) and ``dp_cp`` =
dp_replicate×dp_shard×cp (every rank holding the same tensor and pipeline shard).
"""

from __future__ import annotations

from raysc.config.dims import DIM_NAMES, ParallelDims


def rank_table(dims: ParallelDims, nodes: list[str]) -> str:
    """The rank → (pp, dp, cp, tp) → node table printed at start."""
    lines = ["rank  pp  dp_rep  dp_shard  cp  tp  node"]
    for r in range(dims.world_size):
        c = dims.coords(r)
        lines.append(
            f"{r:4d}  {c['pp']:2d}  {c['dp_replicate']:6d}  {c['dp_shard']:8d}  {c['cp']:2d}  "
            f"{c['tp']:2d}  {nodes[r] if r < len(nodes) else '?'}"
        )
    return "\n".join(lines)


def build_mesh(dims: ParallelDims, device_type: str):
    """The named N-D device mesh with the flattened ``dp``, ``dp_shard_cp`` and ``dp_cp`` dims."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=DIM_NAMES)
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
    return mesh
