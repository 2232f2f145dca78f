"""The ``[model]`` section: the transformer's shape (sizes, heads, rotary embedding and its scaling,
Llama / Qwen2 / Qwen3 variants, a mixture of experts in place of the MLP: ``moe_*``), its
initialisation and μP, and continued pre-training from a Hugging Face checkpoint (``init_from``)."""

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
    moe_experts: int = opt(
        0,
        "mixture of experts: routed experts in each MoE layer; 0 = a dense model (raysc.model.moe, docs/moe.md)",
        min=0,
    )
    moe_top_k: int = opt(2, "mixture of experts: experts each token is routed to (dropless)", min=1)
    moe_ffn_dim: int = opt(0, "mixture of experts: hidden size of one expert; 0 = the dense ffn_dim", min=0)
    moe_shared_experts: int = opt(
        0, "mixture of experts: shared experts every token also passes through (Qwen2-MoE, DeepSeek)", min=0
    )
    moe_shared_expert_gate: bool = opt(
        False, "mixture of experts: a sigmoid gate on the shared experts' output (Qwen2-MoE)"
    )
    moe_score_func: str = opt(
        "softmax",
        "mixture of experts: the router's score function (softmax: Qwen, Mixtral, OLMoE; sigmoid: DeepSeek-V3)",
        choices=["softmax", "sigmoid"],
    )
    moe_norm_topk_prob: bool = opt(
        True,
        "mixture of experts: renormalise each token's top-k routing weights to sum to 1 (Qwen3-MoE and "
        "Mixtral: true; Qwen2-MoE and OLMoE: false)",
    )
    moe_first_dense_layers: int = opt(
        0, "mixture of experts: the first N layers keep a dense MLP (DeepSeek's first_k_dense_replace)", min=0
    )
    moe_every_n_layers: int = opt(
        1,
        "mixture of experts: after the first dense layers, every n-th layer is MoE, the others dense "
        "(Qwen2/3-MoE's decoder_sparse_step)",
        min=1,
    )
    moe_aux_loss_coeff: float = opt(
        0.0,
        "mixture of experts: switch load-balancing loss per layer, Megatron-core's form (1.0 at a uniform "
        "load); transformers' router_aux_loss_coef is k times larger for the same value (it pools layers "
        "and counts load summing to k): divide it by top_k",
        min=0.0,
    )
    moe_z_loss_coeff: float = opt(
        0.0, "mixture of experts: router z-loss (mean squared log-sum-exp of the logits; 1e-3 is usual)", min=0.0
    )
    moe_bias_update_rate: float = opt(
        0.0,
        "mixture of experts: DeepSeek-V3's auxiliary-loss-free balancing, each step every expert's "
        "selection bias moves this much toward balance (1e-3 is usual); 0 = off",
        min=0.0,
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
    def moe_hidden_dim(self) -> int:
        """One routed expert's hidden size."""
        return self.moe_ffn_dim or self.hidden_ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has a mixture of experts rather than a dense MLP."""
        if not self.moe_experts or layer < self.moe_first_dense_layers:
            return False
        return (layer - self.moe_first_dense_layers + 1) % self.moe_every_n_layers == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    @property
    def hidden_ffn_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        raw = int(8 * self.dim / 3)
        m = self.ffn_multiple_of
        return m * ((raw + m - 1) // m)
