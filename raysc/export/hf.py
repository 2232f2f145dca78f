"""Export a raysc model to a Hugging Face Llama folder.

Writes ``model.safetensors`` (HF parameter names), ``config.json`` for
``LlamaForCausalLM``, ``generation_config.json`` and the tokenizer files that
``PreTrainedTokenizerFast`` reads. Our rotary layout already matches HF's
("rotate half"), so q/k weights are copied without permutation. The name mapping lives in
``raysc.model.hf_names`` (import reads it backwards).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from raysc.data.tokenizer import EOS, EOS_ID
from raysc.model.hf_names import hf_name
from raysc.model.llama import Llama
from raysc.model.mup import fold_into_weights


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


# A raysc model is a base model: no chat tuning, no role tokens. Chat requests (/v1/chat/completions)
# are rendered as a plain transcript, one "role: content" line per message, ending in "assistant:"
# so the model continues the conversation (docs/serving.md).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


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
         "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
         "chat_template": CHAT_TEMPLATE, **special},
        indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return out
