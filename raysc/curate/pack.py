"""Tokenize curated documents and pack them into per-domain token shards, in Ray Data.

Each Ray Data batch of ``documents/`` (the curation output) is encoded with the run's
tokenizer (``tokenizers`` batch encoding), documents are joined with ``<|endoftext|>`` per
domain, cut into rows of ``seq_len + 1`` tokens (neighbouring rows share their boundary
token, as in ``raysc.data.packing``; a batch's tail shorter than a row is dropped and
counted) and written by the task itself as ``<out>/<domain>/shard-<hash>.npy``, with the
token offsets where its documents start in ``shard-<hash>.starts.npy``. Only metadata comes
back to the driver, which writes ``index.json``: per domain its shards, sequences, tokens,
documents and dropped tail tokens. ``load_domains`` reads the shards back for the mixture loader.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from raysc.data.packing import encode_corpus
from raysc.data.tokenizer import EOS_ID

_TOKENIZERS: dict[str, object] = {}


def _tokenizer(path: str):
    if path not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[path] = Tokenizer.from_file(path)
    return _TOKENIZERS[path]


def pack_block(ids: list[str], texts: list[str], domains: list[str], tokenizer_path: str, vocab_size: int,
               seq_len: int, out_uri: str, options: dict) -> list[dict]:
    """Encode, join and pack one block of documents; write its shards; return their metadata."""
    import fsspec

    tok = _tokenizer(tokenizer_path)
    fs, root = fsspec.core.url_to_fs(out_uri, **options)
    out = []
    for domain in sorted(set(domains)):
        pick = [i for i, d in enumerate(domains) if d == domain]
        doc_texts = [texts[i] for i in pick]
        stream = encode_corpus(doc_texts, tok, vocab_size)
        n_rows = (len(stream) - 1) // seq_len
        if n_rows < 1:
            out.append({"domain": domain, "file": "", "sequences": 0, "tokens": 0, "documents": len(pick),
                        "dropped_tokens": int(len(stream))})
            continue
        rows = stream[np.arange(n_rows)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]]
        used = n_rows * seq_len + 1
        ends = np.flatnonzero(stream == EOS_ID)
        starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        starts = starts[starts < used]
        name = hashlib.sha1("\0".join(ids[i] for i in pick).encode()).hexdigest()[:16]
        fs.makedirs(f"{root}/{domain}", exist_ok=True)
        for suffix, array in (("", rows), (".starts", starts)):
            buf = io.BytesIO()
            np.save(buf, array)
            fs.pipe_file(f"{root}/{domain}/shard-{name}{suffix}.npy", buf.getvalue())
        out.append({"domain": domain, "file": f"{domain}/shard-{name}.npy", "sequences": int(n_rows),
                    "tokens": int(used), "documents": len(pick), "dropped_tokens": int(len(stream) - used)})
    return out


def pack_curated(curated_uri: str, tokenizer_path: str, vocab_size: int, seq_len: int, out_uri: str,
                 options: dict | None = None, log=print) -> dict:
    """Token shards per domain from ``<curated_uri>/documents``; returns (and writes) the index."""
    import fsspec
    import ray

    from raysc.curate.pipeline import _arrow_fs

    options = options or {}
    fs, root = fsspec.core.url_to_fs(curated_uri, **options)
    docs = ray.data.read_parquet(f"{root}/documents", filesystem=_arrow_fs(curated_uri, options)
                                 ).select_columns(["id", "text", "domain"])
    args = (tokenizer_path, vocab_size, seq_len, out_uri.rstrip("/"), options)

    def block(batch: dict) -> dict:
        meta = pack_block(list(batch["id"]), list(batch["text"]), list(batch["domain"]), *args)
        return {k: np.array([m[k] for m in meta], dtype=object if k in ("domain", "file") else np.int64)
                for k in meta[0]} if meta else {}

    rows = sorted(docs.map_batches(block, batch_size=512, batch_format="numpy").take_all(),
                  key=lambda r: (r["domain"], r["file"]))
    index: dict = {"seq_len": seq_len, "tokenizer": tokenizer_path, "domains": {}}
    for r in rows:
        d = index["domains"].setdefault(r["domain"], {"shards": [], "sequences": 0, "tokens": 0, "documents": 0,
                                                      "dropped_tokens": 0})
        if r["file"]:
            d["shards"].append(r["file"])
        for k in ("sequences", "tokens", "documents", "dropped_tokens"):
            d[k] += int(r[k])
    out_fs, out_root = fsspec.core.url_to_fs(out_uri, **options)
    out_fs.makedirs(out_root, exist_ok=True)
    out_fs.pipe_file(f"{out_root}/index.json", json.dumps(index, indent=1).encode())
    log(f"pack: " + ", ".join(f"{k}: {v['sequences']} sequences" for k, v in index["domains"].items()))
    return index


def load_domains(out_uri: str, options: dict | None = None) -> dict[str, np.ndarray]:
    """{domain: rows} from the shards listed in ``<out_uri>/index.json``, in index order."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_uri, **(options or {}))
    index = json.loads(fs.cat_file(f"{root}/index.json"))
    out = {}
    for domain, d in index["domains"].items():
        parts = [np.load(io.BytesIO(fs.cat_file(f"{root}/{f}"))) for f in d["shards"]]
        if parts:
            out[domain] = np.concatenate(parts)
    return out
