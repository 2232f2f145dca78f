"""Read a packed directory (the output of ``raysc pack``): its ``index.json`` and its per-domain
token shards, from a local path or any fsspec URL. A directory packed with ``--format megatron`` holds
Megatron indexed datasets (``raysc.data.megatron``) instead: their documents are joined and cut into
rows of the run's ``train.seq_len`` here.

The writer is ``raysc.curate.pack``; training reads through here, so data does not import curate.
"""

from __future__ import annotations

import io
import json

import numpy as np


def read_index(out_uri: str, options: dict | None = None) -> dict | None:
    """The ``index.json`` of a packed directory, or None when ``out_uri`` is not one."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_uri, **(options or {}))
    try:
        return json.loads(fs.cat_file(f"{root}/index.json"))
    except (FileNotFoundError, NotADirectoryError):
        return None


MEGATRON = "megatron-indexed-v1"  # index.json's format for `raysc pack --format megatron`


def load_domains(
    out_uri: str, options: dict | None = None, max_rows: int | None = None, seq_len: int | None = None
) -> dict[str, np.ndarray]:
    """{domain: rows} from the shards listed in ``<out_uri>/index.json``, in index order; with
    ``max_rows``, only the shards that hold each domain's first ``max_rows`` rows are read (the
    result may hold more). Megatron-format shards are cut into rows of ``seq_len`` (default: the
    index's)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_uri, **(options or {}))
    index = read_index(out_uri, options)
    if index is None:
        raise FileNotFoundError(f"{out_uri}/index.json does not exist: not the output of `raysc pack`")
    if index.get("format") == MEGATRON:
        return _megatron_domains(fs, root, index, seq_len or index["seq_len"])
    out = {}
    for domain, d in index["domains"].items():
        parts, n = [], 0
        for f in d["shards"]:
            if max_rows is not None and n >= max_rows:
                break
            parts.append(np.load(io.BytesIO(fs.cat_file(f"{root}/{f}"))))
            n += len(parts[-1])
        if parts:
            out[domain] = np.concatenate(parts)
    return out


def _megatron_domains(fs, root: str, index: dict, seq_len: int) -> dict[str, np.ndarray]:
    """{domain: rows}: each domain's datasets' documents joined (each already ends with EOS) and packed."""
    from raysc.data.megatron import read_documents
    from raysc.data.packing import pack_tokens

    out = {}
    for domain, d in index["domains"].items():
        docs = [doc for prefix in d["shards"] for doc in read_documents(f"{root}/{prefix}", fs)]
        if docs:
            out[domain] = pack_tokens(np.concatenate(docs).astype(np.int64), seq_len)
    return out
