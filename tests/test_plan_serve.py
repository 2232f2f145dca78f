"""``raysc plan --serve``: the serving memory per replica against the exported model's real tensors
(weights) and a transformers KV cache filled for the configured sequences (KV bytes)."""

from __future__ import annotations

import json

import torch

from raysc.config import load_config
from raysc.plan.serve_memory import serve_memory, serve_memory_from_hf

SMALL = [
    "model.vocab_size=320",
    "model.dim=64",
    "model.n_layers=3",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "serve.max_num_seqs=3",
    "serve.max_model_len=40",
]


def test_serve_memory_matches_the_export_and_a_filled_kv_cache(tmp_path):
    from transformers import AutoModelForCausalLM

    from raysc.data.special_tokens import RAYSC
    from raysc.export.hf import export_hf
    from raysc.model.llama import build_model

    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}))
    cfg = load_config(None, SMALL)
    # a stub tokenizer: its special tokens are given, as a raysc-trained one's (the test is about the weights)
    export_hf(build_model(cfg.model, cfg.rope_len, seed=0), tok, tmp_path / "hf", special=RAYSC)
    est = serve_memory(cfg)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert est == serve_memory_from_hf(hf, cfg.serve)  # the config and the exported folder agree

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert est["weights_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(1, 320, (cfg.serve.max_num_seqs, cfg.serve.max_model_len))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert est["kv_cache_needed_bytes"] == kv
    # bf16 halves both; the CPU build reserves whole GiB of KV cache
    half = serve_memory(load_config(None, [*SMALL, 'serve.dtype="bfloat16"', "serve.kv_cache_gb=0.5"]))
    assert 2 * half["weights_bytes"] == est["weights_bytes"] and 2 * half["kv_cache_needed_bytes"] == kv
    assert half["kv_cache_reserved_bytes"] == 1 << 30 and half["kv_cache_fits"]
