"""Export a raysc model to a Hugging Face Llama folder.

Writes ``model.safetensors`` (HF parameter names), ``config.json`` for
``LlamaForCausalLM``, ``generation_config.json`` and the tokenizer files that
``PreTrainedTokenizerFast`` reads. Our rotary layout already matches HF's
("rotate half"), so q/k weights are copied without permutation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from raysc.data.tokenizer import EOS, EOS_ID
from raysc.model.llama import Llama
from raysc.model.mup import fold_into_weights

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def hf_name(name: str) -> str:
    """Map a raysc parameter name to its Hugging Face Llama name."""
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def hf_config(model: Llama, dtype: str) -> dict:
    c = model.cfg
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.hidden_ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings, "initializer_range": c.init_std,
        "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "use_cache": True, "torch_dtype": dtype,
    }


def export_hf(model: Llama, tokenizer_json: str | Path, out_dir: str | Path,
              dtype: torch.dtype = torch.float32) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    # a tied output matrix appears once, as embed.weight; μP's logit and attention scales are
    # folded into the weights, since a Hugging Face Llama applies neither
    state = fold_into_weights(dict(model.named_parameters()), model.cfg)
    for name, p in state.items():
        tensors[hf_name(name)] = p.detach().to("cpu", dtype).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtype_name = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config(model, dtype_name), indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=2))
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    special = {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.max_seq_len,
         "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False, **special},
        indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out
