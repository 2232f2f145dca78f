"""Quantize a Llama layer by layer, as GPTQ does: the calibration activations of block ``i`` come
from blocks ``< i`` already quantized, so each block corrects for the error of those before it.

Within a block, RTN and GPTQ go "true-sequentially": q/k/v, then o (on inputs computed with the
quantized q/k/v), then gate/up, then down. AWQ searches all four groups' scales on the block's
full-precision activations (as its paper and AutoAWQ do), folds them into the previous ops (RMSNorm
weights, v's rows for o, up's rows for down), clips the scaled weights of v, o, gate, up and down
(``awq.search_clip``; kept for a layer only if it lowers that layer's error), then rounds them to
nearest.

Every quantized linear's relative output error ``||X Ŵᵀ - X Wᵀ||² / ||X Wᵀ||²`` is measured on
its calibration inputs ``X`` in the model's original coordinates, next to round-to-nearest's
error on the same inputs (``rtn_error``). The model is changed in place: it ends holding the
dequantized weights (and AWQ's folded norms), so evaluating it measures the quantized model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from raysc.model.llama import Block, Llama, Rope
from raysc.quantize.awq import search_clip, search_scales
from raysc.quantize.gptq import Hessian, gptq
from raysc.quantize.rtn import QLinear, QuantSpec, gram, output_error, rtn

METHODS = ("int8", "rtn4", "gptq", "awq")
# linears that share an input, in the order a block computes them
GROUPS = (("attn.wq", "attn.wk", "attn.wv"), ("attn.wo",), ("mlp.w_gate", "mlp.w_up"), ("mlp.w_down",))
NO_CLIP = ("attn.wq", "attn.wk")  # AWQ's clipping skips them (raysc.quantize.awq)


@dataclass
class LayerReport:
    error: float
    rtn_error: float
    extra: dict = field(default_factory=dict)


@dataclass
class Quantized:
    """``linears``: raysc parameter prefix (``layers.0.attn.wq``) -> its ``QLinear``."""

    linears: dict[str, QLinear]
    reports: dict[str, LayerReport]


def _module(block: Block, name: str) -> nn.Linear:
    return block.get_submodule(name)


@torch.no_grad()
def _block_inputs(block: Block, h: torch.Tensor, rope: Rope, names: list[str], chunk: int) -> dict[str, torch.Tensor]:
    """The inputs each linear in ``names`` sees when ``block`` runs on ``h`` (rows, seq, dim),
    flattened to (tokens, in)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [
        _module(block, n).register_forward_pre_hook(
            lambda _m, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]).detach())
        )
        for n in names
    ]
    try:
        for i in range(0, h.shape[0], chunk):
            block(h[i : i + chunk], rope)
    finally:
        for hk in hooks:
            hk.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


@torch.no_grad()
def _run_block(block: Block, h: torch.Tensor, rope: Rope, chunk: int) -> torch.Tensor:
    return torch.cat([block(h[i : i + chunk], rope) for i in range(0, h.shape[0], chunk)])


@torch.no_grad()
def quantize_model(
    model: Llama, calib: torch.Tensor, method: str, spec: QuantSpec, *, chunk: int = 8, act_order: bool = True
) -> Quantized:
    """Quantize every linear of ``model``'s blocks on calibration token rows ``calib`` (rows, seq).
    The embedding, final norm and output projection stay in full precision."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")
    model.eval()
    rope = Rope(model.rope_cos, model.rope_sin, None)
    h = torch.cat([model.embed(calib[i : i + chunk]) for i in range(0, calib.shape[0], chunk)])
    out = Quantized({}, {})
    for idx, block in model.layers.items():
        prefix = f"layers.{idx}."
        if method == "awq":
            _awq_block(model, block, h, rope, spec, chunk, prefix, out)
        else:
            for group in GROUPS:
                xs = _block_inputs(block, h, rope, [group[0]], chunk)[group[0]]
                hess = Hessian(xs.shape[1])
                hess.add(xs)
                g = hess.h  # 2/n·xᵀx: output_error takes any multiple of xᵀx
                for name in group:
                    lin = _module(block, name)
                    w = lin.weight.detach().float().clone()
                    base = rtn(w, spec)
                    q = gptq(w, hess.matrix(), spec, act_order=act_order) if method == "gptq" else base
                    w_hat = q.dequantize()
                    rtn_err = output_error(g, w, base.dequantize())
                    err = rtn_err if q is base else output_error(g, w, w_hat)
                    lin.weight.copy_(w_hat.to(lin.weight.dtype))
                    out.linears[prefix + name] = q
                    out.reports[prefix + name] = LayerReport(err, rtn_err)
        h = _run_block(block, h, rope, chunk)
    return out


def _awq_block(
    model: Llama, block: Block, h: torch.Tensor, rope: Rope, spec: QuantSpec, chunk: int, prefix: str, out: Quantized
) -> None:
    names = [g[0] for g in GROUPS]
    xs = _block_inputs(block, h, rope, names, chunk)
    weights = {n: _module(block, n).weight.detach().float().clone() for g in GROUPS for n in g}
    kv = model.cfg.n_kv_heads
    hd = model.cfg.head_dim
    col_scale: dict[str, torch.Tensor] = {}
    row_scale: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for group in GROUPS:
        tie = (kv, hd) if group == ("attn.wo",) else None
        found = search_scales(xs[group[0]], [weights[n] for n in group], spec, tie=tie)
        for n in group:
            col_scale[n] = found.scales
            alphas[n] = found.alpha
    # fold each group's 1/s into the op that produces its input
    block.attn_norm.weight.div_(col_scale["attn.wq"])
    block.mlp_norm.weight.div_(col_scale["mlp.w_gate"])
    o_s = col_scale["attn.wo"]
    row_scale["attn.wv"] = o_s.view(kv, -1, hd)[:, 0, :].reshape(-1)  # tied: equal across a kv group
    row_scale["mlp.w_up"] = col_scale["mlp.w_down"]
    for group in GROUPS:
        g = gram(xs[group[0]])
        for n in group:
            w = weights[n]
            r = row_scale.get(n, torch.ones(w.shape[0]))
            s = col_scale[n]
            scaled = w / r[:, None] * s[None, :]
            q, error, extra = _awq_round(scaled, w, g, r, s, spec, clip=n not in NO_CLIP)
            _module(block, n).weight.copy_(q.dequantize().to(_module(block, n).weight.dtype))
            out.linears[prefix + n] = q
            out.reports[prefix + n] = LayerReport(
                error, output_error(g, w, rtn(w, spec).dequantize()), {"alpha": alphas[n], **extra}
            )


def _awq_round(
    scaled: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    r: torch.Tensor,
    s: torch.Tensor,
    spec: QuantSpec,
    clip: bool,
) -> tuple[QLinear, float, dict]:
    """Round AWQ's ``scaled`` weight (``w`` with rows / ``r``, columns · ``s``), clipped by
    ``search_clip`` when ``clip`` and when that lowers the layer's whole error (the search weighs
    each group alone); returns the codes, the error in ``w``'s coordinates and what clipping did."""

    def error(q: QLinear) -> float:
        return output_error(g, w, q.dequantize() * r[:, None] / s[None, :])

    q = rtn(scaled, spec)
    err = error(q)
    if not clip:
        return q, err, {"clip": None}
    clipped, ratios = search_clip(scaled, g / torch.outer(s, s).double(), spec)  # the scaled layer's inputs: x / s
    qc = rtn(clipped, spec)
    err_c = error(qc)
    kept = err_c < err
    extra = {
        "clip": {
            "kept": kept,
            "mean_ratio": float(ratios.mean()),
            "clipped_groups": float((ratios < 1).float().mean()),
            "error_unclipped": err,
        }
    }
    return (qc, err_c, extra) if kept else (q, err, extra)
