"""Parameter counts and training FLOPs per token for MFU reporting.

FLOPs per token follow the PaLM / nanoGPT convention: 6·N for the weight
matmuls (forward + backward) plus 12·L·H·Q·T for attention scores and values,
where N counts parameters that take part in a matmul (everything except the
input embedding lookup; a tied output matrix counts once, as the output),
L = layers, H = query heads, Q = head dim, T = sequence length.
"""

from __future__ import annotations

from raysc.config.schema import ModelConfig


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts of ``raysc.model.Llama`` computed from the config."""
    d, hd = cfg.dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    if cfg.attention_bias:  # Qwen2's q/k/v biases
        attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    if cfg.qk_norm:  # Qwen3's per-head q and k norms
        attn += 2 * hd
    dense_mlp = 3 * d * cfg.hidden_ffn_dim
    expert = 3 * d * cfg.moe_hidden_dim
    shared = cfg.moe_shared_experts * expert + (d if cfg.moe_shared_experts and cfg.moe_shared_expert_gate else 0)
    moe_mlp = d * cfg.moe_experts + cfg.moe_experts * expert + shared  # router, routed experts, shared ones
    moe_active = d * cfg.moe_experts + cfg.moe_top_k * expert + shared  # what one token goes through
    n_moe = len(cfg.moe_layers)
    per_layer = attn + dense_mlp + 2 * d
    embedding = cfg.vocab_size * d
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    layers = cfg.n_layers * per_layer + n_moe * (moe_mlp - dense_mlp)
    total = embedding + layers + d + output
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "per_layer": per_layer if not n_moe else layers / cfg.n_layers,  # a layer's (the mean, with MoE layers)
        "active": total + n_moe * (moe_active - moe_mlp),  # a token's parameters (= total when dense)
        "routed_experts": n_moe * cfg.moe_experts * expert,  # what expert parallelism splits (all layers)
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·H·Q·T (N excludes the embedding lookup; under a mixture of
    experts it counts the parameters a token goes through, its top-k experts' and not the others')."""
    counts = param_count(cfg)
    n = counts["active"] - counts["embedding"] + (cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
