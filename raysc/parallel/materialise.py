"""Materialise a model shard built on the meta device: allocate only this rank's tensors, then
stream the exact one-process initialisation into them.

``build_model_shard`` builds the model on ``meta`` and applies the pipeline split, CP, TP and
FSDP there, so no rank ever holds the full model. ``materialise`` then gives every local tensor
storage on the worker's device (``to_empty``), recomputes the buffers (rotary tables) and
initialises the parameters one at a time in the full model's ``named_parameters`` order from
one generator seeded with ``train.seed`` — the order and generator ``Llama.init_weights`` uses
— so the random stream is consumed exactly as in one process. Each matrix is drawn on CPU in
blocks of rows of at most ``CHUNK_ELEMS`` values, this rank's part of each block (all of it for a
plain tensor; for a DTensor the part its mesh coordinate and placements give) is copied into the
shard, and the block is dropped: the transient memory is one block, not a parameter. Blocks start
at multiples of 16 values and the last has at least 16, which is where torch's CPU ``normal_``
draws (16 uniforms, Box-Muller in place) line up, so the blocks hold exactly the values one
``normal_`` call over the whole matrix would (``tests/test_materialise.py`` checks it). Parameters
this rank does not hold (other pipeline stages) are drawn and dropped too, so every later
parameter draws the same numbers. FSDP2 re-pads its sharded storage from the written local
tensors at its lazy init, as it does after any ``to_empty``.

Continued pre-training (``model.init_from``) swaps the generator for a checkpoint: with a
``source`` (``raysc.model.hf_checkpoint.HFCheckpoint``), each held parameter's block is read
from the safetensors file in row blocks instead of drawn, and nothing else is read.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raysc.config.schema import ModelConfig
from raysc.model.hf_checkpoint import HFCheckpoint
from raysc.model.llama import init_std, init_value

CHUNK_ELEMS = 1 << 22  # values per drawn block: 16 MiB in fp32


def init_order(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Name, full shape and dtype of every parameter of the full model, in initialisation order."""
    return [(n, p.shape, p.dtype) for n, p in model.named_parameters()]


def _local_region(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's tensor for ``param`` and the shape and offset of the block of the full tensor it holds.

    FSDP shards the (TP-local) tensor after TP does, so a shard is a chunk of a chunk along each
    dimension: one contiguous block, found from its global offset and local shape."""
    if not isinstance(param, DTensor):
        return param, tuple(param.shape), (0,) * param.ndim
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), tuple(shape), tuple(offset)


def row_blocks(shape: torch.Size) -> list[tuple[int, int]]:
    """Row ranges of at most about ``CHUNK_ELEMS`` values, starting at multiples of 16 values, the
    last holding at least 16 (or the whole tensor when it has fewer)."""
    rows, cols = shape[0], math.prod(shape[1:])
    align = 16 // math.gcd(cols, 16)
    step = max(align, CHUNK_ELEMS // max(cols, 1) // align * align)
    out, start = [], 0
    while start < rows:
        end = min(start + step, rows)
        if (rows - end) * cols < 16:
            end = rows
        out.append((start, end))
        start = end
    return out


def _copy_rows(region: tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]], values: torch.Tensor, start: int) -> None:
    """Copy the overlap of full-tensor rows ``start .. start+len(values)`` with this rank's block."""
    local, shape, offset = region
    a, b = max(start, offset[0]), min(start + len(values), offset[0] + shape[0])
    if a >= b:
        return
    src = values[a - start : b - start]
    for dim in range(1, values.ndim):
        if shape[dim] != values.shape[dim]:
            src = src.narrow(dim, offset[dim], shape[dim])
    local[a - offset[0] : b - offset[0]].copy_(src)


def _to_empty_keeping_ties(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` that keeps a parameter shared by two modules shared (tied embeddings)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, name))
    module.to_empty(device=device)
    for refs in owners.values():
        first = getattr(*refs[0])
        for mod, name in refs[1:]:
            setattr(mod, name, first)


@torch.no_grad()
def materialise(
    parts: list[nn.Module],
    order: list[tuple[str, torch.Size, torch.dtype]],
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    source: HFCheckpoint | None = None,
    init_weights: bool = True,
) -> None:
    """Allocate ``parts`` (meta modules: pipeline stages of one rank, or the model) on ``device`` and
    initialise them to exactly this rank's share of ``build_model(cfg, ..., seed)``, or of the
    checkpoint ``source`` when one is given (checked against ``order`` before); ``init_weights=False``
    stops after the allocation and the buffers (the caller copies the parameters in)."""
    for part in parts:
        _to_empty_keeping_ties(part, device)
        part.reset_buffers()
    if not init_weights:
        return
    held = {name: p for part in parts for name, p in part.named_parameters()}
    if source is not None:
        for name, p in held.items():
            local, _, offset = _local_region(p)
            source.copy_into(name, local, offset)
        return
    generator = torch.Generator().manual_seed(seed)
    for name, shape, dtype in order:
        region = _local_region(held[name]) if name in held else None
        if len(shape) == 1:
            if region is not None:
                _copy_rows(region, init_value(cfg, name, shape, generator, dtype), 0)
            continue
        std = init_std(cfg, name)
        for start, end in row_blocks(shape):  # drawn even when not held
            values = torch.empty((end - start, *shape[1:]), dtype=dtype).normal_(0.0, std, generator=generator)
            if region is not None:
                _copy_rows(region, values, start)
