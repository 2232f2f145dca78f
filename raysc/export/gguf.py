"""Export a raysc model to one GGUF file that llama.cpp runs (``raysc export --format gguf``).

The ``gguf`` package (llama.cpp's own gguf-py, pure numpy) writes the file and
quantizes Q8_0/Q4_0 blocks; what is ours is the mapping:

- metadata of llama.cpp's ``llama`` architecture (``qwen2`` for a model with q/k/v
  biases, ``qwen3`` for one with per-head q/k norms; their rotary layout needs no permutation): sizes, GQA head counts, head
  dimension, RMSNorm epsilon, RoPE base and dimension, context length; with llama3
  rope scaling, the ``rope_freqs`` tensor of per-frequency divisors that llama.cpp's
  converter writes for Llama 3.1;
- the run's ``tokenizer.json`` as llama.cpp's ``gpt2`` (byte-level BPE) or ``llama``
  (SentencePiece: Llama 2, Mistral) vocabulary with the run's special tokens
  (``raysc.export.gguf_vocab``; tests/test_export_gguf.py and tests/test_tokenizer.py
  check that llama.cpp tokenizes as raysc and as llama.cpp's own files expect);
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
from pathlib import Path

import gguf
import numpy as np
import torch

from raysc.data.special_tokens import SpecialTokens, special_tokens_beside
from raysc.export.gguf_vocab import add_vocab
from raysc.model.hf_names import model_type, require_dense
from raysc.model.llama import Llama, rope_inv_freq
from raysc.model.mup import fold_into_weights

Q = gguf.GGMLQuantizationType
TYPES = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
T = gguf.MODEL_TENSOR
_LAYER_TENSORS = {
    "attn_norm.weight": T.ATTN_NORM,
    "attn.wq.weight": T.ATTN_Q,
    "attn.wk.weight": T.ATTN_K,
    "attn.wv.weight": T.ATTN_V,
    "attn.wo.weight": T.ATTN_OUT,
    "mlp_norm.weight": T.FFN_NORM,
    "attn.q_norm.weight": T.ATTN_Q_NORM,
    "attn.k_norm.weight": T.ATTN_K_NORM,
    "mlp.w_gate.weight": T.FFN_GATE,
    "mlp.w_up.weight": T.FFN_UP,
    "mlp.w_down.weight": T.FFN_DOWN,
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


def export_gguf(
    model: Llama,
    tokenizer_json: str | Path,
    out_file: str | Path,
    qtype: str = "f32",
    name: str = "raysc",
    blocks: dict[str, np.ndarray] | None = None,
    special: SpecialTokens | None = None,
) -> Path:
    """Write ``model`` and its tokenizer as one GGUF file of type ``qtype`` (f32, f16, q8_0, q4_0).

    ``blocks``: raysc parameter name -> that matrix's blocks of the type ``tensor_type`` gives it
    (uint8, one row of blocks per weight row, rows in raysc's order), written instead of quantizing
    the weight here; they must be blocks of the weights as exported (μP folded). ``special``: the
    special tokens (default: the run's, read beside ``tokenizer_json``)."""
    if qtype not in TYPES:
        raise ValueError(f"GGUF type {qtype!r} is not one of {', '.join(TYPES)}")
    require_dense(model.cfg, "GGUF")
    c = model.cfg
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Qwen2 (q/k/v biases) and Qwen3 (q/k norms) are llama.cpp architectures that rotate halves (NEOX) as
    # raysc does, so their q/k rows keep raysc's order
    arch = model_type(c)
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

    add_vocab(w, tokenizer_json, c.vocab_size, special or special_tokens_beside(tokenizer_json))

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
                raise ValueError(
                    f"blocks of {pname} are {t.dtype} {tuple(t.shape)}; a {kind.name} tensor of "
                    f"shape {tuple(p.shape)} needs uint8 {expect}"
                )
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
