"""The mixture-of-experts feed-forward block (``model.moe_experts`` > 0), in plain torch.

A router scores every token against ``E`` routed experts and sends it to its top ``k`` (dropless: no
capacity factor, no token is dropped); the experts are SwiGLU MLPs held as 3-D weights, (E, F, D) for
the gate and up projections and (E, D, F) for the down projection (the layout of transformers 5's fused
experts and torchtitan's), computed for all experts at once with ``torch._grouped_mm`` over the tokens
sorted by expert. Optional shared experts every token passes through (Qwen2-MoE, DeepSeek), with
Qwen2-MoE's sigmoid gate on their output.

The router runs in fp32 (a bf16 gate flips near-tied choices: torchtitan #2389, Megatron's README).
Selection is over ``scores + expert_bias`` and the weights come from the unbiased scores (DeepSeek-V3's
auxiliary-loss-free balancing: the bias, a persistent fp32 buffer, steers choices only; the trainer moves
it after each step from the step's load, ``update_expert_bias``).

Load-balancing losses reach the gradients without touching the reported loss: each block attaches its
switch auxiliary loss and router z-loss to its output (``_AttachLoss``: the identity forward, the losses'
gradient added in backward, as Megatron-core's ``MoEAuxLossAutoScaler``), so they work the same under
gradient accumulation and on pipeline stages that never see the final loss. ``loss_scale`` is what the
trainer divides a micro-batch's loss by (1 under a pipeline schedule, which scales the gradients itself).

Every forward leaves its per-expert token counts and loss values in ``last`` (``RouterStats``), and
every training forward (not a recomputation under activation checkpointing) adds them to ``history``,
which the trainer takes after each step: a pipeline schedule runs a stage's micro-batches in its own
order. The module knows nothing about parallelism: expert parallelism
is applied from outside, and so is ``token_sum``, the sum over the ranks that hold the other tokens of a
micro-batch (context parallelism), with which the balancing loss stays the whole micro-batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raysc.config.schema import ModelConfig
from raysc.model.feed_forward import FeedForward


@dataclass
class RouterStats:
    """One forward's routing: tokens per expert (E,), and the unscaled auxiliary and z losses (detached)."""

    counts: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


class _AttachLoss(torch.autograd.Function):
    """``out`` unchanged; in backward, ``loss`` gets the gradient ``scale`` (d total / d loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape = loss.shape
        ctx.loss_dtype = loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad.device), None


def route_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """The router's per-expert scores from its logits: softmax over the experts, or each one's sigmoid."""
    return logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()


class Router(nn.Module):
    """Top-k token-choice routing: (weights (T, k) fp32, experts (T, k), logits (T, E) fp32, scores (T, E))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.score_func = cfg.moe_score_func
        self.norm_topk = cfg.moe_norm_topk_prob
        self.gate = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight.float())
        scores = route_scores(logits, self.score_func)
        _, experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        weights = scores.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts, logits, scores


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as 3-D weights, run with one grouped GEMM per projection."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w_down = nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (R, D): tokens sorted by expert, ``counts[e]`` of them for expert ``e``; -> (R, D)."""
        return grouped_swiglu(x, counts, self.w_gate, self.w_up, self.w_down)


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over tokens sorted by expert (``counts[e]`` rows for expert ``e``), one grouped GEMM
    per projection; the weights are (E, F, D), (E, F, D), (E, D, F)."""
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = torch._grouped_mm(x, w_gate.to(x.dtype).transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(x, w_up.to(x.dtype).transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w_down.to(x.dtype).transpose(-2, -1), offs=offs)


def expert_loop(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """What ``GroupedExperts.forward`` computes, one expert at a time (the reference its tests and
    ``benchmarks/moe.py`` compare against)."""
    outs = []
    for e, rows in enumerate(x.split(counts.tolist())):
        h = F.silu(rows @ experts.w_gate[e].to(x.dtype).T) * (rows @ experts.w_up[e].to(x.dtype).T)
        outs.append(h @ experts.w_down[e].to(x.dtype).T)
    return torch.cat(outs)


def switch_aux_loss(
    probs: torch.Tensor,
    experts: torch.Tensor,
    counts: torch.Tensor,
    total_counts: torch.Tensor | None = None,
    total_tokens: int | None = None,
) -> torch.Tensor:
    """The switch-transformer load-balancing loss of one layer, Megatron-core's form:
    ``E / (k·T²) · Σ_i P_i · c_i`` with ``P_i`` the sum over tokens of expert i's routing probability
    (``probs``: (T, E), each row summing to 1) and ``c_i`` its token count; 1.0 when the load is uniform.
    (transformers' ``load_balancing_loss_func`` counts ``c_i / T`` summing to k and pools the layers: k
    times this per layer.)

    When a micro-batch's tokens are split over ranks (context parallelism), the loss is the whole
    micro-batch's: ``total_counts`` and ``total_tokens`` are its counts and size, ``probs`` this rank's
    rows. The value returned is then ``T / T_r`` times this rank's share of ``Σ_i P_i · c_i`` (its
    gradient is this rank's part of the loss's, scaled as the rank's mean cross-entropy is: averaged
    over the ranks, as their gradients are, it is the whole loss)."""
    tokens, k = experts.shape
    total_counts = counts if total_counts is None else total_counts
    total_tokens = tokens if total_tokens is None else total_tokens
    return switch_from_sums(probs.sum(0), total_counts, k, tokens, total_tokens)


def switch_from_sums(prob_sums: torch.Tensor, counts: torch.Tensor, k: int, tokens: int, total_tokens: int):
    """``switch_aux_loss`` from its sums: ``E / (k·T_r·T) · Σ_i P_i · c_i`` (``T_r = T`` on one rank)."""
    return prob_sums.shape[-1] / (k * tokens * total_tokens) * (prob_sums * counts.to(prob_sums.dtype)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean squared log-sum-exp of the router logits."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.moe_experts
        self.top_k = cfg.moe_top_k
        self.score_func = cfg.moe_score_func
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.z_coeff = cfg.moe_z_loss_coeff
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.dim, cfg.moe_hidden_dim, cfg.moe_experts)
        shared = cfg.moe_shared_experts * cfg.moe_hidden_dim
        self.shared = FeedForward(cfg.dim, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if shared and cfg.moe_shared_expert_gate else None
        self.loss_scale = 1.0  # the trainer's: 1 / the micro-batches a step's loss is averaged over
        # set from outside when a micro-batch's tokens are split over ranks (context parallelism): sums a
        # tensor over those ranks, so that the balancing loss is the whole micro-batch's
        self.token_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.last: RouterStats | None = None  # the latest forward's
        self.history: list[RouterStats] = []  # every training forward's since the trainer last took them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, experts, logits, scores = self.router(flat)
        chosen = experts.flatten()
        counts = torch.bincount(chosen, minlength=self.num_experts)
        order = chosen.argsort(stable=True)
        tokens = order // self.top_k
        routed = self.experts(flat[tokens], counts)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, routed)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared
        # the router's scores as probabilities (sigmoid scores normalised over the experts, as Megatron-core)
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        if self.token_sum is None:
            aux = switch_aux_loss(probs, experts, counts)
            z = router_z_loss(logits)
            self.last = RouterStats(counts.detach(), aux.detach(), z.detach())
        else:
            aux, z = self._split_losses(probs, experts, counts, logits)
        # with gradients (not a pipeline stage's shape inference), outside backward: activation checkpointing runs
        # the forward again inside it (torch's own test of
        # "inside a backward pass", as torch.utils.checkpoint uses it)
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.history.append(self.last)
        if self.training and torch.is_grad_enabled() and (self.aux_coeff or self.z_coeff):
            out = _AttachLoss.apply(out, self.aux_coeff * aux + self.z_coeff * z, self.loss_scale)
        return out.view(shape)

    def _split_losses(
        self, probs: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The losses to attach when this rank holds part of the micro-batch's tokens (``token_sum``):
        the aux loss from the whole micro-batch's counts (``switch_aux_loss``) and this rank's mean
        z-loss (scaled as its cross-entropy is); ``last`` holds the whole micro-batch's values."""
        lse_sq = torch.logsumexp(logits, dim=-1).square()
        tokens = probs.shape[0]
        experts_n = counts.numel()
        local = [probs.sum(0).detach(), counts, lse_sq.sum().detach().view(1), counts.new_tensor([tokens])]
        total = self.token_sum(torch.cat([t.double() for t in local]))  # P_i, c_i, Σ lse², T of the micro-batch
        total_counts = total[experts_n : 2 * experts_n].round().long()
        total_tokens = int(total[-1])
        aux = switch_aux_loss(probs, experts, counts, total_counts, total_tokens)
        whole_aux = switch_from_sums(total[:experts_n], total_counts, experts.shape[1], total_tokens, total_tokens)
        whole_z = total[-2] / total_tokens
        self.last = RouterStats(counts.detach(), whole_aux.float(), whole_z.float())
        return aux, lse_sq.mean()


@torch.no_grad()
def update_expert_bias(router: Router, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's selection bias
    moves by ``rate`` toward balance (up when it got fewer tokens than the mean, down when more), the
    moves centred so that the biases do not drift together (torchtitan's form; Megatron-core leaves them
    uncentred). ``counts``: the step's tokens per expert over the whole data-parallel batch, so that every
    rank moves its copy of the bias the same way."""
    counts = counts.to(torch.float32)
    delta = rate * torch.sign(counts.mean() - counts)
    router.expert_bias.add_(delta - delta.mean())
