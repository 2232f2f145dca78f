"""Export a raysc model to one GGUF file that llama.cpp runs (``raysc export --format gguf``).

The ``gguf`` package (llama.cpp's own gguf-py, pure numpy) writes the file and
quantizes Q8_0/Q4_0 blocks; what is ours is the mapping:

- metadata of llama.cpp's ``llama`` architecture (``qwen2`` for a model with q/k/v
  biases, whose rotary layout needs no permutation): sizes, GQA head counts, head
  dimension, RMSNorm epsilon, RoPE base and dimension, context length; with llama3
  rope scaling, the ``rope_freqs`` tensor of per-frequency divisors that llama.cpp's
  converter writes for Llama 3.1;
- the run's byte-level BPE ``tokenizer.json`` as llama.cpp's ``gpt2`` tokenizer
  model: tokens in id order (padded to the embedding's size with unused
  ``[PAD<id>]`` tokens), merges, token types (special tokens control), and the run's
  BOS, EOS and whether BOS is added (``raysc.data.special_tokens``), the same as the
  Hugging Face export. The pre-tokenizer name tells llama.cpp which regex splits text
  (``pre_tokenizer_name``): ``gpt-2`` for the ``tokenizers`` ByteLevel pre-tokenizer
  raysc trains with (tests/test_export_gguf.py checks that llama.cpp tokenizes like
  raysc), ``llama-bpe`` for Llama 3's split, ``qwen2`` for Qwen2's. llama.cpp's own
  converter recognises a pre-tokenizer by hashing what it does to a test text; we
  read the split regex from tokenizer.json instead, which needs no table of hashes.
  SentencePiece vocabularies (llama.cpp's ``llama`` model: Llama 2, Mistral) are
  refused with the reason;
- q/k projections permuted from our rotary layout ("rotate half": dimension i
  pairs with i + head_dim/2) to the interleaved pairs (2i, 2i+1) that llama.cpp's
  ``llama`` architecture rotates, the permutation llama.cpp's HF converter applies;
- μP's logit and attention scales folded into the weights (``fold_into_weights``,
  as the HF export does); a tied output is left out, so llama.cpp reads the
  embedding for it.

Types (``--type``): norms stay F32 in every file. ``f32`` and ``f16`` store the
matrices in that type. ``q8_0`` stores every matrix as Q8_0; ``q4_0`` stores them
as Q4_0 except the output projection (or the tied embedding that serves as it),
which gets Q8_0, as llama.cpp's own Q4_0 keeps its output at 6 bits or more. A
matrix whose rows do not split into 32-value blocks falls back to F16 (llama.cpp's
converter does the same). ``blocks`` lets a caller supply some matrices' quantized
blocks itself (``raysc.quantize.gguf_gptq``: GPTQ's rounding on the Q4_0 grid).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import gguf
import numpy as np
import torch

from raysc.data.special_tokens import SpecialTokens, special_tokens_beside
from raysc.model.llama import Llama, rope_inv_freq
from raysc.model.mup import fold_into_weights

Q = gguf.GGMLQuantizationType
TYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
# the split regexes of public byte-level BPE tokenizers (tokenizer.json's pre_tokenizer Split pattern), by
# llama.cpp's pre-tokenizer name; they differ in how digits group (\p{N}{1,3} against \p{N})
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PRE_TOKENIZERS = {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}

T = gguf.MODEL_TENSOR
_LAYER_TENSORS = {
    "attn_norm.weight": T.ATTN_NORM, "attn.wq.weight": T.ATTN_Q, "attn.wk.weight": T.ATTN_K,
    "attn.wv.weight": T.ATTN_V, "attn.wo.weight": T.ATTN_OUT, "mlp_norm.weight": T.FFN_NORM,
    "mlp.w_gate.weight": T.FFN_GATE, "mlp.w_up.weight": T.FFN_UP, "mlp.w_down.weight": T.FFN_DOWN,
}

def gguf_name(name: str) -> str:
    """Map a raysc parameter name to its llama.cpp tensor name (``blk.0.attn_q.weight``)."""
    top = {"embed.weight": T.TOKEN_EMBD, "norm.weight": T.OUTPUT_NORM, "output.weight": T.OUTPUT}
    if name in top:
        return gguf.TENSOR_NAMES[top[name]] + ".weight"
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        base, _, kind = rest.rpartition(".")
        if f"{base}.weight" in _LAYER_TENSORS and kind in ("weight", "bias"):
            return gguf.TENSOR_NAMES[_LAYER_TENSORS[f"{base}.weight"]].format(bid=int(idx)) + f".{kind}"
    raise KeyError(f"no GGUF name for parameter {name!r}")


def interleave_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (n_heads·head_dim, ...) reordered per head from the rotate-half
    layout (row i pairs with i + head_dim/2) to interleaved pairs (rows 2i, 2i+1); the rows may
    be weights or their quantized blocks."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_fields(tokenizer_json: str | Path, vocab_size: int) -> dict:
    """tokens, token types and merges of a byte-level BPE ``tokenizer.json`` for a ``gpt2`` GGUF vocab."""
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style BPE (byte fallback: Llama 2, Mistral)" if model.get("byte_fallback") else \
            repr(model.get("type"))
        raise ValueError(f"{tokenizer_json}: GGUF export handles byte-level BPE tokenizers (raysc's own, GPT-2, "
                         f"Llama 3, Qwen2), not {kind}; export this run with `raysc export` (Hugging Face "
                         f"format) and convert it with llama.cpp's convert_hf_to_gguf.py")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    control = set()
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special"):
            control.add(added["id"])
    if max(by_id) >= vocab_size:
        raise ValueError(f"{tokenizer_json} has token id {max(by_id)} but the model's embedding has "
                         f"{vocab_size} rows; export with the tokenizer the run trained with")
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL)
        else:  # embedding rows the tokenizer never produces (a small corpus learns fewer merges)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre_tokenizer_name(spec, tokenizer_json)}


def pre_tokenizer_name(spec: dict, where: str | Path = "tokenizer.json") -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for the pre-tokenizer of ``spec`` (a tokenizer.json):
    ``gpt-2`` for a plain ByteLevel with its own regex, else by the Split regex before a ByteLevel."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    split = [p for p in steps if p.get("type") == "Split"]
    level = [p for p in steps if p.get("type") == "ByteLevel"]
    if not split and len(level) == 1 and level[0].get("use_regex", True):
        return "gpt-2"
    if len(split) == 1 and level:
        pattern = split[0].get("pattern") or {}
        name = SPLIT_PRE_TOKENIZERS.get(pattern.get("Regex", ""))
        if name:
            return name
    raise ValueError(f"{where}: its pre-tokenizer ({json.dumps(pre)[:200]}) is none that raysc's GGUF export "
                     f"knows (GPT-2's ByteLevel, Llama 3's or Qwen2's split); export with `raysc export` "
                     f"(Hugging Face format) and convert with llama.cpp's convert_hf_to_gguf.py")


def tensor_type(name: str, shape: tuple[int, ...], qtype: str, tied: bool) -> Q:
    """The GGML type of tensor ``name`` (a gguf name) in a ``qtype`` file."""
    if len(shape) == 1:
        return Q.F32
    want = TYPES[qtype]
    output = name == "output.weight" or (tied and name == "token_embd.weight")
    if want == Q.Q4_0 and output:
        want = Q.Q8_0
    if want in (Q.Q8_0, Q.Q4_0) and shape[-1] % gguf.GGML_QUANT_SIZES[want][0] != 0:
        want = Q.F16
    return want


def export_gguf(model: Llama, tokenizer_json: str | Path, out_file: str | Path, qtype: str = "f32",
                name: str = "raysc", blocks: dict[str, np.ndarray] | None = None,
                special: SpecialTokens | None = None) -> Path:
    """Write ``model`` and its tokenizer as one GGUF file of type ``qtype`` (f32, f16, q8_0, q4_0).

    ``blocks``: raysc parameter name -> that matrix's blocks of the type ``tensor_type`` gives it
    (uint8, one row of blocks per weight row, rows in raysc's order), written instead of quantizing
    the weight here; they must be blocks of the weights as exported (μP folded). ``special``: the
    special tokens (default: the run's, read beside ``tokenizer_json``)."""
    if qtype not in TYPES:
        raise ValueError(f"GGUF type {qtype!r} is not one of {', '.join(TYPES)}")
    c = model.cfg
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Qwen2 (q/k/v biases) is llama.cpp's qwen2 architecture, which rotates halves (NEOX) as raysc does
    arch = "qwen2" if c.attention_bias else "llama"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_file_type(FILE_TYPES[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(c.vocab_size)
    w.add_context_length(model.max_seq_len)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.hidden_ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    if c.rope_scaling == "llama3":  # llama.cpp divides each frequency by its factor from this tensor
        base = rope_inv_freq(dataclasses.replace(c, rope_scaling="none"))
        w.add_tensor(gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight", (base / rope_inv_freq(c)).numpy().astype(np.float32))
    w.add_layer_norm_rms_eps(c.norm_eps)

    tok = tokenizer_fields(tokenizer_json, c.vocab_size)
    special = special or special_tokens_beside(tokenizer_json)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(special.eos_id if special.bos_id is None else special.bos_id)
    w.add_eos_token_id(special.eos_id)
    if special.pad_id is not None:
        w.add_pad_token_id(special.pad_id)
    w.add_add_bos_token(special.add_bos)
    w.add_add_eos_token(False)

    # a tied output matrix appears once, as embed.weight (named_parameters lists shared ones once)
    state = fold_into_weights(dict(model.named_parameters()), c)
    blocks = blocks or {}
    if unknown := set(blocks) - set(state):
        raise KeyError(f"blocks given for {sorted(unknown)}, which the model does not have")
    for pname, p in state.items():
        gname = gguf_name(pname)
        kind = tensor_type(gname, tuple(p.shape), qtype, c.tie_embeddings)
        if pname in blocks:
            t = torch.from_numpy(np.ascontiguousarray(blocks[pname]))
            expect = (p.shape[0], p.shape[1] // gguf.GGML_QUANT_SIZES[kind][0] * gguf.GGML_QUANT_SIZES[kind][1])
            if t.dtype != torch.uint8 or tuple(t.shape) != expect:
                raise ValueError(f"blocks of {pname} are {t.dtype} {tuple(t.shape)}; a {kind.name} tensor of "
                                 f"shape {tuple(p.shape)} needs uint8 {expect}")
        else:
            t = p.detach().to("cpu", torch.float32)
        if arch == "llama" and pname.endswith("attn.wq.weight"):
            t = interleave_rotary(t, c.n_heads)
        elif arch == "llama" and pname.endswith("attn.wk.weight"):
            t = interleave_rotary(t, c.n_kv_heads)
        data = t.contiguous().numpy()
        w.add_tensor(gname, data if pname in blocks else gguf.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
