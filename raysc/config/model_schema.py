"""The ``[model]`` section: the transformer's shape (sizes, heads, rotary embedding and its scaling,
Llama / Qwen2 / Qwen3 variants), its initialisation and μP, and continued pre-training from a Hugging Face
checkpoint (``init_from``)."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt, opt_dict


@dataclass
class ModelConfig:
    vocab_size: int = opt(2048, "tokenizer and embedding size", min=260)
    dim: int = opt(128, "hidden size", min=8)
    n_layers: int = opt(4, "transformer blocks", min=1)
    n_heads: int = opt(4, "query heads", min=1)
    n_kv_heads: int = opt(2, "key/value heads (grouped-query attention); must divide n_heads", min=1)
    attn_head_dim: int = opt(
        0,
        "size of one attention head; 0 = dim / n_heads. Set it for checkpoints whose "
        "heads are not dim / n_heads wide (Qwen3-0.6B: dim 1024, 16 heads of 128)",
        min=0,
        key="head_dim",
    )
    ffn_dim: int = opt(0, "SwiGLU hidden size; 0 = 8/3·dim rounded up to ffn_multiple_of", min=0)
    ffn_multiple_of: int = opt(32, "rounding for the automatic ffn_dim", min=1)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", gt=0.0)
    rope_theta: float = opt(10000.0, "rotary embedding base", gt=0.0)
    rope_scaling: str = opt(
        "none",
        "rotary frequency scaling: none, or llama3 (Llama 3.1/3.2/3.3: long wavelengths "
        "divided by rope_factor, short ones kept, a smooth band between)",
        choices=["none", "llama3"],
    )
    rope_factor: float = opt(8.0, "llama3 rope scaling: the factor long wavelengths are stretched by", gt=0.0)
    rope_low_freq_factor: float = opt(
        1.0, "llama3 rope scaling: wavelengths above original_max_position / this are scaled", gt=0.0
    )
    rope_high_freq_factor: float = opt(
        4.0, "llama3 rope scaling: wavelengths below original_max_position / this are kept", gt=0.0
    )
    rope_original_max_position: int = opt(
        8192, "llama3 rope scaling: the context length the model was first trained at", min=1
    )
    tie_embeddings: bool = opt(False, "share the input embedding with the output projection")
    attention_bias: bool = opt(
        False,
        "biases on the q, k and v projections: the Qwen2 / Qwen2.5 architecture "
        "(exported as Qwen2ForCausalLM); false = Llama",
    )
    qk_norm: bool = opt(
        False,
        "an RMSNorm over each head's queries and keys before rotary: the Qwen3 architecture "
        "(exported as Qwen3ForCausalLM)",
    )
    max_seq_len: int = opt(0, "longest sequence the rotary table covers; 0 = train.seq_len", min=0)
    init_std: float = opt(0.02, "standard deviation of the weight initialisation", gt=0.0)
    mup: bool = opt(
        False,
        "maximal update parametrisation (μP, Tensor Programs V): hidden matrices get LR/m and "
        "init_std/sqrt(m), logits ×1/m, attention scores 1/head_dim, m = dim/mup_base_width; "
        "an LR tuned at the base width transfers to wider models (docs/scaling.md)",
    )
    mup_base_width: int = opt(
        0, "μP base width: the model.dim at which optim.lr and init_std were tuned; 0 = model.dim (multiplier 1)", min=0
    )
    init_from: str = opt(
        "",
        "continued pre-training: start from this Hugging Face Llama checkpoint (a directory "
        "or URL holding config.json and model.safetensors, or shards with "
        "model.safetensors.index.json) instead of a random init; its tokenizer.json becomes "
        "the run's tokenizer when data.tokenizer is empty; the optimizer starts fresh "
        "(`raysc train --init-from`)",
    )
    init_from_options: dict = opt_dict(
        "fsspec options for reading model.init_from when it is an object-store URL, "
        'passed as they are (s3fs: {endpoint_url = "http://...", key = "...", '
        'secret = "...", client_kwargs = {region_name = "..."}})'
    )

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def mup_width_mult(self) -> float:
        """μP width multiplier m = dim / mup_base_width (1 when the base width is 0 = dim)."""
        return self.dim / (self.mup_base_width or self.dim)

    @property
    def hidden_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        raw = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((raw + m - 1) // m)
