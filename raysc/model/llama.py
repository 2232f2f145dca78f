"""A Llama-architecture decoder in plain torch.

Token embedding, RMSNorm, rotary position embeddings (the "rotate half" layout
Hugging Face uses, so exported weights need no permutation), grouped-query
attention through ``scaled_dot_product_attention`` and a SwiGLU MLP, or in the layers ``model.moe_*``
names a mixture of experts (``raysc.model.moe``). Public families are switches on it: q/k/v biases (Qwen2),
an RMSNorm per head on q and k (Qwen3), llama3 rope scaling.

The model knows nothing about parallelism: tensor/sequence/pipeline/context
parallel plans are applied from outside. To keep that possible:
- head counts in ``Attention.forward`` come from tensor shapes, so a
  column-parallel (TP) shard of ``wq/wk/wv`` just works;
- ``layers`` is a ``ModuleDict`` keyed by the global layer index, so a pipeline
  stage can drop layers and keep parameter names (and checkpoints) stable;
- ``embed``, ``norm`` and ``output`` may be ``None`` on middle pipeline stages;
- ``forward`` takes optional ``positions`` for context-parallel chunks, and optional ``documents``
  (``raysc.model.documents``: each token's document id over the whole row) for block-causal attention,
  with rotary positions restarting per document when ``restart_positions`` is set.

Under μP (``model.mup``) three scalars change, all from ``raysc.model.mup``:
hidden-matrix init std, the logit multiplier and the attention softmax scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from raysc.config.schema import ModelConfig
from raysc.model import mup
from raysc.model.documents import QueryBlocks, document_mask, positions_in_document
from raysc.model.feed_forward import FeedForward
from raysc.model.moe import MoEFeedForward


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary inverse frequencies (head_dim / 2), with ``model.rope_scaling`` applied.

    llama3 (Llama 3.1's long-context scaling, as Meta's reference code and transformers compute it): a
    frequency whose wavelength is longer than ``original_max_position / low_freq_factor`` is divided by
    ``factor``, one shorter than ``original_max_position / high_freq_factor`` is kept, and those between
    are interpolated by how many of their wavelengths fit in the original context."""
    head_dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if cfg.rope_scaling != "llama3":
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen <= old / low) & (wavelen >= old / high)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_len, head_dim) in the rotate-half layout."""
    inv_freq = rope_inv_freq(cfg)
    t = torch.arange(max_len, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, seq, head_dim) by per-position tables (seq, head_dim)."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | QueryBlocks | None = None,
) -> torch.Tensor:
    """Causal scaled-dot-product attention; k/v with fewer heads are shared by query-head groups (GQA).
    ``scale`` multiplies q·k (None = 1/sqrt(head_dim); μP passes 1/head_dim); ``mask`` (boolean, True =
    attend), when given, replaces the causal mask (block-causal attention over packed documents)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if isinstance(mask, QueryBlocks):
        return mask.attend(q, k, v, scale)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


class Rope:
    """Rotary tables for one forward pass: the first ``seqlen`` positions, or explicit ``positions``
    ((seq,) shared by the batch, or (batch, seq) when positions restart per document); ``mask`` is the
    attention mask of the pass when it is not plain causal (block-causal over documents)."""

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        mask: torch.Tensor | QueryBlocks | None = None,
    ) -> None:
        self.cos, self.sin, self.positions, self.mask = cos, sin, positions, mask

    def tables(self, seqlen: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.positions is not None:
            cos, sin = self.cos[self.positions], self.sin[self.positions]
            if self.positions.dim() == 2:  # (batch, seq, head_dim) -> broadcast over heads
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        else:
            if seqlen > self.cos.shape[0]:
                raise ValueError(
                    f"sequence of {seqlen} tokens is longer than the model's rotary table "
                    f"({self.cos.shape[0]}); raise model.max_seq_len."
                )
            cos, sin = self.cos[:seqlen], self.sin[:seqlen]
        return cos.to(dtype), sin.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.mup = cfg.mup  # μP: softmax scale 1/head_dim instead of 1/sqrt(head_dim)
        bias = cfg.attention_bias  # Qwen2's q/k/v biases (column-parallel under TP, like their weights)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Qwen3's qk-norm: one RMSNorm over each head's q (and k) before rotary, its weight shared by all heads
        # (under TP each rank normalises its own heads and the weight's gradient is summed over the TP group)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # (q, k, v) -> attention output; context parallelism swaps in a distributed kernel
        self.core_attention: Callable[..., torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope.tables(seqlen, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # μP: softmax scale 1/head_dim, read from q (the same on every TP shard: TP splits heads)
        scale = mup.attention_scale(q.shape[-1]) if self.mup else None
        out = self.core_attention(q, k, v, scale=scale, mask=rope.mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoEFeedForward(cfg) if cfg.is_moe_layer(layer) else FeedForward(cfg.dim, cfg.hidden_ffn_dim)

    def forward(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


def init_value(
    cfg: ModelConfig,
    name: str,
    shape: torch.Size,
    generator: torch.Generator | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The initial value of parameter ``name`` (full shape, on CPU): Normal(0, init_std) matrices,
    output projections scaled by 1/sqrt(2·layers), unit norms; under μP hidden matrices also by
    1/sqrt(width multiplier); zero biases. Draws ``numel`` normals from ``generator`` for a matrix, none for
    a norm or a bias."""
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, init_std(cfg, name), generator=generator)


def init_std(cfg: ModelConfig, name: str) -> float:
    """The standard deviation of matrix parameter ``name``'s normal initialisation."""
    std = cfg.init_std
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "experts.w_down", "shared.w_down.weight")):
        std = std / math.sqrt(2 * cfg.n_layers)
    return std * mup.init_mult(name, cfg)


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits`` (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        cos, sin = rope_tables(cfg, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # positions of this module's tokens when not 0..seq-1 (set by context parallelism)
        self.positions: torch.Tensor | None = None
        # with ``documents`` given: rotary positions count from each document's start (train.document_positions)
        self.restart_positions = False
        # μP readout multiplier 1/m (1 otherwise), applied to the output projection's input
        self.logit_mult = mup.output_mult(cfg)

    def _rope(self, seqlen: int, positions: torch.Tensor | None, documents: torch.Tensor | None) -> Rope:
        if documents is None:
            return Rope(self.rope_cos, self.rope_sin, positions)
        # the queries: this rank's chunks under CP (``positions``), else the whole row (not ``seqlen``: under
        # sequence parallelism the embedding's output holds a slice of the row, attention sees all of it)
        mask = document_mask(documents, positions)
        if self.restart_positions:
            within = positions_in_document(documents)
            positions = within if positions is None else within[:, positions]
        return Rope(self.rope_cos, self.rope_sin, positions, mask)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Every parameter from ``init_value``, in ``named_parameters`` order (the order that fixes
        which random numbers each parameter draws from ``generator``)."""
        for name, p in self.named_parameters():
            p.copy_(init_value(self.cfg, name, p.shape, generator, p.dtype))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rotary tables and zero the routers' selection biases in place (after ``to_empty``
        left them uninitialised; a checkpoint's biases are loaded after)."""
        cos, sin = rope_tables(self.cfg, self.max_seq_len)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for name, buf in self.named_buffers():
            if name.endswith("router.expert_bias"):
                buf.zero_()

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``tokens`` (batch, seq) ids, or hidden states on a later pipeline stage; ``positions``
        (seq,) absolute positions of the tokens (default ``self.positions``, else 0..seq-1);
        ``documents`` (batch, whole row) each token's document id (``raysc.model.documents``): attention
        is then block-causal, a token seeing only earlier tokens of its own document."""
        h = self.embed(tokens) if self.embed is not None else tokens
        rope = self._rope(h.shape[1], positions if positions is not None else self.positions, documents)
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        # logits·(1/m) = output(h/m): scaling the dim-wide input is cheaper than the vocab-wide logits
        return self.output(h) if self.logit_mult == 1.0 else self.output(h * self.logit_mult)


def build_model(cfg: ModelConfig, max_seq_len: int, seed: int, device: str | torch.device = "cpu") -> Llama:
    """Build and initialise the model deterministically from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    model = Llama(cfg, max_seq_len)
    model.init_weights(gen)
    return model.to(device)
