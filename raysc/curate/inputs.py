"""Reading curation input: list the files of ``curate.input``, parse every record (bad ones kept
as rows with their reason), normalise the text and tag its domain."""

from __future__ import annotations

import hashlib
import io
import json
import re
import unicodedata

import numpy as np

from raysc.config.schema import Config
from raysc.curate.errors import CurateError
from raysc.data.compressed import CODECS, read_bytes, split_codec

TEXT_SUFFIXES = (".txt", ".md", ".text")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", *TEXT_SUFFIXES)  # each also as .gz or .zst
_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200b\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|#include|"
                        r"[{}]$|.*;$|@\w+)")


def list_inputs(cfg: Config) -> tuple[str, dict, list[str]]:
    """(URI prefix, fsspec options, files) of ``curate.input``."""
    import fsspec

    c = cfg.curate
    if c.input == "bundled":
        from raysc.data.corpus import build_bundled_corpus

        return "", {}, [str(build_bundled_corpus(cfg.data.cache_dir, cfg.data.max_corpus_mb))]
    fs, path = fsspec.core.url_to_fs(c.input, **c.storage_options)
    protocol = fsspec.utils.get_protocol(c.input)
    prefix = "" if protocol in ("file", "local") else f"{protocol}://"
    if any(ch in path for ch in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        files = sorted(f for f in fs.find(path) if split_codec(f)[0].endswith(DATA_SUFFIXES))
    elif fs.exists(path):
        files = [path]
    else:
        raise CurateError(f"curate.input {c.input!r} does not exist; give a file, a directory or a glob "
                          f"of .jsonl / .parquet / .txt files, plain or {' / '.join(CODECS)} (or 'bundled').")
    if not files:
        raise CurateError(f"curate.input {c.input!r} holds no .jsonl, .json, .parquet or text files (plain or "
                          f"{' / '.join(CODECS)}).")
    return prefix, dict(c.storage_options), [f"{prefix}{f}" for f in files]


def _bad(where: str, reason: str, sample: str) -> dict:
    return {"id": "", "text": "", "domain": "", "url": "", "source": where, "bad": reason, "sample": sample[:200]}


def _row(doc_id, text: str, domain, url, where: str) -> dict:
    """A parsed document; the input's id and URL kept as strings ('' when the input has none)."""
    return {"id": "" if doc_id is None else str(doc_id), "text": text, "domain": str(domain or ""),
            "url": "" if url is None else str(url), "source": where, "bad": "", "sample": ""}


def parse_file(uri: str, options: dict, text_field: str, id_field: str, domain_field: str,
               url_field: str = "url") -> list[dict]:
    """Every record of one input file (``.gz`` / ``.zst`` decompressed by suffix); bad ones as rows with
    ``bad`` set to the reason, a damaged compressed file as the records before the damage and one such row."""
    data, damaged = read_bytes(uri, options)
    name = uri.rsplit("/", 1)[-1]
    kind = split_codec(uri)[0]
    if damaged:  # the last, partial line is part of the damage
        data = data[: data.rfind(b"\n") + 1] if kind.endswith((".jsonl", ".json")) else b""
    fields = (text_field, id_field, domain_field, url_field)
    rows = _parse(data, uri, name, kind, *fields) if data or not damaged else []
    if damaged:
        rows.append(_bad(name, damaged, f"{len(data)} bytes read before it"))
    return rows


def _parse(data: bytes, uri: str, name: str, kind: str, text_field: str, id_field: str, domain_field: str,
           url_field: str) -> list[dict]:
    """The records of one file's (decompressed) bytes; ``kind`` is its name without a compression suffix."""
    rows: list[dict] = []
    if kind.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(io.BytesIO(data))
        except (pa.ArrowInvalid, OSError) as e:
            return [_bad(name, "corrupt or truncated Parquet file", str(e))]
        if text_field not in table.column_names:
            return [_bad(uri, f"missing field '{text_field}'", ", ".join(table.column_names))]
        cols = table.to_pydict()
        for i, text in enumerate(cols[text_field]):
            where = f"{name}:{i}"
            if not isinstance(text, str):
                rows.append(_bad(where, f"field '{text_field}' is not a string", repr(text)))
                continue
            rows.append(_row(cols[id_field][i] if id_field in cols else None, text,
                             cols[domain_field][i] if domain_field in cols else "",
                             cols[url_field][i] if url_field in cols else None, where))
        return rows
    if kind.endswith(TEXT_SUFFIXES):
        try:
            return [_row(None, data.decode("utf-8"), "", None, name)]
        except UnicodeDecodeError as e:
            return [_bad(name, f"not UTF-8 ({e.reason} at byte {e.start})", data[:200].decode("utf-8", "replace"))]
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            rows.append(_bad(where, f"not UTF-8 ({e.reason} at byte {e.start})", line.decode("utf-8", "replace")))
            continue
        except json.JSONDecodeError as e:
            rows.append(_bad(where, f"malformed JSON ({e.msg})", line.decode("utf-8", "replace")))
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
            rows.append(_bad(where, f"missing or non-string field '{text_field}'", line.decode("utf-8", "replace")))
            continue
        rows.append(_row(rec.get(id_field) or None, rec[text_field], rec.get(domain_field), rec.get(url_field),
                         where))
    return rows


def normalise(text: str) -> str:
    """NFC, runs of spaces (including non-breaking and ideographic ones) to one, trailing spaces
    dropped, at most one blank line in a row, no leading or trailing blank lines."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_SPACES.sub(" ", line).rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def tag_domain(text: str) -> str:
    """'code' when at least 30% of the non-blank lines look like source code, else 'prose'."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "prose"
    return "code" if sum(bool(_CODE_LINE.match(ln)) for ln in lines) / len(lines) >= 0.3 else "prose"


def normalise_batch(batch: dict) -> dict:
    """A batch of parsed rows with normalised text, its content hash, an id (the input's or the
    hash's first 16 digits), a domain, the node key ``id\\x00hash`` and the byte size; an empty
    document becomes a bad row."""
    texts, ids, domains, bad = [], [], [], []
    hashes = []
    for text, doc_id, domain, reason in zip(batch["text"], batch["id"], batch["domain"], batch["bad"]):
        t = normalise(text) if not reason else ""
        if not reason and not t:
            reason = "empty document"
        h = hashlib.sha1(t.encode()).hexdigest()
        texts.append(t)
        hashes.append(h)
        ids.append(str(doc_id) or h[:16])
        domains.append(str(domain) or (tag_domain(t) if t else ""))
        bad.append(reason)
    out = dict(batch)
    out.update(text=np.array(texts, dtype=object), id=np.array(ids, dtype=object),
               domain=np.array(domains, dtype=object), bad=np.array(bad, dtype=object),
               hash=np.array(hashes, dtype=object),
               node=np.array([f"{i}\x00{h[:16]}" for i, h in zip(ids, hashes)], dtype=object),
               bytes=np.array([len(t.encode()) for t in texts], dtype=np.int64))
    return out
