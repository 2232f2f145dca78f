"""The Llama model: shapes, causality, grouped-query attention, parameter and FLOP accounting."""

import pytest
import torch
import torch.nn.functional as F

from raysc.config import ModelConfig
from raysc.model import build_model, flops_per_token, param_count


def small(**kw) -> ModelConfig:
    base = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    base.update(kw)
    return ModelConfig(**base)


def test_shapes_and_dtype():
    m = build_model(small(), 32, seed=0)
    out = m(torch.randint(0, 300, (3, 17)))
    assert out.shape == (3, 17, 300) and out.dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits():
    m = build_model(small(), 32, seed=0).eval()
    x = torch.randint(0, 300, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 300, (2, 8))
    a, b = m(x), m(y)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_equals_attention_with_explicitly_repeated_kv_heads():
    cfg = small(n_heads=4, n_kv_heads=2)
    m = build_model(cfg, 32, seed=1).eval()
    mha_cfg = small(n_heads=4, n_kv_heads=4)
    mha = build_model(mha_cfg, 32, seed=1).eval()
    sd = m.state_dict()
    hd = cfg.head_dim
    for i in range(cfg.n_layers):
        for w in ("wk", "wv"):
            k = sd[f"layers.{i}.attn.{w}.weight"].view(2, hd, cfg.dim)
            sd[f"layers.{i}.attn.{w}.weight"] = k.repeat_interleave(2, dim=0).reshape(4 * hd, cfg.dim)
    mha.load_state_dict(sd)
    x = torch.randint(0, 300, (2, 16))
    torch.testing.assert_close(m(x), mha(x), rtol=1e-5, atol=1e-5)
    assert m.layers["0"].attn.wk.weight.shape[0] == 2 * hd


def test_attention_matches_reference_softmax():
    m = build_model(small(n_kv_heads=4, n_layers=1), 16, seed=2).eval()
    attn = m.layers["0"].attn
    x = torch.randn(1, 10, 64)
    from raysc.model.llama import Rope

    rope = Rope(m.rope_cos, m.rope_sin, None)
    cos, sin = m.rope_cos[:10], m.rope_sin[:10]
    from raysc.model.llama import apply_rope

    q = apply_rope(attn.wq(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x).view(1, 10, 4, 16).transpose(1, 2), cos, sin)
    v = attn.wv(x).view(1, 10, 4, 16).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.triu(torch.ones(10, 10, dtype=torch.bool), 1), float("-inf"))
    ref = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(1, 10, 64))
    torch.testing.assert_close(attn(x, rope), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie,bias", [(False, False), (True, False), (False, True)])
def test_param_count_matches_module(tie, bias):
    cfg = small(tie_embeddings=tie, attention_bias=bias)
    m = build_model(cfg, 32, seed=0)
    assert sum(p.numel() for p in m.parameters()) == param_count(cfg)["total"]
    if bias:  # Qwen2's q/k/v biases start at zero
        assert (
            all(not b.any() for n, b in m.named_parameters() if n.endswith(".bias"))
            and m.layers["0"].attn.wq.bias is not None
        )
    if tie:
        assert m.output.weight is m.embed.weight


def test_flops_per_token_formula():
    cfg = small()
    n = param_count(cfg)["non_embedding"]
    assert flops_per_token(cfg, 128) == 6 * n + 12 * 2 * 4 * 16 * 128


def test_deterministic_init_and_too_long_sequence():
    a, b = build_model(small(), 16, seed=5), build_model(small(), 16, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="max_seq_len"):
        a(torch.zeros(1, 17, dtype=torch.long))
