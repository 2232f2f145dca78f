"""Export a raysc model to a Hugging Face Llama (or Qwen2, Qwen3, Qwen3-MoE) folder.

Writes ``model.safetensors`` (HF parameter names), ``config.json`` for
``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with ``model.attention_bias``, ``Qwen3ForCausalLM`` with
``model.qk_norm``, ``Qwen3MoeForCausalLM`` for a mixture of experts, its experts one tensor per expert
as transformers writes them; what Qwen3-MoE cannot hold is refused, ``moe_problems``),
``generation_config.json`` and the tokenizer files that
``PreTrainedTokenizerFast`` reads. The special-token ids are the run's (``raysc.data.special_tokens``):
a public tokenizer's files are copied as they came, a raysc-trained one gets files written for it. Our rotary layout already matches HF's
("rotate half"), so q/k weights are copied without permutation. The name mapping lives in
``raysc.model.hf_names`` (import reads it backwards).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from raysc.data.special_tokens import SpecialTokens, copy_tokenizer, special_tokens_beside
from raysc.model.hf_names import ARCHITECTURES, EXPERT_PROJ, hf_name, model_type
from raysc.model.llama import Llama
from raysc.model.mup import fold_into_weights


def hf_config(model: Llama, dtype: str, special: SpecialTokens) -> dict:
    c = model.cfg
    family = model_type(c)
    return {
        # Qwen2 is Llama with q/k/v biases, Qwen3 with per-head q/k norms: transformers and vLLM load them as such
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.hidden_ffn_dim,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        **rope_config(c),
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        **({"use_sliding_window": False, "sliding_window": None} if family != "llama" else {}),
        "tie_word_embeddings": c.tie_embeddings,
        "initializer_range": c.init_std,
        **(moe_config(c) if c.moe_experts else {}),
        "bos_token_id": _bos_id(special),
        "eos_token_id": special.eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
    }


# A raysc model is a base model: no chat tuning, no role tokens. Chat requests (/v1/chat/completions)
# are rendered as a plain transcript, one "role: content" line per message, ending in "assistant:"
# so the model continues the conversation (docs/serving.md).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def rope_config(c) -> dict:
    """config.json's rotary keys: transformers 5's ``rope_parameters`` and, for a scaled rope, the
    ``rope_scaling`` that transformers 4, vLLM and llama.cpp's converter read."""
    if c.rope_scaling == "none":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}}
    scaling = {
        "rope_type": "llama3",
        "factor": c.rope_factor,
        "low_freq_factor": c.rope_low_freq_factor,
        "high_freq_factor": c.rope_high_freq_factor,
        "original_max_position_embeddings": c.rope_original_max_position,
    }
    return {"rope_scaling": scaling, "rope_parameters": {**scaling, "rope_theta": c.rope_theta}}


def moe_config(c) -> dict:
    """config.json's Qwen3-MoE keys (transformers' names; its router_aux_loss_coef is k times ours)."""
    return {
        "num_experts": c.moe_experts,
        "num_experts_per_tok": c.moe_top_k,
        "moe_intermediate_size": c.moe_hidden_dim,
        "norm_topk_prob": c.moe_norm_topk_prob,
        "decoder_sparse_step": c.moe_every_n_layers,
        "mlp_only_layers": list(range(c.moe_first_dense_layers)),
        "router_aux_loss_coef": c.moe_aux_loss_coeff * c.moe_top_k,
        "output_router_logits": False,
    }


def moe_problems(model: Llama) -> list[str]:
    """What a Qwen3-MoE checkpoint cannot hold of this mixture of experts, each with its setting: never
    dropped on the way out."""
    c, out = model.cfg, []
    if not c.qk_norm or c.attention_bias:
        out.append(
            f"Qwen3-MoE normalises q and k per head and has no q/k/v biases (model.qk_norm = "
            f"{str(c.qk_norm).lower()}, model.attention_bias = {str(c.attention_bias).lower()})"
        )
    if c.moe_shared_experts or c.moe_score_func != "softmax":
        out.append(
            f"Qwen3-MoE routes by softmax to routed experts only (model.moe_score_func = {c.moe_score_func!r}, "
            f"model.moe_shared_experts = {c.moe_shared_experts})"
        )
    n, k = c.moe_every_n_layers, c.moe_first_dense_layers
    if n > 1 and k % n:
        out.append(
            f"Qwen3-MoE's MoE layers are every decoder_sparse_step-th counted from layer 0; model.moe_every_n_layers"
            f" = {n} after model.moe_first_dense_layers = {k} counts from layer {k}"
        )
    biased = [n for n, b in model.named_buffers() if n.endswith("router.expert_bias") and bool(b.any())]
    if biased:
        out.append(
            f"a trained routing bias (model.moe_bias_update_rate = {c.moe_bias_update_rate:g}; {biased[0]} and "
            f"{len(biased) - 1} more) steers expert selection and has no key in Qwen3-MoE"
        )
    return out


def _bos_id(special: SpecialTokens) -> int:
    return special.eos_id if special.bos_id is None else special.bos_id  # no BOS: transformers wants an id


def export_hf(
    model: Llama,
    tokenizer_json: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    special: SpecialTokens | None = None,
) -> Path:
    """``tokenizer_json`` is a run's (its special tokens are read beside it unless ``special`` is given)."""
    problems = moe_problems(model) if model.cfg.moe_experts else []
    if problems:
        raise ValueError(
            "this mixture of experts cannot be written as Qwen3MoeForCausalLM without changing it: "
            + "; ".join(problems)
        )
    special = special or special_tokens_beside(tokenizer_json)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    # a tied output matrix appears once, as embed.weight; μP's logit and attention scales are
    # folded into the weights, since a Hugging Face Llama applies neither
    state = fold_into_weights(dict(model.named_parameters()), model.cfg)
    for name, p in state.items():
        value = p.detach().to("cpu", dtype)
        layer, _, rest = name.removeprefix("layers.").partition(".mlp.experts.")
        if rest in EXPERT_PROJ:  # (E, ., .): one tensor per expert, as transformers writes them
            for e, one in enumerate(value.unbind(0)):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_PROJ[rest]}.weight"] = one.contiguous().clone()
        else:
            tensors[hf_name(name)] = value.contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype_name, special), indent=2))
    copy_tokenizer(tokenizer_json, out)  # with its tokenizer_config.json and special_tokens_map.json, if any;
    # the generation config is the run's own (the source's sampling defaults are not the export's)
    stops = list(special.stops)
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": _bos_id(special),
                "eos_token_id": stops[0] if len(stops) == 1 else stops,
                "do_sample": False,
            },
            indent=2,
        )
    )
    if not (out / "tokenizer_config.json").is_file():  # a raysc-trained tokenizer: its files written here
        tokens = {"bos_token": special.bos or special.eos, "eos_token": special.eos, "unk_token": special.eos}
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": model.max_seq_len,
                    "add_bos_token": special.add_bos,
                    "add_eos_token": False,
                    "clean_up_tokenization_spaces": False,
                    "chat_template": CHAT_TEMPLATE,
                    **tokens,
                },
                indent=2,
            )
        )
        (out / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2))
    return out
