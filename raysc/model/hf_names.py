"""Parameter names of the raysc Llama and of a Hugging Face ``LlamaForCausalLM`` (or
``Qwen2ForCausalLM``, the same names plus q/k/v biases, or ``Qwen3ForCausalLM``, plus q/k norms, or
``Qwen3MoeForCausalLM``, plus a router and routed experts), both ways.

Routed experts: raysc holds each MoE layer's experts as three 3-D weights (``mlp.experts.w_gate`` and
``w_up`` (E, F, D), ``w_down`` (E, D, F)). Checkpoints hold them either per expert
(``mlp.experts.{e}.gate_proj.weight`` (F, D), ..., what transformers 4 wrote and most published
checkpoints have) or fused (transformers 5's ``mlp.experts.gate_up_proj`` (E, 2F, D), gate rows first,
and ``mlp.experts.down_proj`` (E, D, F)); ``expert_key`` parses both.

Export (``raysc.export.hf``) writes Hugging Face names; continued pre-training from a Hugging Face
checkpoint (``raysc.model.hf_checkpoint``) reads them back. One table serves both directions, so the
two cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysc.config.schema import ModelConfig

# config.json model_type -> the transformers class raysc reads and writes for it (model.attention_bias
# picks qwen2, model.qk_norm qwen3); mistral checkpoints without a sliding window are Llama-architecture ones
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def model_type(cfg: ModelConfig) -> str:
    """config.json's model_type for a raysc ``ModelConfig``: qwen3_moe (a mixture of experts), qwen3 (q/k
    norms), qwen2 (q/k/v biases) or llama."""
    if cfg.moe_experts:
        return "qwen3_moe"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"


LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",  # Qwen2's (model.attention_bias)
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's (model.qk_norm)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "mlp.router.gate.weight": "mlp.gate.weight",  # an MoE layer's router (Qwen3-MoE)
}
TOP_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_HF_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_FROM_HF_TOP = {v: k for k, v in TOP_NAMES.items()}


def hf_name(name: str) -> str:
    """Map a raysc parameter name to its Hugging Face Llama name."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if rest in LAYER_NAMES:
            return f"model.layers.{idx}.{LAYER_NAMES[rest]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def raysc_name(name: str) -> str | None:
    """Map a Hugging Face Llama tensor name to the raysc parameter name (None: not a Llama weight)."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    if name.startswith("model.layers."):
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[2].isdigit() and parts[3] in _FROM_HF_LAYER:
            return f"layers.{parts[2]}.{_FROM_HF_LAYER[parts[3]]}"
    return None


# a routed expert's projection in a per-expert checkpoint key, by raysc weight
EXPERT_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_FROM_EXPERT_PROJ = {v: k for k, v in EXPERT_PROJ.items()}
# a fused checkpoint key -> the raysc weights it holds, in order along its dim 1
FUSED_EXPERTS = {"gate_up_proj": ("w_gate", "w_up"), "down_proj": ("w_down",)}


def expert_key(name: str) -> tuple[int, int | None, str] | None:
    """(layer, expert, what) of a Hugging Face routed-expert tensor name: ``what`` a raysc weight
    (``w_gate``, ``w_up``, ``w_down``) of expert ``expert`` for a per-expert key, or a fused key
    (``gate_up_proj``, ``down_proj``) with expert None. None: not a routed expert's tensor."""
    parts = name.split(".")
    if len(parts) < 6 or parts[:2] != ["model", "layers"] or parts[3:5] != ["mlp", "experts"] or not parts[2].isdigit():
        return None
    layer, rest = int(parts[2]), parts[5:]
    if len(rest) == 1 and rest[0] in FUSED_EXPERTS:
        return layer, None, rest[0]
    if len(rest) == 3 and rest[0].isdigit() and rest[1] in _FROM_EXPERT_PROJ and rest[2] == "weight":
        return layer, int(rest[0]), _FROM_EXPERT_PROJ[rest[1]]
    return None


def require_dense(cfg: ModelConfig, target: str) -> None:
    """Refuse to write a mixture-of-experts model as ``target`` (its experts and router have no names in
    the dense Llama formats here): a clear error, never a file that loads without its experts."""
    if cfg.moe_experts:
        raise ValueError(
            f"this run is a mixture of experts (model.moe_experts={cfg.moe_experts}): {target} export of MoE "
            f"models is not built yet (issue 59: Qwen3-MoE, Mixtral, OLMoE and Qwen2-MoE formats, vLLM and "
            f"llama.cpp); its checkpoints resume, and `raysc generate` samples from it"
        )
