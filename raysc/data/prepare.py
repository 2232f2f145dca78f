"""From ``[data]`` config to packed training rows: corpus → tokenizer → packed sequences.

Each stage is cached under ``data.cache_dir`` keyed by its inputs, so repeated
runs (and tests) reuse work; the returned ``info`` records every hash so a run
can prove which data it saw.

When ``data.source`` is the output of ``raysc pack`` (a directory with ``index.json``),
the rows come per domain (``PackedData.train`` is ``{domain: rows}``) for the mixture
loader, with that directory's tokenizer; ``data.schedule`` is checked against its domains here,
in the supervisor (``prepare_data`` runs in its actor), before any worker starts. A Megatron
indexed dataset (``PREFIX.bin``/``.idx``, ``raysc.data.indexed_rows``) and OLMo-style token files
(``.npy``, ``raysc.data.streamed``) are read as already-tokenized documents with ``data.tokenizer``
naming their tokenizer. A plain-text corpus is tokenized once by Ray tasks into token files under
``data.cache_dir`` (``raysc.data.text_cache``). Every source is then described from its files'
metadata, not read: each rank reads its own rows where the files lie.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from raysc.config.schema import Config
from raysc.config.syntax import parse_schedule
from raysc.data import token_arrays
from raysc.data.corpus import build_bundled_corpus, corpus_meta, jsonl_files
from raysc.data.indexed_rows import indexed_prefix, indexed_rows
from raysc.data.order import STORED_ORDER_ROWS, keeps_stored_order
from raysc.data.packing import PackedData, val_every
from raysc.data.ranged import identity
from raysc.data.row_source import ConcatRows, RowSource, SplitRows
from raysc.data.shards import MEGATRON, read_index
from raysc.data.special_tokens import SpecialTokens, read_special_tokens
from raysc.data.streamed import identity_digest, list_token_files, packed_rows, token_rows
from raysc.data.text_cache import text_cache, tokenizer_documents
from raysc.data.tokenizer import build_tokenizer, load_tokenizer, tokenizer_path
from raysc.hashing import file_sha256


def prepare_data(cfg: Config, progress: Callable[[str], None] | None = None) -> tuple[PackedData, Path, dict]:
    """Return the packed rows, the tokenizer.json path and a description of the data; ``progress`` hears
    how tokenizing a plain-text corpus goes."""
    d = cfg.data
    index = read_index(d.source, dict(d.storage_options)) if d.source != "bundled" else None
    if index is not None:
        return prepare_domains(cfg, index)
    prefix = indexed_prefix(d.source, dict(d.storage_options)) if d.source != "bundled" else None
    if prefix is not None:
        return prepare_indexed(cfg, prefix)
    arrays = list_token_files(d.source, dict(d.storage_options)) if d.source != "bundled" else None
    if arrays:
        return prepare_token_arrays(cfg, arrays)
    if d.schedule:
        raise ValueError(
            f"data.schedule needs per-domain token shards, but data.source={d.source!r} is a plain "
            f"corpus; run `raysc curate` and `raysc pack` and set data.source to the packed directory"
        )
    return prepare_text(cfg, progress)


def prepare_text(cfg: Config, progress: Callable[[str], None] | None = None) -> tuple[PackedData, Path, dict]:
    """Rows of a plain-text corpus (the bundled one, or JSONL files): tokenized once by Ray tasks into token
    files under ``data.cache_dir`` (``raysc.data.text_cache``), which each rank reads its own rows from.
    A tokenizer is trained first unless ``data.tokenizer`` names one."""
    d = cfg.data
    if d.source == "bundled":
        corpus = build_bundled_corpus(d.cache_dir, d.max_corpus_mb)
        meta = corpus_meta(corpus)
    else:
        corpus = Path(d.source)
        meta = {"path": str(corpus)}
    files = jsonl_files(corpus)
    corpus_sha = meta.get("sha256") or identity_digest([identity(str(f.resolve())) for f in files])
    if d.tokenizer:
        tok_path = Path(d.tokenizer)
        special = check_tokenizer(cfg, tok_path)
    else:
        tok_path = tokenizer_path(cfg.model.vocab_size, d.tokenizer_sample_mb, cfg.train.seed, d.cache_dir, corpus_sha)
        if not tok_path.is_file():
            texts = tokenizer_documents(files, d.tokenizer_sample_mb, cfg.train.seed)
            if not texts:
                raise ValueError(f"data.source {d.source!r} holds no documents")
            build_tokenizer(texts, cfg.model.vocab_size, d.tokenizer_sample_mb, cfg.train.seed, d.cache_dir, corpus_sha)
        special = special_tokens(cfg, tok_path)
    cache = text_cache(files, corpus_sha, tok_path, special, d.cache_dir, progress)
    if not cache["documents"]:
        raise ValueError(f"data.source {d.source!r} holds no documents")
    # the parts are numpy files: their headers give the dtype (the raw dtype is never used)
    rows, _ = token_rows(cache["parts"], cfg.train.seq_len, np.dtype(np.uint32), cfg.model.vocab_size)
    rows.stored_order = len(rows) <= STORED_ORDER_ROWS
    packed, _, info = _streamed_rows(cfg, rows, meta, cache["documents"], special, tok_path)
    info.update(corpus_sha256=corpus_sha, key=cache["key"], text_cache=cache["dir"])
    if not cache["shared"]:
        packed = _shipped(cfg, packed, cache["dir"])
        info["streamed"] = False
    return packed, tok_path, info


SHIP_BYTES = 2 << 30  # the largest tokenized corpus shipped through the object store (a node-local cache)


def _shipped(cfg: Config, packed: PackedData, where: str) -> PackedData:
    """The rows in memory, for Ray's object store to carry to the ranks: the tokenized corpus is on a disk
    that only this node sees (a node-local ``data.cache_dir`` on a cluster of several machines). Rows in
    memory keep the order they have when read in place (``keeps_stored_order``), so the run's batches are
    the same; a corpus larger than ``SHIP_BYTES`` (or past the stored order's rows) is refused with the fix."""
    rows = len(packed.train) + len(packed.val)
    size = rows * packed.val.row_bytes
    if not keeps_stored_order(packed.train) or size > SHIP_BYTES:
        raise ValueError(
            f"the tokenized corpus at {where} is on a disk that other nodes of the cluster do not see, and at "
            f"{rows:,} rows ({size / 2**30:.1f} GiB) it is too large to ship to them through Ray's object store "
            f"(at most {SHIP_BYTES / 2**30:.0f} GiB); set data.cache_dir to a path every node shares (an NFS or "
            f"Lustre mount), or `raysc pack` the corpus to object storage and set data.source to it"
        )
    return PackedData(np.asarray(packed.train), np.asarray(packed.val), packed.info)


def check_tokenizer(cfg: Config, tok_path: str | Path) -> SpecialTokens:
    """A tokenizer the model can train with: it fits the embedding and names the token that ends a
    document (``SpecialTokenError``, a ValueError, otherwise); its special tokens."""
    tok = load_tokenizer(tok_path)
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise ValueError(
            f"tokenizer {str(tok_path)!r} has {tok.get_vocab_size()} tokens but model.vocab_size is "
            f"{cfg.model.vocab_size}: the embedding has no row for its top ids; set model.vocab_size >= "
            f"{tok.get_vocab_size()} (or use the checkpoint's own tokenizer)"
        )
    return special_tokens(cfg, tok_path, tok)


def check_packed_source(cfg: Config, tok_path: str | Path, whose: str) -> None:
    """A local packed ``data.source`` (``raysc pack``'s output) was packed with the tokenizer at ``tok_path``
    (``whose`` says where the run takes it from): token ids of another tokenizer would train the
    embedding on the wrong rows without an error. A ValueError naming both tokenizers otherwise."""
    source = cfg.data.source
    if source == "bundled" or not (Path(source) / "index.json").is_file():  # an s3:// one: checked in prepare
        return
    index = read_index(source)
    want, have = index["tokenizer_sha256"], file_sha256(Path(tok_path))
    if want != have:
        raise ValueError(
            f"data.source {source!r} was packed with another tokenizer ({index['tokenizer']} in it, "
            f"SHA-256 {want[:12]}) than the run's, {str(tok_path)!r} ({whose}, SHA-256 {have[:12]}); "
            f"re-pack the corpus with that tokenizer (`raysc pack ... --set "
            f"data.tokenizer='\"{tok_path}\"'`), or point data.source at the raw corpus so the run "
            f"tokenizes it itself"
        )


def special_tokens(cfg: Config, tok_path: str | Path, tok=None) -> SpecialTokens:
    """The run's special tokens: the tokenizer's (read beside it), with ``data.*_token`` overrides;
    ``tok`` is the tokenizer when the caller has it loaded already."""
    d = cfg.data
    return read_special_tokens(tok_path, d.eos_token, d.bos_token, d.add_bos, tok=tok)


def prepare_domains(cfg: Config, index: dict) -> tuple[PackedData, Path, dict]:
    """Per-domain rows from a ``raysc pack`` directory, each domain split into train/val rows."""
    d = cfg.data
    options = dict(d.storage_options)
    if index.get("format") != MEGATRON and index.get("seq_len") != cfg.train.seq_len:
        raise ValueError(
            f"{d.source} was packed with seq_len {index.get('seq_len')} but train.seq_len is "
            f"{cfg.train.seq_len}; set train.seq_len={index.get('seq_len')} or re-run `raysc pack` "
            f"with --set train.seq_len={cfg.train.seq_len}"
        )
    tok_path = _packed_tokenizer(cfg, index)
    vocab = load_tokenizer(tok_path).get_vocab_size()
    if vocab > cfg.model.vocab_size:
        raise ValueError(
            f"{d.source} was packed with a {vocab}-token tokenizer but model.vocab_size is "
            f"{cfg.model.vocab_size}; set model.vocab_size >= {vocab}"
        )
    if index.get("format") == MEGATRON:  # each domain's datasets, their documents joined (each ends with EOS)
        eos = special_tokens(cfg, tok_path).eos_id
        base = d.source.rstrip("/")
        domains = {
            name: indexed_rows(
                [f"{base}/{p}" for p in m["shards"]], cfg.train.seq_len, eos, cfg.model.vocab_size, options
            )[0]
            for name, m in index["domains"].items()
            if m["shards"] and m["tokens"] > cfg.train.seq_len
        }
    else:
        domains, _ = packed_rows(d.source, index, cfg.train.seq_len, cfg.model.vocab_size, options)
    missing = sorted(set(index["domains"]) - set(domains))
    if missing:
        raise ValueError(
            f"domain(s) {missing} of {d.source} have no sequences (too few tokens for one row of "
            f"{cfg.train.seq_len + 1}); drop them from the data or shorten train.seq_len"
        )
    train, val = {}, []
    for name, rows in domains.items():
        every = val_every(d.val_fraction) if d.val_fraction > 0 and len(rows) >= 2 else 0
        train[name] = SplitRows(rows, every, held=False)
        val.append(SplitRows(rows, every, held=True))
    schedule = d.schedule or natural_schedule({k: len(v) for k, v in train.items()})
    parse_schedule(schedule, list(train))  # unknown domains or a malformed schedule fail here
    index_sha = hashlib.sha256(json.dumps(index, sort_keys=True).encode()).hexdigest()
    info = {
        "corpus": {"packed": d.source},
        "corpus_sha256": index_sha,
        "tokenizer": str(tok_path),
        "tokens": sum(m["tokens"] for m in index["domains"].values()),
        "documents": sum(m["documents"] for m in index["domains"].values()),
        "seq_len": cfg.train.seq_len,
        "train_sequences": sum(len(v) for v in train.values()),
        "val_sequences": sum(len(v) for v in val),
        "domains": {k: len(v) for k, v in train.items()},
        "schedule": schedule,
        "special_tokens": index.get("special_tokens") or special_tokens(cfg, tok_path).to_dict(),
        "streamed": True,
    }
    return PackedData(train, ConcatRows(val), info), tok_path, info


def prepare_indexed(cfg: Config, prefix: str) -> tuple[PackedData, Path, dict]:
    """Rows of a Megatron indexed dataset (``PREFIX.bin``/``.idx``, local or any fsspec URL): its documents'
    tokens, each ended by the tokenizer's EOS (added where the dataset was made without ``--append-eod``),
    described, not read (``raysc.data.indexed_rows``); each rank reads its own rows where the files lie."""
    special, tok_path = _token_source_tokenizer(cfg, "a Megatron indexed dataset")
    options = dict(cfg.data.storage_options)
    rows, documents = indexed_rows([prefix], cfg.train.seq_len, special.eos_id, cfg.model.vocab_size, options)
    return _streamed_rows(cfg, rows, {"megatron": prefix}, documents, special, tok_path)


def prepare_token_arrays(cfg: Config, files: list[str]) -> tuple[PackedData, Path, dict]:
    """Rows of OLMo / Dolma-style token files (``raysc.data.token_arrays``), their ids in name order,
    documents already separated by the tokenizer's EOS: described, not read (``raysc.data.streamed``);
    each rank reads its own rows where the files lie."""
    special, tok_path = _token_source_tokenizer(cfg, "a token array (.npy)")
    dtype = token_arrays.token_dtype(cfg.data.token_dtype, cfg.model.vocab_size)
    options = dict(cfg.data.storage_options)
    rows, _ = token_rows(files, cfg.train.seq_len, dtype, cfg.model.vocab_size, options)
    corpus = {"token_files": files if len(files) <= 16 else [*files[:16], f"... {len(files)} files"]}
    # documents: not counted, that would read every token at every start
    return _streamed_rows(cfg, rows, corpus, None, special, tok_path)


def _streamed_rows(
    cfg: Config, rows: RowSource, corpus: dict, documents: int | None, special: SpecialTokens, tok_path: Path
) -> tuple[PackedData, Path, dict]:
    """An already-tokenized corpus read where it lies, split as a plain one is: every ``val_every``-th row
    held out, computed (``SplitRows``), not copied."""
    every = val_every(cfg.data.val_fraction) if cfg.data.val_fraction > 0 and len(rows) >= 2 else 0
    train, val = SplitRows(rows, every, held=False), SplitRows(rows, every, held=True)
    info = {
        "corpus": corpus,
        "corpus_sha256": identity_digest(rows.files()),
        "tokenizer": str(tok_path),
        "tokens": int(rows.starts[-1]),
        "documents": documents,
        "seq_len": cfg.train.seq_len,
        "train_sequences": len(train),
        "val_sequences": len(val),
        "special_tokens": special.to_dict(),
        "streamed": True,
    }
    return PackedData(train, val, info), tok_path, info


def _token_source_tokenizer(cfg: Config, what: str) -> tuple[SpecialTokens, Path]:
    """The tokenizer an already-tokenized ``data.source`` names (it carries none), checked."""
    d = cfg.data
    if d.schedule:
        raise ValueError(
            f"data.schedule mixes domains, but data.source={d.source!r} is {what}, one domain; "
            f"leave data.schedule empty (or `raysc pack` per-domain shards)"
        )
    if not d.tokenizer:
        raise ValueError(
            f"data.source {d.source!r} is {what}: token ids without their tokenizer; set "
            f"data.tokenizer to the tokenizer.json it was made with (or train --init-from the "
            f"checkpoint whose tokenizer made it)"
        )
    return check_tokenizer(cfg, Path(d.tokenizer)), Path(d.tokenizer)


def natural_schedule(sequences: dict[str, int]) -> str:
    """One phase weighting each domain by its share of the sequences (the default schedule)."""
    return "0:" + ",".join(f"{k}={v}" for k, v in sorted(sequences.items()))


def _packed_tokenizer(cfg: Config, index: dict) -> Path:
    """A local copy of the packed directory's tokenizer (or data.tokenizer when it is the same one)."""
    import fsspec

    sha = index["tokenizer_sha256"]
    if cfg.data.tokenizer:
        if file_sha256(Path(cfg.data.tokenizer)) != sha:
            raise ValueError(
                f"data.tokenizer {cfg.data.tokenizer!r} is not the tokenizer {cfg.data.source} was "
                f"packed with; leave data.tokenizer empty to use the packed one"
            )
        return Path(cfg.data.tokenizer)
    local = Path(cfg.data.cache_dir) / "tokenizers" / sha[:16] / "tokenizer.json"
    if not local.is_file():
        fs, root = fsspec.core.url_to_fs(cfg.data.source, **dict(cfg.data.storage_options))
        local.parent.mkdir(parents=True, exist_ok=True)
        blob = fs.cat_file(f"{root}/{index['tokenizer']}")
        if hashlib.sha256(blob).hexdigest() != sha:
            raise ValueError(
                f"{cfg.data.source}/{index['tokenizer']} does not match its index's SHA-256: the "
                f"packed directory is corrupt or half-written; re-run `raysc pack`"
            )
        local.with_suffix(".tmp").write_bytes(blob)
        local.with_suffix(".tmp").replace(local)
    return local
