"""Expert parallelism (``parallel.ep``): the routed experts of each MoE block split over ``ep`` ranks,
tokens sent to their experts' ranks and back by all-to-all.

EP is carved from ``dp_shard`` (torchtitan carves it from ``dp_shard × cp``; raysc keeps the CP ranks of
a sequence outside the EP group): the dense mesh's ``dp_shard`` dim is unflattened into ``(efsdp, ep)``, ``ep`` varying fastest, so an EP
group is ``ep`` consecutive FSDP ranks (one node, as a TP group, when the bundles are packed node by
node). The expert weights (E, F, D) become DTensors ``Shard(0)`` on ``ep``: rank ``i`` of a group
holds experts ``[i·E/ep, (i+1)·E/ep)``, and FSDP shards them further over ``efsdp`` (times ``cp``: the
ranks of a sequence hold the same weights, as for the dense ones) and replicates them over ``dp_replicate``, as their own FSDP unit (``apply_fsdp``'s ``experts_mesh``). Checkpoints see
the full (E, F, D) tensors, so DCP reshards them across EP sizes.

The model's ``MoEFeedForward`` is unchanged: it routes, sorts its tokens by expert and calls its
``GroupedExperts`` with the sorted tokens and the count per expert. ``apply_ep`` turns that module into
an ``ExpertParallelExperts`` (the class swap FSDP2 itself does), whose forward:

1. exchanges the counts (``all_to_all_single``: how many rows each rank sends each of my experts);
2. sends each rank the rows for its experts (``all_to_all_single`` with those uneven splits, through
   torch's functional collectives, whose backward is the reverse exchange);
3. orders the received rows by local expert (they arrive by source rank) and runs the local experts
   with one grouped GEMM per projection (``grouped_swiglu``, the dense path's kernel);
4. puts the rows back in arrival order and returns them by the reverse all-to-all.

A rank's rows come back in the order it sent them, so the block combines them as on one rank.

The expert gradients: a rank holding expert ``e`` receives the gradients of every token of its EP
group, each scaled by its own rank's loss (the mean over that rank's batch); FSDP then averages over
``dp_replicate × efsdp``, not over all ``dp`` ranks. Summed over the EP group and averaged over the
rest is ``ep`` times the data-parallel mean (the "expert gradients doubled at EP=2" of Megatron's and
DeepSpeed's issues), so the weights enter the GEMM through ``_ScaleGrad`` (identity forward, gradient
times ``1/ep``): exact for a power of two, and independent of how FSDP divides.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from raysc.config.dims import ParallelDims
from raysc.model.moe import GroupedExperts, grouped_swiglu

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


def expert_meshes(mesh: DeviceMesh, dims: ParallelDims, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """The ``ep`` mesh (the EP group) and the mesh the experts' FSDP runs over (``efsdp``, times ``cp``
    when the sequence is split: context-parallel ranks hold the same weights; with ``dp_replicate`` as
    HSDP's replicate dim when there are replicas), from the dense mesh ``mesh``."""
    split = mesh._unflatten("dp_shard", (dims.dp_shard // ep, ep), ("efsdp", "ep"))
    shard = split[("efsdp", "cp")]._flatten("efsdp_cp") if dims.cp > 1 else split["efsdp"]
    # a flattened dim cannot be sliced together with others: HSDP's 2-D mesh is put together instead
    fsdp = split._concatenate([split["dp_replicate"], shard]) if dims.dp_replicate > 1 else shard
    return split["ep"], fsdp


class _ScaleGrad(torch.autograd.Function):
    """``w`` unchanged; its gradient times ``scale``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """``received`` (ep, El): rows from each source rank for each local expert, in arrival order (by
    source, then expert). The arrival index of each row in expert-major order (by expert, then source)."""
    flat = received.flatten()
    arrival_start = (torch.cumsum(flat, 0) - flat).view_as(received).t().flatten()
    by_expert = received.t().flatten()
    new_start = torch.cumsum(by_expert, 0) - by_expert
    rows = torch.arange(int(flat.sum()), device=received.device)
    return rows + torch.repeat_interleave(arrival_start - new_start, by_expert)


class ExpertParallelExperts(GroupedExperts):
    """``GroupedExperts`` whose weights are this rank's experts of an EP group; tokens travel by all-to-all."""

    ep_group: dist.ProcessGroup
    ep: int

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (R, D): this rank's tokens sorted by (global) expert, ``counts`` (E,) per expert; -> (R, D)."""
        ep, group = self.ep, self.ep_group
        local_experts = counts.numel() // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, local_experts)  # [source, local expert]
        send = counts.view(ep, local_experts).sum(1).tolist()
        recv = received.sum(1).tolist()
        rows = all_to_all_single_autograd(x, recv, send, group)
        order = expert_major(received)
        weights = [_ScaleGrad.apply(_local(getattr(self, n)), 1.0 / ep) for n in EXPERT_WEIGHTS]
        out = grouped_swiglu(rows[order], received.sum(0), *weights)
        back = out.new_empty(out.shape).index_copy(0, order, out)  # arrival order again
        return all_to_all_single_autograd(back, send, recv, group)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of ``w``: the local tensor of the EP DTensor (FSDP has gathered ``efsdp``)."""
    return w.to_local() if isinstance(w, DTensor) else w


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[GroupedExperts]:
    """Shard every ``GroupedExperts`` of ``model`` over ``ep_mesh`` (``Shard(0)``: experts) and make it
    dispatch by all-to-all. Returns the modules, for FSDP to wrap on the experts' mesh."""
    found = [m for m in model.modules() if type(m) is GroupedExperts]
    for module in found:
        for name in EXPERT_WEIGHTS:
            w = getattr(module, name)
            module.register_parameter(
                name,
                nn.Parameter(
                    distribute_tensor(w.data, ep_mesh, [Shard(0)], src_data_rank=None), requires_grad=w.requires_grad
                ),
            )
        module.__class__ = ExpertParallelExperts
        module.ep_group = ep_mesh.get_group()
        module.ep = ep_mesh.size()
    return found
