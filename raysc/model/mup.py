"""μP, the maximal update parametrisation (Yang et al. 2022, "Tensor Programs V"), for the raysc Llama.

Under μP an optimizer learning rate and an init scale tuned on a narrow model
stay (close to) optimal when the model is made wider. With the width multiplier
m = model.dim / model.mup_base_width, raysc applies the μP table for Adam
(TP5 Table 3; the form of the ``mup`` package's ``MuReadout`` + ``MuAdamW`` and of
Cerebras' "practitioner's guide to μP"):

===========================  ================  ============  ==========================
parameter                    init std          AdamW LR      forward
===========================  ================  ============  ==========================
embed.weight (input)         init_std          lr            —
hidden matrices              init_std/sqrt(m)  lr/m          —
  (attn.wq/wk/wv/wo,         (wo, w_down keep
  mlp.w_gate/w_up/w_down)    their 1/sqrt(2L))
output.weight (readout)      init_std          lr            logits × 1/m
norms (vectors)              1                 lr            —
attention scores             —                 —             q·k / head_dim (not sqrt)
===========================  ================  ============  ==========================

Readout: we keep the output matrix's normal(0, init_std) init and its LR and
put the 1/m multiplier in the forward pass (``MuReadout``'s default with
``MuAdamW``). The logits at init then shrink like 1/sqrt(m) and after the first
updates are Θ(1) at every width; zero-initialising the readout (TP5's other
valid choice) makes that exact from step 0 but also makes m=1 differ from the
standard parametrisation, so we do not. Weight decay: torch's AdamW shrinks a
weight by lr·wd per step; hidden matrices get wd·m so that product, the decay's
time scale, is the same at every width (what ``MuAdam`` does for coupled decay;
Wang & Aitchison 2024 argue for keeping that time scale fixed).

Why ours and not the ``mup`` package: it swaps in its own readout module and
infers "matrix-like" parameters from base shapes recorded on live modules,
while raysc's model must stay plain torch and, under TP and FSDP, holds sharded
DTensors. Our parameter names are fixed and few, so every rule here is keyed by
the parameter NAME (``named_parameters()``), never by a shape, and works on any
shard of any layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from raysc.config.schema import ModelConfig, OptimConfig

INPUT, HIDDEN, OUTPUT, VECTOR = "input", "hidden", "output", "vector"

HIDDEN_SUFFIXES: tuple[str, ...] = (
    *(f"{m}.weight" for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")),
    # a mixture of experts (raysc.model.moe): the router, the routed experts' 3-D weights, the shared experts
    *(f"mlp.{m}.weight" for m in ("router.gate", "shared.w_gate", "shared.w_up", "shared.w_down", "shared_gate")),
    *(f"mlp.experts.{w}" for w in ("w_gate", "w_up", "w_down")),
)


def param_role(name: str) -> str:
    """``input``, ``hidden``, ``output`` or ``vector`` for a parameter name of ``raysc.model.Llama``.

    Suffix matching, so names with wrapper prefixes (``_orig_mod.``, a pipeline
    stage's ``layers.7.``) classify the same way.
    """
    if name.endswith("embed.weight"):
        return INPUT
    if name.endswith("output.weight"):
        return OUTPUT
    if name.endswith("norm.weight"):
        return VECTOR
    if name.endswith(HIDDEN_SUFFIXES):
        return HIDDEN
    raise ValueError(
        f"μP has no rule for parameter {name!r}: expected embed.weight, output.weight, a norm "
        f"or one of {', '.join(HIDDEN_SUFFIXES)}; add the new parameter to raysc/model/mup.py"
    )


def is_hidden(name: str) -> bool:
    """True for the matrices whose fan-in grows with the width (attention and MLP weights)."""
    return param_role(name) == HIDDEN


def width_mult(cfg: ModelConfig) -> float:
    """m = dim / mup_base_width under μP, 1 otherwise."""
    return cfg.mup_width_mult if cfg.mup else 1.0


def lr_mult(name: str, cfg: ModelConfig) -> float:
    """Factor on optim.lr for this parameter: 1/m for hidden matrices under μP, else 1."""
    return 1.0 / width_mult(cfg) if cfg.mup and is_hidden(name) else 1.0


def weight_decay_mult(name: str, cfg: ModelConfig) -> float:
    """Factor on optim.weight_decay: m for hidden matrices under μP (keeps lr·wd width-independent)."""
    return width_mult(cfg) if cfg.mup and is_hidden(name) else 1.0


def init_mult(name: str, cfg: ModelConfig) -> float:
    """Factor on the init std: 1/sqrt(m) for hidden matrices under μP (variance ∝ 1/fan-in), else 1."""
    return 1.0 / math.sqrt(width_mult(cfg)) if cfg.mup and is_hidden(name) else 1.0


def output_mult(cfg: ModelConfig) -> float:
    """Forward multiplier of the logits: 1/m under μP, else 1."""
    return 1.0 / width_mult(cfg)


def attention_scale(head_dim: int) -> float:
    """μP softmax scale of q·k: 1/head_dim (the standard one is 1/sqrt(head_dim)): q and k become
    correlated during training, so q·k grows like head_dim, not sqrt(head_dim)."""
    return 1.0 / head_dim


def param_groups(
    named_params: Iterable[tuple[str, torch.Tensor]], optim: OptimConfig, model: ModelConfig
) -> list[dict]:
    """AdamW parameter groups under μP, decided by name.

    Group 0 holds the vectors (norms: base LR, no weight decay), which every
    model part (pipeline stage) has, so ``optimizer.param_groups[0]['lr']`` is
    always the base LR; then embedding/readout (base LR, decay) and the hidden
    matrices (LR/m, decay·m). Empty groups are left out.
    """
    m = width_mult(model)
    vectors, io, hidden = [], [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        role = param_role(name)
        (vectors if role == VECTOR else hidden if role == HIDDEN else io).append(p)
    groups = [
        {"params": vectors, "lr": optim.lr, "weight_decay": 0.0},
        {"params": io, "lr": optim.lr, "weight_decay": optim.weight_decay},
        {"params": hidden, "lr": optim.lr / m, "weight_decay": optim.weight_decay * m},
    ]
    return [g for g in groups if g["params"]]


@torch.no_grad()
def fold_into_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Weights of the standard-parametrisation model that computes what a μP model computes.

    Exporters (Hugging Face Llama, GGUF) know neither the 1/m logit multiplier nor
    the 1/head_dim attention scale: fold them into ``output.weight`` (×1/m) and
    ``attn.wq.weight`` (×1/sqrt(head_dim): rotary embeddings are linear, so
    (q/sqrt(d))·k/sqrt(d) = q·k/d). A tied embedding cannot absorb 1/m without
    changing the input side, so that combination raises unless m = 1.
    """
    if not cfg.mup:
        return dict(state)
    m = cfg.mup_width_mult
    if cfg.tie_embeddings and m != 1.0:
        raise ValueError(
            f"a μP model with tie_embeddings and width multiplier {m:g} cannot be exported as a "
            f"standard Llama: the 1/m logit multiplier would also scale the input embedding"
        )
    out = {}
    for name, t in state.items():
        if name.endswith("attn.wq.weight"):
            t = t / math.sqrt(cfg.head_dim)
        elif name.endswith("output.weight") and not cfg.tie_embeddings:
            t = t / m
        out[name] = t
    return out
