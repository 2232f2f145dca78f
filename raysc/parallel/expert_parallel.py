"""The routed experts of each MoE block sharded from outside the model: split over ``ep`` ranks by expert
(expert parallelism, ``parallel.ep``: tokens sent to their experts' ranks and back by all-to-all) and,
under tensor parallelism, each expert's hidden dim split over the ``tp`` ranks.

EP is carved from ``dp_shard`` (torchtitan carves it from ``dp_shard × cp``; raysc keeps the CP ranks
of a sequence outside the EP group): the dense mesh's ``dp_shard`` dim is unflattened into
``(efsdp, ep)``, ``ep`` varying fastest, so an EP group is ``ep`` consecutive FSDP ranks (one node, as a
TP group, when the bundles are packed node by node). The expert weights (E, F, D) become DTensors
``Shard(0)`` on ``ep``: rank ``i`` of a group holds experts ``[i·E/ep, (i+1)·E/ep)``, and FSDP shards
them further over ``efsdp`` (times ``cp``: the ranks of a sequence hold the same weights, as for the
dense ones) and replicates them over ``dp_replicate``, as their own FSDP unit (``apply_fsdp``'s
``experts_mesh``). Checkpoints see the full (E, F, D) tensors, so DCP reshards them across EP sizes.

The model's ``MoEFeedForward`` is unchanged: it routes, sorts its tokens by expert and calls its
``GroupedExperts`` with the sorted tokens and the count per expert. ``shard_experts`` turns that module
into a ``ShardedExperts`` (the class swap FSDP2 itself does), whose forward under EP:

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

Under TP every rank of a TP group holds the block's whole input (sequence parallelism gathers it
first, ``raysc.parallel.tp``) and routes it the same way; each expert's gate and up projections are
split over the group by rows of F (``Shard(1)``) and its down projection by columns (``Shard(2)``), on
the ``(ep, tp)`` mesh with EP. Each rank computes its share of every routed row and the shares are
summed (Megatron's column- then row-parallel MLP, per expert): ``_ToTensorParallel`` on the way in (its
backward sums the input's gradient over the group) and ``_FromTensorParallel`` on the way out (the
all-reduce; its backward passes the gradient through). torch has these two only inside DTensor, which
``torch._grouped_mm`` does not take, so they are written here.
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


def expert_meshes(mesh: DeviceMesh, dims: ParallelDims, ep: int) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """From the dense mesh ``mesh``: the ``ep`` mesh (the EP group), the mesh of the expert weights'
    DTensors (``ep``, or ``(ep, tp)`` under TP) and the mesh the experts' FSDP runs over (``efsdp``, times
    ``cp`` when the sequence is split: context-parallel ranks hold the same weights; with
    ``dp_replicate`` as HSDP's replicate dim when there are replicas)."""
    split = mesh._unflatten("dp_shard", (dims.dp_shard // ep, ep), ("efsdp", "ep"))
    shard = split[("efsdp", "cp")]._flatten("efsdp_cp") if dims.cp > 1 else split["efsdp"]
    # a flattened dim cannot be sliced together with others: HSDP's 2-D mesh is put together instead
    fsdp = split._concatenate([split["dp_replicate"], shard]) if dims.dp_replicate > 1 else shard
    weights = split[("ep", "tp")] if dims.tp > 1 else split["ep"]
    return split["ep"], weights, fsdp


class _ScaleGrad(torch.autograd.Function):
    """``w`` unchanged; its gradient times ``scale``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _ToTensorParallel(torch.autograd.Function):
    """``x`` unchanged (every TP rank holds it); its gradient, each rank's share, summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _FromTensorParallel(torch.autograd.Function):
    """Each TP rank's share of ``x`` summed over ``group``; the gradient, the same on every rank, passes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """``received`` (ep, El): rows from each source rank for each local expert, in arrival order (by
    source, then expert). The arrival index of each row in expert-major order (by expert, then source)."""
    flat = received.flatten()
    arrival_start = (torch.cumsum(flat, 0) - flat).view_as(received).t().flatten()
    by_expert = received.t().flatten()
    new_start = torch.cumsum(by_expert, 0) - by_expert
    rows = torch.arange(int(flat.sum()), device=received.device)
    return rows + torch.repeat_interleave(arrival_start - new_start, by_expert)


class ShardedExperts(GroupedExperts):
    """``GroupedExperts`` whose weights are this rank's experts of an EP group (tokens travel by
    all-to-all) and, under TP, this rank's share of each expert's hidden dim."""

    ep_group: dist.ProcessGroup | None
    ep: int
    tp_group: dist.ProcessGroup | None

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (R, D): this rank's tokens sorted by (global) expert, ``counts`` (E,) per expert; -> (R, D)."""
        if self.tp_group is not None:
            x = _ToTensorParallel.apply(x, self.tp_group)
        if self.ep_group is None:
            out = grouped_swiglu(x, counts, *[_local(getattr(self, n)) for n in EXPERT_WEIGHTS])
        else:
            out = self._dispatch(x, counts)
        if self.tp_group is not None:
            out = _FromTensorParallel.apply(out, self.tp_group)
        return out

    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The rows to their experts' ranks, through the local experts, and back (steps 1-4 above)."""
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
    """This rank's share of ``w``: the local tensor of the EP/TP DTensor (FSDP has gathered ``efsdp``)."""
    return w.to_local() if isinstance(w, DTensor) else w


# each weight's hidden dim F (gate and up: (E, F, D); down: (E, D, F)), split over the TP ranks
HIDDEN_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}


def shard_experts(model: nn.Module, weights_mesh: DeviceMesh, ep: bool, tp: bool) -> list[GroupedExperts]:
    """Shard every ``GroupedExperts`` of ``model`` over ``weights_mesh``: by expert over its ``ep`` dim
    (``Shard(0)``, tokens dispatched by all-to-all) when ``ep``, by hidden dim over its ``tp`` dim when
    ``tp``. Returns the modules, for FSDP to wrap on the experts' mesh under EP."""
    found = [m for m in model.modules() if type(m) is GroupedExperts]
    for module in found:
        for name in EXPERT_WEIGHTS:
            w = getattr(module, name)
            placements = ([Shard(0)] if ep else []) + ([Shard(HIDDEN_DIM[name])] if tp else [])
            sharded = distribute_tensor(w.data, weights_mesh, placements, src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=w.requires_grad))
        module.__class__ = ShardedExperts
        module.ep_group = weights_mesh["ep"].get_group() if ep else None
        module.ep = weights_mesh["ep"].size() if ep else 1
        module.tp_group = weights_mesh["tp"].get_group() if tp else None
    return found
