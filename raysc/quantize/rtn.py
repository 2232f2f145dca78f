"""The integer grid every method quantizes onto, and round-to-nearest (RTN), the baseline.

A linear's weight ``W`` (out, in) is cut along its input dimension into groups of ``group_size``
columns (``-1``: one group per output channel). Each (row, group) has a ``scale`` and, when
asymmetric, a ``zero`` point. Codes are signed, as compressed-tensors stores them before packing:
``q = clamp(round(w / scale) + zero, -2**(bits-1), 2**(bits-1) - 1)`` and ``w ≈ (q - zero) * scale``.

- symmetric: ``scale = 2·max|w| / (2**bits - 1)``, ``zero = 0`` (GPTQ's symmetric grid: the unsigned
  code ``q + 2**(bits-1)`` is centred on the middle of the range);
- asymmetric: ``scale = (max - min) / (2**bits - 1)`` over ``[min(w, 0), max(w, 0)]``, ``zero`` the
  signed code of 0.0.

RTN is that grid applied to every weight independently; GPTQ and AWQ choose what goes onto it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantSpec:
    """``bits`` per weight, ``group_size`` input columns per scale (-1: per output channel)."""

    bits: int
    group_size: int
    symmetric: bool = True

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups(self, in_features: int) -> int:
        """How many groups an input dimension of ``in_features`` has; fails naming the fix."""
        if self.group_size == -1:
            return 1
        if in_features % self.group_size:
            fits = [g for g in (256, 128, 64, 32, 16) if in_features % g == 0]
            raise ValueError(
                f"group size {self.group_size} does not divide a layer's {in_features} input "
                f"features; pass --group-size {fits[0] if fits else -1}"
                + (f" (sizes that fit: {fits})" if fits else " (per channel)")
            )
        return in_features // self.group_size

    def width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass
class QLinear:
    """One quantized linear: signed ``codes`` (out, in) int8, ``scale`` (out, groups), ``zero``
    (out, groups) int8 or None (symmetric); ``perm``: GPTQ's activation order (columns in the order
    they were quantized) when it used one. Groups are always contiguous input columns in the
    original order (act-order with static groups), so no group index is needed to read it."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    spec: QuantSpec
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.zero, self.spec)


def grid_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of ``w`` (rows, cols): the min-max grid over those columns.
    ``zero`` is a float holding integer values (0 when symmetric)."""
    levels = (1 << spec.bits) - 1
    if spec.symmetric:
        scale = 2 * w.abs().amax(dim=1) / levels
        zero = torch.zeros_like(scale)
    else:
        lo = w.amin(dim=1).clamp(max=0)
        hi = w.amax(dim=1).clamp(min=0)
        scale = (hi - lo) / levels
        zero = spec.qmin - torch.round(lo / torch.where(scale > 0, scale, 1.0))
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale codes it
    return scale, zero.clamp(spec.qmin, spec.qmax)


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Codes of ``w`` (rows,) or (rows, cols) with per-row ``scale``/``zero`` (rows,)."""
    if w.dim() == 2:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, spec.qmin, spec.qmax)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """The float weight (out, in) that ``codes`` with per-(row, group) ``scale``/``zero`` stand for."""
    width = spec.width(codes.shape[1])
    s = scale.repeat_interleave(width, dim=1)
    q = codes.float()
    if zero is not None:
        q = q - zero.float().repeat_interleave(width, dim=1)
    return q * s


def rtn(w: torch.Tensor, spec: QuantSpec) -> QLinear:
    """Round-to-nearest: every (row, group) onto its min-max grid."""
    w = w.float()
    rows, cols = w.shape
    n = spec.groups(cols)
    groups = w.reshape(rows * n, spec.width(cols))  # row r's group g is row r·n + g
    scale, zero = grid_params(groups, spec)
    codes = quantize(groups, scale, zero, spec).reshape(rows, cols).to(torch.int8)
    return QLinear(codes, scale.view(rows, n), None if spec.symmetric else zero.view(rows, n).to(torch.int8), spec)


def gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` (in, in) in float64 of activations ``x`` (..., in): all ``output_error`` needs of them."""
    x = x.reshape(-1, x.shape[-1]).double()
    return x.T @ x


def output_error(g: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Relative reconstruction error of a linear on activations ``x`` with ``g = gram(x)`` (or any
    positive multiple of it): ``||x (ŵ - w)ᵀ||² / ||x wᵀ||²``, as ``tr(Δ g Δᵀ) / tr(w g wᵀ)``."""
    w = w.double()
    d = w_hat.double() - w
    return float(((d @ g) * d).sum() / ((w @ g) * w).sum().clamp_min(1e-30))
