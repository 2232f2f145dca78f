"""Activation recomputation (``parallel.recompute``), applied from outside like every other plan.

``full``: each transformer block keeps only its input for backward and recomputes its
forward when the gradient reaches it (``torch.utils.checkpoint``, non-reentrant), trading
about one extra forward (≈ +33 % of the FLOPs of a step) for activation memory of one
block per micro-batch instead of all of them. The block's ``forward`` is wrapped on the
instance, so parameter names (and checkpoints) do not change and FSDP/TP hooks, which run
around ``Module.__call__``, see the same module.

Selective recomputation (Korthikanti et al. 2022) recomputes only the attention scores and
softmax; raysc's attention is fused (``scaled_dot_product_attention``), which never stores
the s×s scores, so it would save nothing here and is not offered.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap every block of ``model.layers`` for ``mode`` ('none' or 'full')."""
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"parallel.recompute={mode!r}: choose 'none' or 'full'")
    for block in model.layers.values():
        block.forward = functools.partial(_checkpointed, block.forward)


def is_recomputed(block: nn.Module) -> bool:
    """Whether ``apply_recompute`` wrapped ``block`` (its forward recomputes in backward)."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed
