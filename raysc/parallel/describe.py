"""What a rank built for its layout, read back from the objects themselves (the ``layout`` event).

The config says which layout was asked for; this says what the rank holds after the plans
ran: its pipeline stages and the schedule object driving them, the DTensor placement of two
weights of its first block (a column-parallel projection and a norm: sharded by TP/FSDP, and
replicated over the TP mesh only under sequence parallelism) and of its first experts (over the
``ep`` mesh under expert parallelism), the attention kernel (context
parallelism swaps it) and whether the blocks recompute their forward. A plan that silently
did nothing shows up here even when the numbers still match single-process training.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from raysc.model.moe import GroupedExperts
from raysc.parallel.parallelize import ModelShard
from raysc.parallel.recompute import is_recomputed


def placement(p: nn.Parameter) -> str:
    """'plain' for a local tensor, else each mesh dim with its placement: 'tp:S(0)'."""
    if not isinstance(p, DTensor):
        return "plain"
    names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
    return " ".join(f"{n}:{pl}" for n, pl in zip(names, p.placements))


def describe_shard(shard: ModelShard, schedule: object | None) -> dict:
    """This rank's stages, schedule class, sample placements, attention kernel and recompute."""
    out: dict = {
        "stages": list(shard.stage_ids),
        "num_stages": shard.num_stages,
        "schedule": type(schedule).__name__ if schedule is not None else None,
    }
    block = next(iter(shard.parts[0].layers.values()), None)
    if block is not None:
        out["placements"] = {
            "attn.wq.weight": placement(block.attn.wq.weight),
            "attn_norm.weight": placement(block.attn_norm.weight),
        }
        kernel = block.attn.core_attention
        out["attention"] = getattr(kernel, "__name__", type(kernel).__name__)
        out["recompute"] = is_recomputed(block)
    blocks = [b for part in shard.parts for b in part.layers.values()]
    experts = next((m for b in blocks for m in b.modules() if isinstance(m, GroupedExperts)), None)
    if experts is not None:  # a mixture of experts: sharded over the EP mesh under expert parallelism
        out["placements"]["experts.w_gate"] = placement(experts.w_gate)
    return out
