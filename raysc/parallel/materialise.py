"""Materialise a model shard built on the meta device: allocate only this rank's tensors, then
stream the exact one-process initialisation into them.

``build_model_shard`` builds the model on ``meta`` and applies the pipeline split, CP, TP and
FSDP there, so no rank ever holds the full model. ``materialise`` then gives every local tensor
storage on the worker's device (``to_empty``), recomputes the buffers (rotary tables) and
initialises the parameters one at a time in the full model's ``named_parameters`` order from
one generator seeded with ``train.seed`` — the order and generator ``Llama.init_weights`` uses
— so the random stream is consumed exactly as in one process. Each full parameter is drawn on
CPU, this rank's slice of it (all of it for a plain tensor; for a DTensor the block its mesh
coordinate and placements give) is copied into the shard, and the full tensor is dropped: the
transient memory is one parameter. Parameters this rank does not hold (other pipeline stages)
are drawn and dropped too, so every later parameter draws the same numbers. FSDP2 re-pads its
sharded storage from the written local tensors at its lazy init, as it does after any
``to_empty``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from raysc.config.schema import ModelConfig
from raysc.model.llama import init_value


def init_order(model: nn.Module) -> list[tuple[str, torch.Size, torch.dtype]]:
    """Name, full shape and dtype of every parameter of the full model, in initialisation order."""
    return [(n, p.shape, p.dtype) for n, p in model.named_parameters()]


def local_block(full: torch.Tensor, param: DTensor) -> torch.Tensor:
    """The block of the full tensor that ``param``'s local shard holds on this rank.

    FSDP shards the (TP-local) tensor after TP does, so a shard is a chunk of a chunk along each
    dimension: one contiguous block, found from its global offset and local shape."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
    block = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        if size != full.shape[dim]:
            block = block.narrow(dim, start, size)
    return block


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
def materialise(parts: list[nn.Module], order: list[tuple[str, torch.Size, torch.dtype]], cfg: ModelConfig,
                seed: int, device: torch.device) -> None:
    """Allocate ``parts`` (meta modules: pipeline stages of one rank, or the model) on ``device`` and
    initialise them to exactly this rank's share of ``build_model(cfg, ..., seed)``."""
    for part in parts:
        _to_empty_keeping_ties(part, device)
        part.reset_buffers()
    held = {name: p for part in parts for name, p in part.named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    for name, shape, dtype in order:
        full = init_value(cfg, name, shape, generator, dtype)  # drawn even when not held
        param = held.get(name)
        if param is None:
            continue
        if isinstance(param, DTensor):
            param.to_local().copy_(local_block(full, param))
        else:
            param.copy_(full)
