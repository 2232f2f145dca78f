"""Tokenize curated documents and pack them into per-domain token shards, in Ray Data.

Each Ray Data batch of ``documents/`` (the curation output) is encoded with the run's
tokenizer (``tokenizers`` batch encoding), each document ended by the tokenizer's EOS (and begun by its
BOS where it adds one: ``raysc.data.special_tokens``, recorded in the index) and joined per
domain, cut into rows of ``seq_len + 1`` tokens (neighbouring rows share their boundary
token, as in ``raysc.data.packing``; a batch's tail shorter than a row is dropped and
counted) and written by the task itself as ``<out>/<domain>/shard-<hash>.npy``, with the
token offsets where its documents start in ``shard-<hash>.starts.npy``. Only metadata comes
back to the driver, which writes ``index.json``: per domain its shards, sequences, tokens,
documents and dropped tail tokens, plus ``seq_len`` and the tokenizer. ``--format megatron`` writes each
task's documents per domain as a Megatron indexed dataset instead (``<domain>/part-<hash>.bin/.idx``, a
document per sequence, nothing dropped), which Megatron-LM and NeMo read as ``--data-path`` prefixes and
raysc reads back through the same ``index.json``. The tokenizer is copied
into the output as ``tokenizer.json`` (trained on a seeded sample of the curated documents when
none is given), so a packed directory is self-contained: ``data.source = <it>`` trains on it
(``raysc.data.shards`` reads it). Tasks get the tokenizer as its JSON text, not a path, so they run on any node.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from raysc.data import megatron
from raysc.data.packing import encode_corpus
from raysc.data.shards import MEGATRON
from raysc.data.special_tokens import RAYSC, SpecialTokens
from raysc.data.tokenizer import load_tokenizer, sample_texts, train_tokenizer

_TOKENIZERS: dict[str, object] = {}  # tokenizer JSON sha -> Tokenizer, per worker process


def _tokenizer(tokenizer_json: str):
    key = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[key] = Tokenizer.from_str(tokenizer_json)
    return _TOKENIZERS[key]


def pack_block(
    ids: list[str],
    texts: list[str],
    domains: list[str],
    tokenizer_json: str,
    vocab_size: int,
    seq_len: int,
    out_uri: str,
    options: dict,
    special: dict | None = None,
    fmt: str = "raysc",
) -> list[dict]:
    """Encode, join and pack one block of documents; write its shards (``fmt`` megatron: one Megatron
    indexed dataset per domain, a document per sequence); return their metadata."""
    import fsspec

    tok = _tokenizer(tokenizer_json)
    marks = SpecialTokens.from_dict(special) if special else RAYSC
    fs, root = fsspec.core.url_to_fs(out_uri, **options)
    out = []
    for domain in sorted(set(domains)):
        pick = [i for i, d in enumerate(domains) if d == domain]
        doc_texts = [texts[i] for i in pick]
        stream = encode_corpus(doc_texts, tok, vocab_size, marks)
        name = hashlib.sha1("\0".join(ids[i] for i in pick).encode()).hexdigest()[:16]
        if fmt == "megatron":
            documents = np.split(stream, np.flatnonzero(stream == marks.eos_id)[:-1] + 1)  # each ends with EOS
            data, index = megatron.encode_indexed(documents, megatron.token_dtype(vocab_size))
            fs.makedirs(f"{root}/{domain}", exist_ok=True)
            written = {f"{domain}/part-{name}.bin": data, f"{domain}/part-{name}.idx": index}
            for path, blob in written.items():
                fs.pipe_file(f"{root}/{path}", blob)
            out.append(
                {
                    "domain": domain,
                    "file": f"{domain}/part-{name}",
                    "sequences": len(documents),
                    "tokens": int(len(stream)),
                    "documents": len(pick),
                    "dropped_tokens": 0,
                    "checksums": _checksums(written),
                }
            )
            continue
        n_rows = (len(stream) - 1) // seq_len
        if n_rows < 1:
            out.append(
                {
                    "domain": domain,
                    "file": "",
                    "sequences": 0,
                    "tokens": 0,
                    "documents": len(pick),
                    "dropped_tokens": int(len(stream)),
                    "checksums": "{}",
                }
            )
            continue
        rows = stream[np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
        used = n_rows * seq_len + 1
        ends = np.flatnonzero(stream == marks.eos_id)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        starts = starts[starts < used]
        fs.makedirs(f"{root}/{domain}", exist_ok=True)
        written = {}
        for suffix, array in (("", rows), (".starts", starts)):
            buf = io.BytesIO()
            np.save(buf, array)
            written[f"{domain}/shard-{name}{suffix}.npy"] = buf.getvalue()
            fs.pipe_file(f"{root}/{domain}/shard-{name}{suffix}.npy", buf.getvalue())
        out.append(
            {
                "domain": domain,
                "file": f"{domain}/shard-{name}.npy",
                "sequences": int(n_rows),
                "tokens": int(used),
                "documents": len(pick),
                "dropped_tokens": int(len(stream) - used),
                "checksums": _checksums(written),
            }
        )
    return out


def _checksums(written: dict[str, bytes]) -> str:
    """{file: [bytes, SHA-256]} of what a task wrote, as JSON (a Ray Data column): ``index.json``'s
    ``checksums``, which ``raysc data verify`` checks."""
    return json.dumps({path: [len(blob), hashlib.sha256(blob).hexdigest()] for path, blob in written.items()})


def _sample_tokenizer(documents: str, filesystem, vocab_size: int, sample_mb: float, seed: int) -> str:
    """Train the BPE tokenizer on a seeded sample of the curated documents; return its JSON."""
    import pyarrow.dataset as pads

    texts: list[str] = []
    for batch in pads.dataset(documents, format="parquet", filesystem=filesystem).to_batches(columns=["text"]):
        texts.extend(batch.column(0).to_pylist())
        if sum(map(len, texts)) > 4 * sample_mb * 1e6:  # enough to sample sample_mb from
            break
    if not texts:
        raise ValueError(f"{documents} holds no documents to train a tokenizer on")
    return train_tokenizer(sample_texts(texts, sample_mb, seed), vocab_size).to_str()


def pack_curated(
    curated_uri: str,
    tokenizer_path: str | None,
    vocab_size: int,
    seq_len: int,
    out_uri: str,
    options: dict | None = None,
    log=print,
    sample_mb: float = 4.0,
    seed: int = 0,
    special: SpecialTokens | None = None,
    fmt: str = "raysc",
) -> dict:
    """Token shards per domain from ``<curated_uri>/documents``; returns (and writes) the index. ``fmt``:
    ``raysc`` (rows of ``seq_len + 1``) or ``megatron`` (Megatron indexed datasets, cut into rows when read).

    ``tokenizer_path`` None trains one (``vocab_size``) on ``sample_mb`` of the documents. ``special``:
    the special tokens to pack with (default: the tokenizer's own, ``read_special_tokens``)."""
    import fsspec
    import ray

    from raysc.curate.output import arrow_fs as fsspec_arrow_fs
    from raysc.data.special_tokens import read_special_tokens

    options = options or {}
    fs, root = fsspec.core.url_to_fs(curated_uri, **options)
    arrow_fs = fsspec_arrow_fs(curated_uri, options)
    if not fs.exists(f"{root}/documents"):
        raise FileNotFoundError(
            f"{curated_uri}/documents does not exist: run `raysc curate` first "
            f"(its curate.output is what `raysc pack` reads)"
        )
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
        if tok.get_vocab_size() > vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_path!r} has {tok.get_vocab_size()} tokens but model.vocab_size "
                f"is {vocab_size}; set model.vocab_size >= {tok.get_vocab_size()}"
            )
        tokenizer_json = tok.to_str()
        special = special or read_special_tokens(tokenizer_path, tok=tok)
    else:
        log(
            f"pack: training a {vocab_size}-token BPE tokenizer on the curated documents "
            f"(at most {sample_mb} MB of them)"
        )
        tokenizer_json = _sample_tokenizer(f"{root}/documents", arrow_fs, vocab_size, sample_mb, seed)
    docs = ray.data.read_parquet(f"{root}/documents", filesystem=arrow_fs).select_columns(["id", "text", "domain"])
    special = special or RAYSC
    if fmt not in ("raysc", "megatron"):
        raise ValueError(f"pack format {fmt!r} is not one of raysc, megatron")
    args = (tokenizer_json, vocab_size, seq_len, out_uri.rstrip("/"), options, special.to_dict(), fmt)

    def block(batch: dict) -> dict:
        meta = pack_block(list(batch["id"]), list(batch["text"]), list(batch["domain"]), *args)
        return (
            {
                k: np.array([m[k] for m in meta], dtype=object if k in ("domain", "file", "checksums") else np.int64)
                for k in meta[0]
            }
            if meta
            else {}
        )

    rows = sorted(
        docs.map_batches(block, batch_size=512, batch_format="numpy").take_all(), key=lambda r: (r["domain"], r["file"])
    )
    index: dict = {
        "format": MEGATRON if fmt == "megatron" else "raysc-packed-v1",
        "curated": curated_uri.rstrip("/"),
        "seq_len": seq_len,
        "eos": special.eos,
        "special_tokens": special.to_dict(),
        "tokenizer": "tokenizer.json",
        "tokenizer_source": tokenizer_path or "trained by raysc pack",
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "domains": {},
        "checksums": {},  # {file: [bytes, SHA-256]}: `raysc data verify` reads every byte against them
    }
    for r in rows:
        for path, (size, sha) in json.loads(r["checksums"]).items():
            index["checksums"][path] = [int(size), sha]
        d = index["domains"].setdefault(
            r["domain"], {"shards": [], "sequences": 0, "tokens": 0, "documents": 0, "dropped_tokens": 0}
        )
        if r["file"]:
            d["shards"].append(r["file"])
        for k in ("sequences", "tokens", "documents", "dropped_tokens"):
            d[k] += int(r[k])
    out_fs, out_root = fsspec.core.url_to_fs(out_uri, **options)
    out_fs.makedirs(out_root, exist_ok=True)
    out_fs.pipe_file(f"{out_root}/tokenizer.json", tokenizer_json.encode())
    out_fs.pipe_file(f"{out_root}/index.json", json.dumps(index, indent=1).encode())  # last: marks it complete
    log("pack: " + ", ".join(f"{k}: {v['sequences']} sequences" for k, v in index["domains"].items()))
    return index
