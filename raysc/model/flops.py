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
    mlp = 3 * d * cfg.hidden_ffn_dim
    per_layer = attn + mlp + 2 * d
    embedding = cfg.vocab_size * d
    output = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = embedding + cfg.n_layers * per_layer + d + output
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "per_layer": per_layer,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6·N + 12·L·H·Q·T (N excludes the embedding lookup)."""
    n = param_count(cfg)["non_embedding"] + (cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
