"""Reading curation input: list the files of ``curate.input``, parse every record (bad ones kept
as rows with their reason), normalise the text and tag its domain.

A file is parsed into an Arrow table (``parse_file_table``): a JSONL file by pyarrow's JSON reader and a
Parquet file column by column, with no Python per record, whenever every record is a good one of the
expected types (then the rows are the ones the per-record parser would make: tests/test_curate_inputs.py);
otherwise, or for a damaged compressed file, record by record (``parse_file``), each bad record kept as
a row with its reason. A ``.json`` file is JSON lines, or one JSON document: an array of records (the
form many exports take; read whole, each record's source ``file[i]``) or a single record. On 100k documents the per-record path spent ~4 s of the read stage's 8.7 s
(JSON decoding and a dict per record), 2 cores."""

from __future__ import annotations

import hashlib
import io
import json
import re
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from raysc.config.schema import Config
from raysc.curate.errors import CurateError
from raysc.data.compressed import CODECS, read_bytes, split_codec

if TYPE_CHECKING:
    import pyarrow as pa

TEXT_SUFFIXES = (".txt", ".md", ".text")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", *TEXT_SUFFIXES)  # each also as .gz or .zst
_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200b\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|#include|"
    r"[{}]$|.*;$|@\w+)"
)


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
        raise CurateError(
            f"curate.input {c.input!r} does not exist; give a file, a directory or a glob "
            f"of .jsonl / .parquet / .txt files, plain or {' / '.join(CODECS)} (or 'bundled')."
        )
    if not files:
        raise CurateError(
            f"curate.input {c.input!r} holds no .jsonl, .json, .parquet or text files (plain or {' / '.join(CODECS)})."
        )
    return prefix, dict(c.storage_options), [f"{prefix}{f}" for f in files]


_JSON_SPACE = re.compile(rb"[ \t\r\n]*")
ROW_FIELDS = ("id", "text", "domain", "url", "source", "bad", "sample")


def _bad(where: str, reason: str, sample: str) -> dict:
    return {"id": "", "text": "", "domain": "", "url": "", "source": where, "bad": reason, "sample": sample[:200]}


def _row(doc_id, text: str, domain, url, where: str) -> dict:
    """A parsed document; the input's id and URL kept as strings ('' when the input has none)."""
    return {
        "id": "" if doc_id is None else str(doc_id),
        "text": text,
        "domain": str(domain or ""),
        "url": "" if url is None else str(url),
        "source": where,
        "bad": "",
        "sample": "",
    }


def parse_file(
    uri: str, options: dict, text_field: str, id_field: str, domain_field: str, url_field: str = "url"
) -> list[dict]:
    """Every record of one input file (``.gz`` / ``.zst`` decompressed by suffix); bad ones as rows with
    ``bad`` set to the reason, a damaged compressed file as the records before the damage and one such row."""
    data, damaged = read_bytes(uri, options)
    return _parse_records(data, damaged, uri, text_field, id_field, domain_field, url_field)


def parse_file_table(
    uri: str, options: dict, text_field: str, id_field: str, domain_field: str, url_field: str = "url"
) -> pa.Table:
    """``parse_file`` as an Arrow table of ``ROW_FIELDS`` (strings), by Arrow when the file allows."""
    import pyarrow as pa

    data, damaged = read_bytes(uri, options)
    kind = split_codec(uri)[0]
    fields = (text_field, id_field, domain_field, url_field)
    one_document = kind.endswith(".json") and _first_byte(data) == b"["  # a JSON array: _parse reads it whole
    if not damaged and not one_document and kind.endswith((".jsonl", ".json", ".parquet")):
        table = (_parquet_table if kind.endswith(".parquet") else _jsonl_table)(data, uri.rsplit("/", 1)[-1], *fields)
        if table is not None:
            return table
    rows = _parse_records(data, damaged, uri, *fields)
    return pa.Table.from_pylist(rows, schema=pa.schema([(f, pa.string()) for f in ROW_FIELDS]))


def _parse_records(
    data: bytes, damaged: str, uri: str, text_field: str, id_field: str, domain_field: str, url_field: str
) -> list[dict]:
    name = uri.rsplit("/", 1)[-1]
    kind = split_codec(uri)[0]
    if damaged:  # the last, partial line is part of the damage
        data = data[: data.rfind(b"\n") + 1] if kind.endswith((".jsonl", ".json")) else b""
    fields = (text_field, id_field, domain_field, url_field)
    rows = _parse(data, uri, name, kind, *fields) if data or not damaged else []
    if damaged:
        rows.append(_bad(name, damaged, f"{len(data)} bytes read before it"))
    return rows


def _parse(
    data: bytes, uri: str, name: str, kind: str, text_field: str, id_field: str, domain_field: str, url_field: str
) -> list[dict]:
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
            rows.append(
                _row(
                    cols[id_field][i] if id_field in cols else None,
                    text,
                    cols[domain_field][i] if domain_field in cols else "",
                    cols[url_field][i] if url_field in cols else None,
                    where,
                )
            )
        return rows
    if kind.endswith(TEXT_SUFFIXES):
        try:
            return [_row(None, data.decode("utf-8"), "", None, name)]
        except UnicodeDecodeError as e:
            return [_bad(name, f"not UTF-8 ({e.reason} at byte {e.start})", data[:200].decode("utf-8", "replace"))]
    fields = (text_field, id_field, domain_field, url_field)
    if kind.endswith(".json") and _first_byte(data) in (b"[", b"{"):
        whole = _json_document(data, name, *fields)
        if whole is not None:
            return whole
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
        rows.append(_record(rec, where, lambda line=line: line.decode("utf-8", "replace"), *fields))
    return rows


def _first_byte(data: bytes) -> bytes:
    """The first byte that is not JSON whitespace ('' for none), without copying the file."""
    start = _JSON_SPACE.match(data).end()
    return data[start : start + 1]


def _record(
    rec, where: str, raw: Callable[[], str], text_field: str, id_field: str, domain_field: str, url_field: str
) -> dict:
    """One parsed JSON value as a row: a document, or a bad row when it is no object with a string text."""
    if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
        return _bad(where, f"missing or non-string field '{text_field}'", raw())
    return _row(rec.get(id_field) or None, rec[text_field], rec.get(domain_field), rec.get(url_field), where)


def _json_document(
    data: bytes, name: str, text_field: str, id_field: str, domain_field: str, url_field: str
) -> list[dict] | None:
    """A ``.json`` file that is one JSON document: an array of records (each ``name[i]``) or one record
    (``name``); a malformed array is one bad row for the file. None for JSON lines (more than one value:
    the caller reads them line by line, as it does a file that is not UTF-8)."""
    fields = (text_field, id_field, domain_field, url_field)
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    except json.JSONDecodeError as e:
        if _first_byte(data) == b"[":
            return [
                _bad(
                    name,
                    f"malformed JSON array ({e.msg} at line {e.lineno}, column {e.colno})",
                    data[max(0, e.pos - 100) : e.pos + 100].decode("utf-8", "replace"),
                )
            ]
        return None
    if isinstance(doc, list):
        return [
            _record(rec, f"{name}[{i}]", lambda rec=rec: json.dumps(rec)[:200], *fields) for i, rec in enumerate(doc)
        ]
    return [_record(doc, name, lambda: data[:200].decode("utf-8", "replace"), *fields)]


def _as_strings(column, falsy_is_empty: bool):
    """A column of ids, domains or URLs as the per-record parser writes them (``str``, '' for null, and
    for ``falsy_is_empty`` '' for 0 too), or None when its type is not a string or an integer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = column.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)):
        return None
    out = pc.cast(column, pa.string())
    if falsy_is_empty and pa.types.is_integer(t):
        out = pc.if_else(pc.equal(column, 0), "", out)
    return pc.fill_null(out, "")


def _arrow_rows(table: pa.Table, name: str, first: int, text_field: str, fields: dict) -> pa.Table | None:
    """The rows of a parsed table, ``fields`` = {our field: (its column name, falsy_is_empty)}; None when
    the text column is not all strings or another column has a type the per-record parser would print
    differently."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if text_field not in table.column_names:
        return None
    text = table[text_field]
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)) or text.null_count:
        return None
    n = table.num_rows
    empty = pa.array([""] * n, pa.string())
    out = {"text": pc.cast(text, pa.string())}
    for ours, (theirs, falsy) in fields.items():
        if theirs not in table.column_names:
            out[ours] = empty
            continue
        col = _as_strings(table[theirs], falsy)
        if col is None:
            return None
        out[ours] = col
    numbers = pc.cast(pa.array(np.arange(first, first + n)), pa.string())
    out["source"] = pc.binary_join_element_wise(pa.scalar(f"{name}:"), numbers, "")
    out["bad"] = out["sample"] = empty
    rows = pa.table({f: out[f] for f in ROW_FIELDS})
    try:  # pyarrow's JSON reader lets bytes that are not UTF-8 through into its strings
        rows.validate(full=True)
    except pa.ArrowInvalid:
        return None
    return rows


def _jsonl_table(
    data: bytes, name: str, text_field: str, id_field: str, domain_field: str, url_field: str
) -> pa.Table | None:
    """A JSONL file by pyarrow's JSON reader, or None unless every line is one JSON object with a
    string text (no blank lines: each row's line number is its place in the file)."""
    import pyarrow as pa
    import pyarrow.json as pj

    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    if not lines:
        return None
    block = min(len(data) + 1, 2**31 - 1)  # one block (up to its int32 limit): types inferred from the whole file
    try:
        table = pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(use_threads=False, block_size=block))
    except pa.ArrowException:  # a malformed line, bytes that are not UTF-8, a type that changes
        return None
    if table.num_rows != lines:
        return None
    # the per-record parser's rules: ``rec.get(id) or None`` (so 0 and '' are no id), ``domain or ''``
    return _arrow_rows(
        table, name, 1, text_field, {"id": (id_field, True), "domain": (domain_field, True), "url": (url_field, False)}
    )


def _parquet_table(
    data: bytes, name: str, text_field: str, id_field: str, domain_field: str, url_field: str
) -> pa.Table | None:
    """A Parquet file column by column, or None (the per-record parser reports what is wrong)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowInvalid, OSError):
        return None
    return _arrow_rows(
        table, name, 0, text_field, {"id": (id_field, False), "domain": (domain_field, True), "url": (url_field, False)}
    )


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


def _re2_class(chars: str) -> str:
    return "".join(f"\\x{{{ord(c):x}}}" for c in chars)


# ``str.isspace()`` characters (what ``str.strip`` removes), listed: tests/test_curate_dedup.py checks the list
ISSPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
# _SPACES as RE2, matching only the runs that change (a lone " " is left: replacing every one took 5x longer)
_SPACE_CLASS = f"{_re2_class(chr(9) + chr(12) + chr(11) + chr(0xA0))}\\x{{2000}}-\\x{{200b}}\\x{{3000}}"
_SPACES_RE2 = f"[{_SPACE_CLASS}][ {_SPACE_CLASS}]*| [ {_SPACE_CLASS}]+"
_LINE_END_RE2 = f"[{_re2_class(ISSPACE.replace(chr(10), ''))}]+\n"


def _nfc(texts: pa.Array) -> pa.Array:
    """NFC of every text: ASCII texts are NFC already, the others go through ``unicodedata``. (Arrow's
    ``utf8_normalize`` returned decomposed text for every form, NFC included, in pyarrow 25.0.1.)"""
    import pyarrow as pa
    import pyarrow.compute as pc

    other = pc.invert(pc.string_is_ascii(texts))
    if not pc.any(other).as_py():
        return texts
    changed = [unicodedata.normalize("NFC", t) for t in pc.filter(texts, other).to_pylist()]
    return pc.replace_with_mask(texts, other, pa.array(changed, texts.type))


def normalise_texts(texts: pa.Array) -> pa.Array:
    """``normalise`` of every text of an Arrow array at once: NFC (``_nfc``), then RE2 replacements as
    Arrow compute kernels; the same text as ``normalise``, character for character (tested)."""
    import pyarrow.compute as pc

    t = _nfc(texts)
    t = pc.replace_substring_regex(t, "\r\n?", "\n")  # (replace_substring twice took 45x longer)
    t = pc.replace_substring_regex(t, _SPACES_RE2, " ")
    t = pc.replace_substring_regex(t, _LINE_END_RE2, "\n")  # each line's trailing spaces
    t = pc.replace_substring_regex(t, "\n{3,}", "\n\n")
    return pc.utf8_trim(t, characters=ISSPACE)


def _sha1_hex(texts: pa.Array) -> list[str]:
    """The SHA-1 hex digest of every text's UTF-8 bytes, read from the array's buffers (no str)."""
    import pyarrow as pa

    offset_type = np.int64 if pa.types.is_large_string(texts.type) else np.int32
    _, offsets, data = texts.buffers()
    bounds = np.frombuffer(offsets, dtype=offset_type)[texts.offset : texts.offset + len(texts) + 1]
    view = memoryview(data) if data is not None else memoryview(b"")
    return [hashlib.sha1(view[a:b]).hexdigest() for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]


def normalise_batch(batch: pa.Table) -> pa.Table:
    """A batch of parsed rows with normalised text (``normalise_texts``), its content hash, an id (the
    input's or the hash's first 16 digits), a domain (the input's, else ``tag_domain``), the node key
    ``id\\x00hash`` and the byte size; an empty document becomes a bad row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    col = {name: batch[name].combine_chunks() for name in ("text", "id", "domain", "bad")}
    is_bad = pc.not_equal(col["bad"], "")
    text = pc.if_else(is_bad, "", normalise_texts(col["text"]))
    bad = pc.if_else(pc.and_(pc.invert(is_bad), pc.equal(text, "")), "empty document", col["bad"])
    hashes = pa.array(_sha1_hex(text), pa.string())
    short = pc.utf8_slice_codeunits(hashes, 0, 16)
    ids = pc.if_else(pc.equal(col["id"], ""), short, col["id"])
    domains = col["domain"].to_pylist()
    for i in np.flatnonzero(pc.and_(pc.equal(col["domain"], ""), pc.not_equal(text, "")).to_numpy(False)):
        domains[i] = tag_domain(text[int(i)].as_py())
    out = {name: batch[name] for name in batch.column_names}
    out.update(
        text=text,
        id=ids,
        domain=pa.array(domains, pa.string()),
        bad=bad,
        hash=hashes,
        node=pc.binary_join_element_wise(ids, short, "\x00"),
        bytes=pc.binary_length(text).cast(pa.int64()),
    )
    return pa.table(out)
