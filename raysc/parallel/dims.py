"""Parallel degrees, rank coordinates and the named device mesh.

Ranks are laid out row-major over the dims ``(pp, dp_replicate, dp_shard, cp, tp)``:
``tp`` varies fastest, so a TP group is a run of consecutive ranks (and, with
one bundle per rank packed node by node, lives on one node), then CP, then the
data-parallel dims, and PP varies slowest, crossing nodes last.

The mesh is built once per worker with ``init_device_mesh`` and these names;
flattened views (``dp`` = dp_replicate×dp_shard for the data loader,
``dp_shard_cp`` = dp_shard×cp for FSDP) are made here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.schema import ParallelConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def from_config(cls, par: ParallelConfig) -> "ParallelDims":
        return cls(par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard parameters with FSDP: dp_shard × cp (CP ranks hold the same weights)."""
        return self.dp_shard * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (row-major over DIM_NAMES)."""
        out = {}
        for name, size in zip(reversed(DIM_NAMES), reversed(self.shape)):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in zip(DIM_NAMES, self.shape) if s > 1) or "single worker"


def rank_table(dims: ParallelDims, nodes: list[str]) -> str:
    """The rank → (pp, dp, cp, tp) → node table printed at start."""
    lines = ["rank  pp  dp_rep  dp_shard  cp  tp  node"]
    for r in range(dims.world_size):
        c = dims.coords(r)
        lines.append(f"{r:4d}  {c['pp']:2d}  {c['dp_replicate']:6d}  {c['dp_shard']:8d}  {c['cp']:2d}  "
                     f"{c['tp']:2d}  {nodes[r] if r < len(nodes) else '?'}")
    return "\n".join(lines)


def build_mesh(dims: ParallelDims, device_type: str):
    """The named N-D device mesh with the flattened ``dp`` and ``dp_shard_cp`` dims."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=DIM_NAMES)
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
    return mesh
