"""Byte-level BPE tokenizer trained locally with Hugging Face ``tokenizers``.

One special token, ``<|endoftext|>`` (id 0), separates documents and serves as
BOS/EOS. Training reads a seeded sample of the corpus (``data.tokenizer_sample_mb``)
so the result is a pure function of (corpus, vocab size, seed); the trained
``tokenizer.json`` is what ``PreTrainedTokenizerFast`` loads on export.

``load_tokenizer`` refuses any other tokenizer.json — a public Llama checkpoint's, read with
``--init-from``, ends documents with ``</s>`` (Llama 2) or ``<|end_of_text|>`` (Llama 3) — because
packing, the Hugging Face and GGUF exports and generation all write and stop at id 0: such a
tokenizer would train on documents joined by whatever token id 0 is. The error names the
tokenizer's own end token when it has a known one, and what to use instead.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
EOS_ID = 0
# end-of-text tokens of public tokenizers, named in the refusal: Llama 3, Llama 2 / Mistral, Gemma, ChatML
OTHER_ENDS = ("<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def sample_texts(texts: list[str], sample_mb: float, seed: int) -> list[str]:
    """A seeded sample of documents totalling about ``sample_mb`` megabytes."""
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    budget, used, picked = int(sample_mb * 1e6), 0, []
    for i in order:
        if used >= budget:
            break
        picked.append(i)
        used += len(texts[i])
    return [texts[i] for i in sorted(picked)]


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOS) != EOS_ID:
        raise RuntimeError(f"{EOS} did not receive id {EOS_ID}")
    return tok


def build_tokenizer(texts: list[str], vocab_size: int, sample_mb: float, seed: int,
                    cache_dir: str | Path, corpus_sha: str) -> Path:
    """Train (or reuse from the cache) a tokenizer for this corpus; return its tokenizer.json path."""
    key = hashlib.sha256(f"{corpus_sha}:{vocab_size}:{sample_mb}:{seed}".encode()).hexdigest()[:16]
    out = Path(cache_dir) / "tokenizers" / key / "tokenizer.json"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(sample_texts(texts, sample_mb, seed), vocab_size)
    tmp = out.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file {str(p)!r} does not exist")
    tok = Tokenizer.from_file(str(p))
    eos = tok.token_to_id(EOS)
    if eos != EOS_ID:
        raise ValueError(f"tokenizer {str(p)!r} {_eos_problem(tok, eos)}: raysc ends every document with {EOS} "
                         f"at id {EOS_ID} (packing, export and generation use that id) and cannot map another "
                         f"end-of-text token. Fix: use a tokenizer raysc trained (data.tokenizer empty) or one a "
                         f"raysc export wrote; with --init-from, continue from a raysc export (`raysc export`), "
                         f"whose tokenizer.json has it: public Llama checkpoints' tokenizers are not supported yet")
    return tok


def _eos_problem(tok: Tokenizer, eos: int | None) -> str:
    if eos is not None:
        return f"has {EOS} at id {eos}, not {EOS_ID}"
    own = [f"{t!r} (id {tok.token_to_id(t)})" for t in OTHER_ENDS if tok.token_to_id(t) is not None]
    return f"has no {EOS} token" + (f"; its end-of-text token is {own[0]}" if own else "")
