"""Byte-level BPE tokenizer trained locally with Hugging Face ``tokenizers``, and loading any
``tokenizer.json``.

A trained tokenizer has one special token, ``<|endoftext|>`` (id 0), that ends every document (no
BOS). Training reads a seeded sample of the corpus (``data.tokenizer_sample_mb``) so the result is a
pure function of (corpus, vocab size, seed); the trained ``tokenizer.json`` is what
``PreTrainedTokenizerFast`` loads on export.

``load_tokenizer`` loads any tokenizer.json (a public checkpoint's too); which ids end and begin a
document is read beside it by ``raysc.data.special_tokens``, never assumed.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
EOS_ID = 0


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


def tokenizer_path(vocab_size: int, sample_mb: float, seed: int, cache_dir: str | Path, corpus_sha: str) -> Path:
    """Where ``build_tokenizer`` caches the tokenizer it trains for these inputs."""
    key = hashlib.sha256(f"{corpus_sha}:{vocab_size}:{sample_mb}:{seed}".encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokenizers" / key / "tokenizer.json"


def build_tokenizer(
    texts: list[str], vocab_size: int, sample_mb: float, seed: int, cache_dir: str | Path, corpus_sha: str
) -> Path:
    """Train (or reuse from the cache) a tokenizer for this corpus; return its tokenizer.json path."""
    out = tokenizer_path(vocab_size, sample_mb, seed, cache_dir, corpus_sha)
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
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(
            f"{str(p)!r} is not a tokenizer.json that Hugging Face tokenizers can read ({e}); "
            f"point data.tokenizer at a tokenizer.json file"
        ) from None
