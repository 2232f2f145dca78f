"""GGUF Q4_0 whose rounding GPTQ chooses (``raysc export --format gguf --type q4_0 --method gptq``).

A Q4_0 block is 32 consecutive input weights of one row stored as ``(k - 8)·d``, ``k`` in 0..15 and
``d`` an fp16 scale: any signed 4-bit code in -8..7 with one scale per (row, 32 columns), which is
the symmetric 4-bit grid of ``raysc.quantize.rtn`` with group size 32. So nothing here quantizes:
``raysc.quantize.sequential.quantize_model`` runs GPTQ (``raysc.quantize.gptq``) block by block on
calibration rows of the run's training split (``calibration``), and this module packs each linear's
codes and scales into Q4_0 blocks for ``raysc.export.gguf``. The embedding stays llama.cpp's
round-to-nearest Q4_0 and the output projection Q8_0, as in a plain ``--type q4_0`` file.

The grid's scale is ``rtn``'s ``d = 2·max|w| / 15`` (the largest weight at ±7.5 steps), not llama.cpp's
``d = -w_max / 8`` (the largest weight exactly on code -8); GPTQ chooses every code on it, act-order
with static groups, so the codes are stored in the original column order and no index is needed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from raysc.data.prepare import prepare_data
from raysc.export.gguf import export_gguf
from raysc.export.restore import RunModel
from raysc.model.llama import Llama
from raysc.quantize.calibration import calibration
from raysc.quantize.rtn import QLinear, QuantSpec
from raysc.quantize.run import plain_model
from raysc.quantize.sequential import quantize_model

Q4_0_BLOCK = 32
SPEC = QuantSpec(bits=4, group_size=Q4_0_BLOCK, symmetric=True)


def q4_0_blocks(q: QLinear) -> np.ndarray:
    """A 4-bit symmetric ``QLinear`` with groups of 32 as Q4_0 blocks: per block the fp16 scale,
    then 16 bytes whose low nibbles hold codes 0..15 and high nibbles codes 16..31, each plus 8."""
    if q.spec != SPEC:
        raise ValueError(f"Q4_0 blocks need a 4-bit symmetric grid in groups of 32, not {q.spec}")
    rows, cols = q.codes.shape
    groups = cols // Q4_0_BLOCK
    nibbles = (q.codes.to(torch.int16) + 8).numpy().astype(np.uint8).reshape(rows, groups, 2, Q4_0_BLOCK // 2)
    packed = nibbles[:, :, 0, :] | (nibbles[:, :, 1, :] << np.uint8(4))
    d = q.scale.numpy().astype(np.float16).view(np.uint8).reshape(rows, groups, 2)
    return np.concatenate([d, packed], axis=-1).reshape(rows, groups * (2 + Q4_0_BLOCK // 2))


def gptq_blocks(model: Llama, calib: torch.Tensor, act_order: bool = True) -> dict[str, np.ndarray]:
    """Q4_0 blocks (raysc parameter name -> uint8 rows) of every linear in ``model``'s blocks, chosen by
    GPTQ on calibration rows ``calib`` (rows, seq). ``model`` must be a plain (μP-folded) model; it is
    left unchanged."""
    q = quantize_model(copy.deepcopy(model), calib, "gptq", SPEC, act_order=act_order)
    return {f"{name}.weight": q4_0_blocks(ql) for name, ql in q.linears.items()}


def export_gguf_gptq(
    run: RunModel, out_file: str | Path, calib_tokens: int = 16384, seed: int | None = None, name: str = "raysc"
) -> Path:
    """The run's model as a Q4_0 GGUF file whose linears GPTQ rounded, calibrated on ``calib_tokens``
    tokens of its training split drawn with ``seed`` (default the run's seed)."""
    model = plain_model(run.model)
    for n, p in model.named_parameters():
        if n.startswith("layers.") and p.dim() == 2 and p.shape[1] % Q4_0_BLOCK:
            raise ValueError(
                f"{n} has {p.shape[1]} input features, not a multiple of Q4_0's {Q4_0_BLOCK}; "
                f"export --type q4_0 without --method gptq (it stores such matrices as F16)"
            )
    packed, _, _ = prepare_data(run.cfg)
    calib = calibration(packed, calib_tokens, run.cfg.train.seed if seed is None else seed)
    return export_gguf(model, run.tokenizer_path, out_file, "q4_0", name, gptq_blocks(model, calib.tokens))
