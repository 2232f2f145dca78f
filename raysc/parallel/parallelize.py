"""Build this rank's share of the model: pipeline split, then CP, TP/SP, EP, recompute and FSDP on each stage.

The model is built on the meta device and the plans are applied there, so no rank
ever holds the full model; ``materialise`` then allocates only this rank's tensors
and streams the one-process initialisation from ``train.seed`` into them, so each
shard starts from exactly the weights a single process would have; with ``model.init_from`` it
reads its blocks of a Hugging Face checkpoint instead (checked against the config first). The order
matters: TP turns weights into DTensors on the ``tp`` mesh, and FSDP then shards
those over the data-parallel mesh (2-D parallelism, as torchtitan composes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raysc.config.dims import ParallelDims
from raysc.config.schema import Config
from raysc.model.hf_checkpoint import HFCheckpoint
from raysc.model.hf_fetch import init_dir
from raysc.model.llama import Llama
from raysc.parallel.cp import apply_cp
from raysc.parallel.expert_parallel import expert_meshes, shard_experts
from raysc.parallel.fsdp import apply_fsdp, fsdp_mesh
from raysc.parallel.materialise import init_order, materialise
from raysc.parallel.pp import build_stages
from raysc.parallel.recompute import apply_recompute
from raysc.parallel.tp import apply_tp


@dataclass
class ModelShard:
    parts: list[nn.Module]  # one module per pipeline stage this rank holds (one without PP)
    stage_ids: list[int]
    num_stages: int

    def state_module(self) -> nn.Module:
        """One module with every parameter this rank holds under its full-model name
        (``layers.7.attn.wq.weight``), so checkpoints do not depend on the pipeline split."""
        if len(self.parts) == 1:
            return self.parts[0]
        view = nn.Module()
        view.layers = nn.ModuleDict({k: v for part in self.parts for k, v in part.layers.items()})
        for end in ("embed", "norm", "output"):
            mods = [getattr(p, end) for p in self.parts if getattr(p, end) is not None]
            if mods:
                setattr(view, end, mods[0])
        return view

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def build_model_shard(
    cfg: Config, dims: ParallelDims, rank: int, mesh, device: torch.device, bf16: bool, init_weights: bool = True
) -> ModelShard:
    """This rank's shard of the model, initialised as ``materialise`` says; ``init_weights=False``
    leaves the parameters allocated but undrawn (a peer heal copies them in from a replica)."""
    with torch.device("meta"):
        full = Llama(cfg.model, cfg.rope_len)
    order = init_order(full)
    source = None
    if cfg.model.init_from and init_weights:
        source = HFCheckpoint(init_dir(cfg.model.init_from, cfg.model.init_from_options, cfg.data.cache_dir), cfg.model)
        source.check(order)
    parts, ids, num_stages = _plan_meta(full, cfg, dims, rank, mesh, device, bf16)
    materialise(parts, order, cfg.model, cfg.train.seed, device, source, init_weights)
    return ModelShard(parts, ids, num_stages)


def _plan_meta(
    full: Llama, cfg: Config, dims: ParallelDims, rank: int, mesh, device: torch.device, bf16: bool
) -> tuple[list[nn.Module], list[int], int]:
    """Apply the pipeline split, CP, TP/SP, EP, recompute and FSDP to the meta model ``full``."""
    if dims.world_size == 1:
        apply_recompute(full, cfg.parallel.recompute)
        return [full], [0], 1
    c = dims.coords(rank)
    virtual = cfg.parallel.pp_virtual_stages if dims.pp > 1 else 1
    if dims.pp > 1:
        parts, ids = build_stages(full, c["pp"], dims.pp, virtual)
    else:
        parts, ids = [full], [0]
    dp_mesh = fsdp_mesh(mesh, dims)
    ep = cfg.parallel.ep
    # the routed experts' DTensor mesh (ep, tp or both) and, under EP, the mesh of their own FSDP unit
    experts_weights, experts_mesh = (mesh["tp"] if dims.tp > 1 else None), None
    if ep > 1:
        _, experts_weights, experts_mesh = expert_meshes(mesh, dims, ep)
    for part in parts:
        if dims.cp > 1:
            apply_cp(part, mesh["cp"].get_group(), c["cp"], dims.cp, cfg.train.seq_len, device)
        if dims.tp > 1:
            apply_tp(part, mesh["tp"], cfg.parallel.sequence_parallel)
        if experts_weights is not None:
            shard_experts(part, experts_weights, ep=ep > 1, tp=dims.tp > 1)
        apply_recompute(part, cfg.parallel.recompute)  # inside FSDP's per-block wrapping, as torchtitan orders it
        if dp_mesh is not None:
            apply_fsdp(part, dp_mesh, bf16, reshard_after_forward=dims.pp == 1, experts_mesh=experts_mesh)
    return parts, ids, dims.pp * virtual
