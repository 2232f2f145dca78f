"""Serving memory per vLLM replica, from the config: the weights at the serving dtype plus the KV cache
that ``serve.max_num_seqs`` sequences of ``max_model_len`` tokens need, next to the KV-cache memory the
replica reserves (``serve.kv_cache_gb``; vLLM's CPU build allocates it whole, in GiB, at start-up).

KV cache: every layer keeps a key and a value vector of ``n_kv_heads × head_dim`` per token, so
``2 · n_layers · n_kv_heads · head_dim · bytes`` per token (vLLM stores it in the model's dtype).
Weights: the exact parameter count of the exported model (``raysc.model.flops.param_count``); the
export writes fp32, and ``serve.dtype = auto`` serves the exported dtype. Activations, the
sampler's logits and the runtime itself (Python, torch, vLLM: a few hundred MB) are not counted.
"""

from __future__ import annotations

import math

from raysc.config.schema import Config, ModelConfig, ServeConfig
from raysc.model.flops import param_count

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
EXPORT_DTYPE = "float32"  # raysc.export.hf.export_hf's default, what raysc serve exports


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


def _estimate(params: int, per_token: int, dtype: str, serve: ServeConfig, max_len: int) -> dict:
    nbytes = DTYPE_BYTES[dtype]
    weights = params * nbytes
    needed = per_token * serve.max_num_seqs * max_len
    # the CPU build reserves VLLM_CPU_KVCACHE_SPACE whole GiB; on GPU kv_cache_memory_bytes as given
    reserved = (math.ceil(serve.kv_cache_gb) if serve.gpus_per_replica == 0 else serve.kv_cache_gb) * (1 << 30)
    return {
        "dtype": dtype,
        "params": params,
        "weights_bytes": weights,
        "max_model_len": max_len,
        "max_num_seqs": serve.max_num_seqs,
        "kv_bytes_per_token": per_token,
        "kv_cache_needed_bytes": needed,
        "kv_cache_reserved_bytes": int(reserved),
        "kv_cache_tokens_reserved": int(reserved // per_token),
        "needed_bytes": weights + needed,
        "replica_bytes": weights + max(needed, int(reserved)),
        "kv_cache_fits": needed <= reserved,
    }


def serving_dtype(serve: ServeConfig, exported: str = EXPORT_DTYPE) -> str:
    return exported if serve.dtype == "auto" else serve.dtype


def serve_memory(cfg: Config) -> dict:
    """Memory of one replica serving the model of ``cfg`` with its ``serve.*`` settings."""
    m: ModelConfig = cfg.model
    dtype = serving_dtype(cfg.serve)
    max_len = cfg.serve.max_model_len or cfg.rope_len
    per_token = kv_bytes_per_token(m.n_layers, m.n_kv_heads, m.head_dim, DTYPE_BYTES[dtype])
    return _estimate(param_count(m)["total"], per_token, dtype, cfg.serve, max_len)


def serve_memory_from_hf(hf: dict, serve: ServeConfig) -> dict:
    """The same estimate from an exported folder's ``config.json`` (what vLLM reads)."""
    exported = hf.get("torch_dtype") or hf.get("dtype") or EXPORT_DTYPE
    dtype = serving_dtype(serve, exported if exported in DTYPE_BYTES else EXPORT_DTYPE)
    d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    kv, hd, f, v = (
        hf["num_key_value_heads"],
        hf.get("head_dim") or d // heads,
        hf["intermediate_size"],
        hf["vocab_size"],
    )
    per_layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * f + 2 * d
    params = v * d + layers * per_layer + d + (0 if hf.get("tie_word_embeddings") else v * d)
    max_len = serve.max_model_len or int(hf["max_position_embeddings"])
    return _estimate(params, kv_bytes_per_token(layers, kv, hd, DTYPE_BYTES[dtype]), dtype, serve, max_len)


def format_serve_memory(est: dict) -> str:
    mib = 1 << 20
    fit = (
        ""
        if est["kv_cache_fits"]
        else (
            f" (does not fit: {est['max_num_seqs']} full sequences need more than "
            f"serve.kv_cache_gb; vLLM queues the rest; raise serve.kv_cache_gb)"
        )
    )
    return (
        f"serving per replica ({est['dtype']}, {est['max_num_seqs']} sequences x {est['max_model_len']} tokens): "
        f"weights {est['weights_bytes'] / mib:.1f} MiB + KV cache {est['kv_cache_needed_bytes'] / mib:.1f} MiB "
        f"({est['kv_bytes_per_token']} B/token) = {est['needed_bytes'] / mib:.1f} MiB; reserved KV cache "
        f"{est['kv_cache_reserved_bytes'] / mib:.0f} MiB ({est['kv_cache_tokens_reserved']:,} tokens) -> "
        f"{est['replica_bytes'] / mib:.1f} MiB{fit}"
    )
