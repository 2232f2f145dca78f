"""Context parallelism: exact causal attention over a sequence split across ``cp`` ranks.

torch's context parallelism needs CUDA kernels (it patches SDPA's flash/efficient
backends), so raysc has its own, built only on ``all_gather`` and SDPA with an
explicit mask, which runs on CPU (gloo) and GPU (NCCL) alike.

Load balancing: the sequence is cut into ``2·cp`` equal chunks and rank ``r``
holds chunks ``r`` and ``2·cp − 1 − r`` — an early and a late one — so every rank
does the same amount of causal-attention work. Each rank computes q, k, v for
its own tokens; keys and values are all-gathered (the backward pass
reduce-scatters their gradients back), reassembled in sequence order, and
every local query attends to the keys at positions ≤ its own. The result is
identical to full attention. Rotary embeddings use each token's absolute
position (``Llama.positions``). With document masking the model builds the block-causal mask of
its local queries over the whole row (``raysc.model.documents``) and the kernel uses it instead.

A mixture of experts routes each token where it is; its load-balancing loss is over the whole
micro-batch, so each MoE block's ``token_sum`` sums its routing statistics over the CP group
(``raysc.model.moe``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raysc.model.moe import MoEFeedForward


class _GatherChunks(torch.autograd.Function):
    """All-gather along the sequence dim (2) with a reduce-scatter backward.

    Written here because ``torch.distributed.nn.functional.all_gather``'s gloo
    backward passes group ranks where global ranks are expected and fails on any
    subgroup (e.g. the CP group of a cp×tp mesh). gloo has no reduce-scatter, so
    its backward all-reduces and keeps the local slice.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        n, me = dist.get_world_size(group), dist.get_rank(group)
        chunks = list(grad.contiguous().chunk(n, dim=2))
        if dist.get_backend(group) == dist.Backend.GLOO:
            full = grad.contiguous().clone()
            dist.all_reduce(full, group=group)
            return full.chunk(n, dim=2)[me].contiguous(), None
        out = torch.empty_like(chunks[me])
        dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=group)
        return out, None


def chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Absolute positions of the tokens this rank holds (two chunks, in order)."""
    c = seq_len // (2 * cp)
    a, b = chunk_ids(cp_rank, cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of ``x`` along dim 1."""
    return x[:, local_positions(x.shape[1], cp_rank, cp).to(x.device)]


class ContextParallelAttention:
    """Replaces ``Attention.core_attention``: gathers k/v over the CP group, masks by position."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, seq_len: int, device: torch.device):
        self.group, self.cp = group, cp
        q_pos = local_positions(seq_len, cp_rank, cp).to(device)
        # order of the gathered chunks: rank r contributes chunks (r, 2cp-1-r)
        gathered = torch.cat([local_positions(seq_len, r, cp) for r in range(cp)]).to(device)
        self.order = torch.argsort(gathered)
        self.mask = q_pos[:, None] >= torch.arange(seq_len, device=device)[None, :]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask``: the model's block-causal mask for these queries over the whole row, when documents
        are masked (``raysc.model.documents``), else this rank's causal mask by position."""
        k = _GatherChunks.apply(k, self.group)[:, :, self.order]
        v = _GatherChunks.apply(v, self.group)[:, :, self.order]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask if mask is None else mask, scale=scale
        )  # μP passes 1/head_dim


def apply_cp(
    model: nn.Module, group: dist.ProcessGroup, cp_rank: int, cp: int, seq_len: int, device: torch.device
) -> None:
    kernel = ContextParallelAttention(group, cp_rank, cp, seq_len, device)
    for block in model.layers.values():
        block.attn.core_attention = kernel
    model.positions = local_positions(seq_len, cp_rank, cp).to(device)
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.token_sum = functools.partial(_sum_over, group=group)


def _sum_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` summed over ``group`` (a new tensor; no gradient flows through it)."""
    total = t.detach().clone()
    dist.all_reduce(total, group=group)
    return total
