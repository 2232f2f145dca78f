"""From ``[data]`` config to packed training rows: corpus → tokenizer → packed sequences.

Each stage is cached under ``data.cache_dir`` keyed by its inputs, so repeated
runs (and tests) reuse work; the returned ``info`` records every hash so a run
can prove which data it saw.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from raysc.config.schema import Config
from raysc.data.corpus import build_bundled_corpus, corpus_meta, read_documents
from raysc.data.packing import PackedData, build_packed
from raysc.data.tokenizer import build_tokenizer, load_tokenizer
from raysc.hashing import file_sha256


def prepare_data(cfg: Config) -> tuple[PackedData, Path, dict]:
    """Return the packed rows, the tokenizer.json path and a description of the data."""
    d = cfg.data
    if d.source == "bundled":
        corpus = build_bundled_corpus(d.cache_dir, d.max_corpus_mb)
        meta = corpus_meta(corpus)
    else:
        corpus = Path(d.source)
        meta = {"path": str(corpus)}
    docs = list(read_documents(corpus))
    if not docs:
        raise ValueError(f"data.source {d.source!r} holds no documents")
    texts = [doc["text"] for doc in docs]
    corpus_sha = meta.get("sha256") or (file_sha256(corpus) if corpus.is_file() else
                                        file_sha256_dir(corpus))
    if d.tokenizer:
        tok_path = Path(d.tokenizer)
        vocab = load_tokenizer(tok_path).get_vocab_size()
        if vocab > cfg.model.vocab_size:
            raise ValueError(
                f"data.tokenizer {d.tokenizer!r} has {vocab} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}; set model.vocab_size >= {vocab}")
    else:
        tok_path = build_tokenizer(texts, cfg.model.vocab_size, d.tokenizer_sample_mb, cfg.train.seed,
                                   d.cache_dir, corpus_sha)
    packed = build_packed(texts, tok_path, corpus_sha, cfg.train.seq_len, d.val_fraction, d.cache_dir)
    info = {"corpus": meta, "corpus_sha256": corpus_sha, "tokenizer": str(tok_path), **packed.info}
    return packed, tok_path, info


def file_sha256_dir(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.jsonl")):
        h.update(f.name.encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()
