"""A run's Hugging Face ``tokenizer.json`` as a GGUF vocabulary that llama.cpp tokenizes with.

Two of llama.cpp's tokenizer models, chosen by what the tokenizer.json holds:

- ``gpt2`` for byte-level BPE (raysc's own tokenizer, GPT-2, Llama 3, Qwen2): tokens in id order,
  merges, token types (special tokens control) and the pre-tokenizer name that tells llama.cpp which
  regex splits text (``pre_tokenizer_name``): ``gpt-2`` for the ``tokenizers`` ByteLevel
  pre-tokenizer raysc trains with, ``llama-bpe`` for Llama 3's split, ``qwen2`` for Qwen2's.
  llama.cpp's own converter recognises a pre-tokenizer by hashing what it does to a test text; we read
  the split regex from tokenizer.json instead, which needs no table of hashes.
- ``llama`` (SentencePiece) for BPE with byte fallback over ``▁``-marked words (Llama 2, Mistral):
  tokens, byte tokens (``<0x0A>``) typed as bytes, and scores. llama.cpp's SentencePiece tokenizer
  merges the adjacent pair whose concatenation has the highest score; tokenizer.json keeps merges,
  not scores, so a token's score is minus the rank of the first merge that makes it, which orders the
  merges as tokenizer.json does. llama.cpp's converter reads the scores from ``tokenizer.model``
  (SentencePiece's protobuf), which a run directory does not keep; gguf-py's ``LlamaHfVocab``, its
  fallback, gives every token the same score, which llama.cpp would merge left to right.

Either way the vocabulary is padded to the embedding's size with unused ``[PAD<id>]`` tokens (a
small corpus learns fewer merges than the embedding has rows), and the run's BOS, EOS, PAD and whether
BOS is added come from ``raysc.data.special_tokens``, as in the Hugging Face export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf

from raysc.data.special_tokens import SpecialTokens

# the split regexes of public byte-level BPE tokenizers (tokenizer.json's pre_tokenizer Split pattern), by
# llama.cpp's pre-tokenizer name; they differ in how digits group (\p{N}{1,3} against \p{N})
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PRE_TOKENIZERS = {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
UNMERGED_SCORE = -1e9  # a SentencePiece token no merge makes: llama.cpp merges into it last, if at all


def tokenizer_fields(tokenizer_json: str | Path, vocab_size: int) -> dict:
    """The GGUF vocabulary of ``tokenizer_json`` for an embedding of ``vocab_size`` rows: ``model``
    (``gpt2`` or ``llama``), ``tokens``, ``types``, and ``merges`` and ``pre`` (gpt2) or ``scores``,
    ``unk_id`` and ``add_space_prefix`` (llama)."""
    spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(
            f"{tokenizer_json}: GGUF export handles BPE tokenizers (byte-level: raysc's own, GPT-2, "
            f"Llama 3, Qwen2; with byte fallback: Llama 2, Mistral), not {model.get('type')!r}; "
            f"export this run with `raysc export` (Hugging Face format) and convert it with "
            f"llama.cpp's convert_hf_to_gguf.py"
        )
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    control = set()
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special"):
            control.add(added["id"])
    if max(by_id) >= vocab_size:
        raise ValueError(
            f"{tokenizer_json} has token id {max(by_id)} but the model's embedding has "
            f"{vocab_size} rows; export with the tokenizer the run trained with"
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if model.get("byte_fallback"):
        return _sentencepiece_fields(spec, by_id, control, merges, vocab_size, tokenizer_json)
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    return {
        "model": "gpt2",
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "pre": pre_tokenizer_name(spec, tokenizer_json),
    }


def _sentencepiece_fields(
    spec: dict, by_id: dict[int, str], control: set[int], merges: list[str], vocab_size: int, where: str | Path
) -> dict:
    """llama.cpp's ``llama`` vocabulary of a byte-fallback BPE tokenizer.json: scores from merge ranks."""
    if not _marks_words(spec):
        raise ValueError(
            f"{where}: a byte-fallback BPE tokenizer whose words are not marked with '▁' (a Metaspace "
            f"pre-tokenizer or a Prepend/Replace normalizer) is not SentencePiece-style; export with "
            f"`raysc export` (Hugging Face format) and convert with llama.cpp's convert_hf_to_gguf.py"
        )
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        first_rank.setdefault(merge.replace(" ", ""), rank)
    unk = spec["model"].get("unk_token")
    unk_id = next((i for i, t in by_id.items() if t == unk), None) if unk else None
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            scores.append(UNMERGED_SCORE)
            continue
        tokens.append(text)
        if i == unk_id:
            types.append(gguf.TokenType.UNKNOWN)
        elif i in control:
            types.append(gguf.TokenType.CONTROL)
        elif _BYTE_TOKEN.fullmatch(text):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
        if types[-1] != gguf.TokenType.NORMAL or len(text) == 1:
            scores.append(0.0)  # never the result of a merge: its score is not read
        else:
            scores.append(-float(first_rank[text]) if text in first_rank else UNMERGED_SCORE)
    return {
        "model": "llama",
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "unk_id": unk_id,
        "add_space_prefix": _prepends_space(spec),
    }


def _steps(part: dict | None, kind: str) -> list[dict]:
    """The steps of a normalizer or pre-tokenizer (a ``Sequence`` of them, one, or none)."""
    if not part:
        return []
    return part.get(kind, []) if part.get("type") == "Sequence" else [part]


def _marks_words(spec: dict) -> bool:
    """Whether spaces become ``▁`` (SentencePiece's word mark) before the model sees the text."""
    pre = _steps(spec.get("pre_tokenizer"), "pretokenizers")
    norm = _steps(spec.get("normalizer"), "normalizers")
    return any(p.get("type") == "Metaspace" for p in pre) or any(
        n.get("type") == "Replace" and n.get("content") == "▁" for n in norm
    )


def _prepends_space(spec: dict) -> bool:
    """Whether a ``▁`` is put before the first word (llama.cpp's ``add_space_prefix``)."""
    for p in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never") != "never"
    return any(
        n.get("type") == "Prepend" and n.get("prepend") == "▁" for n in _steps(spec.get("normalizer"), "normalizers")
    )


def pre_tokenizer_name(spec: dict, where: str | Path = "tokenizer.json") -> str:
    """llama.cpp's name (``tokenizer.ggml.pre``) for the pre-tokenizer of ``spec`` (a tokenizer.json):
    ``gpt-2`` for a plain ByteLevel with its own regex, else by the Split regex before a ByteLevel."""
    pre = spec.get("pre_tokenizer") or {}
    steps = _steps(pre, "pretokenizers")
    split = [p for p in steps if p.get("type") == "Split"]
    level = [p for p in steps if p.get("type") == "ByteLevel"]
    if not split and len(level) == 1 and level[0].get("use_regex", True):
        return "gpt-2"
    if len(split) == 1 and level:
        pattern = split[0].get("pattern") or {}
        name = SPLIT_PRE_TOKENIZERS.get(pattern.get("Regex", ""))
        if name:
            return name
    raise ValueError(
        f"{where}: its pre-tokenizer ({json.dumps(pre)[:200]}) is none that raysc's GGUF export "
        f"knows (GPT-2's ByteLevel, Llama 3's or Qwen2's split); export with `raysc export` "
        f"(Hugging Face format) and convert with llama.cpp's convert_hf_to_gguf.py"
    )


def add_vocab(w: gguf.GGUFWriter, tokenizer_json: str | Path, vocab_size: int, special: SpecialTokens) -> str:
    """Write the vocabulary and the special tokens into ``w``; returns the tokenizer model's name."""
    tok = tokenizer_fields(tokenizer_json, vocab_size)
    w.add_tokenizer_model(tok["model"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    if tok["model"] == "gpt2":
        w.add_tokenizer_pre(tok["pre"])
        w.add_token_merges(tok["merges"])
    else:
        w.add_tokenizer_pre("default")
        w.add_token_scores(tok["scores"])
        w.add_add_space_prefix(tok["add_space_prefix"])
        if tok["unk_id"] is not None:
            w.add_unk_token_id(tok["unk_id"])
    w.add_bos_token_id(special.eos_id if special.bos_id is None else special.bos_id)
    w.add_eos_token_id(special.eos_id)
    if special.pad_id is not None:
        w.add_pad_token_id(special.pad_id)
    w.add_add_bos_token(special.add_bos)
    w.add_add_eos_token(False)
    return tok["model"]
