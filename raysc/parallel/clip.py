"""Gradient norm and clipping over every shard of every stage.

``torch.nn.utils.clip_grad_norm_`` cannot mix plain tensors with DTensors on
different meshes, and knows nothing of pipeline stages, so the total norm is
assembled here, with one reduction per mesh dimension rather than one per parameter:
each local gradient's squared norm (the unpadded local shard of a DTensor) is added to
the entry of its placement kind — the set of named mesh dims it is sharded over
(``()`` for a plain or fully replicated tensor). The entries form one small vector; for
each mesh dim in a fixed (sorted) order one ``all_reduce`` over that dim's group sums
the entries sharded over it, and every other entry keeps its own value (replicated copies
count once). The vector's sum is then summed over the pipeline group.

The other entries are kept as they are, not passed through the reduction as the group's
first rank's value: under expert parallelism two kinds overlap (the experts are sharded
over ``efsdp`` × ``ep``, which split ``dp_shard``, while the dense weights are sharded
over ``dp_shard_cp``), and the ranks of the ``dp_shard_cp`` group hold different experts.
Passing the expert entry through that group as its first rank's value counted that
rank's experts ``ep`` times and the others' never (a grad norm 1.7e-4 off at ep=2).

Every rank gets the same global norm and applies the same clip factor as single-process
training. A gradient with a ``Partial``
placement (a pending sum, not a shard) is reduced on its own with ``full_tensor``.

Every rank holds parameters of the same kinds (the same keys), so all ranks build vectors of
the same shape and issue the same reductions in the same order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial


def _kind(g: DTensor) -> tuple[tuple[str, dist.ProcessGroup], ...] | None:
    """The named mesh dims ``g`` is sharded over with their groups; None with a ``Partial`` placement."""
    if any(isinstance(p, Partial) for p in g.placements):
        return None
    mesh = g.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    # sharded: any placement but Replicate (a Shard, or the _StridedShard FSDP puts on a TP-sharded dim)
    return tuple(sorted((names[i], mesh.get_group(i)) for i, p in enumerate(g.placements) if not p.is_replicate()))


@torch.no_grad()
def global_grad_norm(params: list[torch.Tensor], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    sums: dict[tuple[str, ...], torch.Tensor] = {}
    groups: dict[str, dist.ProcessGroup] = {}
    total = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        kind = _kind(g) if isinstance(g, DTensor) else ()
        if kind is None:
            total += torch.linalg.vector_norm(g, dtype=torch.float32).full_tensor() ** 2
            continue
        local = g.to_local() if isinstance(g, DTensor) else g
        key = tuple(name for name, _ in kind)
        groups.update(kind)
        n = torch.linalg.vector_norm(local, dtype=torch.float32)
        sums[key] = sums[key] + n * n if key in sums else n * n
    keys = sorted(sums)
    if keys:
        vec = torch.stack([sums[k] for k in keys])
        for name in sorted(groups):
            sharded = torch.tensor([name in k for k in keys], device=device)
            part = torch.where(sharded, vec, torch.zeros_like(vec))  # an inf stays inf, not 0·inf
            dist.all_reduce(part, group=groups[name])
            vec = torch.where(sharded, part, vec)
        total += vec.sum()
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0/inf: measure only)."""
    norm = global_grad_norm(params, pp_group)
    if max_norm and math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype) if not isinstance(p.grad, DTensor) else coef.item())
    return norm
