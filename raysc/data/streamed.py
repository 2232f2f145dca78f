"""Token files described as row sources (``raysc.data.row_source``) without reading their tokens.

What a run learns of a corpus before training is O(files), whatever its size: each file's size and
version tag from the store's metadata, its numpy header (a few KB: dtype and shape), and, for token
files, the first ``SAMPLE_BYTES`` of ids checked against the model's vocabulary (a file of another
tokenizer is refused by name at once; every batch a rank reads is checked again), the files described
``DESCRIBE_THREADS`` at a time. The ranks read their own rows later, from where the files lie (local
disk, a shared file system or any fsspec URL).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from raysc.data.ranged import DataSourceError, FileIdentity, RangeReader, identity, is_local
from raysc.data.row_source import Segment, ShardRows, TokenRows
from raysc.data.token_arrays import NPY_MAGIC, token_files

HEADER_PROBE = 4096  # bytes read for a numpy header (np.save writes 128; a header may be longer)
SAMPLE_BYTES = 64 << 10  # ids checked against the vocabulary per token file at start
DESCRIBE_THREADS = 32  # files described at once (each: a HEAD and one or two small GETs)
T = TypeVar("T")


def list_token_files(source: str, options: dict | None = None) -> list[str] | None:
    """The ``.npy`` token files of ``source`` (a file, or a directory's in name order) as URLs or paths;
    None when it is neither (or a ``raysc pack`` directory)."""
    if is_local(source):
        files = token_files(source)
        return [str(f) for f in files] if files else None
    import fsspec

    fs, path = fsspec.core.url_to_fs(source, **(options or {}))
    protocol = source.split("://", 1)[0]
    if path.endswith(".npy") and fs.isfile(path):
        return [source]
    if fs.isdir(path) and not fs.exists(f"{path}/index.json"):
        found = sorted(fs.glob(f"{path.rstrip('/')}/*.npy"))
        return [f"{protocol}://{f}" for f in found] or None
    return None


def head_unit(f: FileIdentity) -> tuple[int, int]:
    """The bytes a file's description reads (its header and the vocabulary sample after it): one GET on an
    object store, kept by the reader while the description lasts."""
    return 0, min(f.size, HEADER_PROBE + SAMPLE_BYTES)


def npy_layout(reader: RangeReader, f: FileIdentity) -> tuple[int, np.dtype, tuple] | None:
    """(byte offset of the data, dtype, shape) of a numpy-format file; None for a raw array (no header)."""
    # one GET on an object store for the header and the vocabulary sample after it (the unit, kept)
    head = reader.read(f, 0, min(f.size, HEADER_PROBE), head_unit(f))
    if not head.startswith(NPY_MAGIC):
        return None
    buf = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(buf)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
        else:
            if len(head) == HEADER_PROBE and f.size > HEADER_PROBE:  # a long header: read it whole
                head = reader.read(f, 0, min(f.size, 1 << 20))
                buf = io.BytesIO(head)
                np.lib.format.read_magic(buf)
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    except ValueError as e:
        raise DataSourceError(f"{f.url}: a numpy header that cannot be read ({e})") from None
    if fortran and len(shape) > 1:
        raise DataSourceError(f"{f.url} holds a Fortran-ordered array; save it C-ordered (np.save of the array)")
    return buf.tell(), np.dtype(dtype), tuple(shape)


def _need(f: FileIdentity, offset: int, nbytes: int) -> None:
    """A file shorter than its header says is truncated: refused, naming it, before training."""
    if f.size < offset + nbytes:
        raise DataSourceError(
            f"{f.url} is truncated: {f.size} bytes where its header needs {offset + nbytes}; restore the file "
            f"(or re-run `raysc pack`)"
        )


def token_rows(
    files: list[str], seq_len: int, raw_dtype: np.dtype, vocab_size: int, options: dict | None = None
) -> tuple[TokenRows, RangeReader]:
    """Rows of the token stream of ``files`` (OLMo / Dolma ``.npy``: numpy's format or raw ids of
    ``raw_dtype``); the reader that read their headers and samples (its ``stats`` count the bytes)."""
    reader = RangeReader(dict(options or {}))

    def describe(url: str) -> Segment:
        f = identity(url, options)
        layout = npy_layout(reader, f)
        if layout is None:
            if f.size % raw_dtype.itemsize:
                raise DataSourceError(
                    f"{url} has {f.size} bytes, not a whole number of {raw_dtype} ids: it was written with "
                    f"another dtype; set data.token_dtype"
                )
            offset, dtype, count = 0, raw_dtype, f.size // raw_dtype.itemsize
        else:
            offset, dtype, shape = layout
            if len(shape) != 1 or dtype.kind not in "ui":
                raise DataSourceError(
                    f"{url} holds a {dtype} array of shape {shape}; a token file is one flat array of unsigned ids"
                )
            count = shape[0]
            _need(f, offset, count * dtype.itemsize)
        sample = (offset, offset + min(count * dtype.itemsize, SAMPLE_BYTES))
        unit = head_unit(f) if sample[1] <= head_unit(f)[1] else None
        head = np.frombuffer(reader.read(f, *sample, unit), dtype=dtype)
        if len(head) and int(head.max()) >= vocab_size:
            also = ", or is not " + str(raw_dtype) + " (set data.token_dtype)" if layout is None else ""
            raise DataSourceError(
                f"{url} holds token id {int(head.max())} but model.vocab_size is {vocab_size}: it was made with "
                f"another tokenizer than the run's{also}"
            )
        reader.drop(url)
        return Segment(f, offset, count, dtype.str)

    segments = in_parallel(describe, files)
    rows = TokenRows(segments, seq_len, options)
    rows.vocab_size = vocab_size
    return rows, reader


def packed_rows(
    source: str, index: dict, seq_len: int, vocab_size: int, options: dict | None = None
) -> tuple[dict[str, ShardRows], RangeReader]:
    """{domain: its rows} of a ``raysc pack`` directory (format raysc-packed-v1), from the shards' headers."""
    reader = RangeReader(dict(options or {}))
    base = source.rstrip("/")

    def describe(name: str) -> Segment:
        f = identity(f"{base}/{name}", options)
        layout = npy_layout(reader, f)
        if layout is None or len(layout[2]) != 2 or layout[2][1] != seq_len + 1:
            raise DataSourceError(
                f"{f.url} is not a shard of rows of {seq_len + 1} tokens (header: {layout and layout[2]}); "
                f"re-run `raysc pack`"
            )
        offset, dtype, (n, width) = layout
        _need(f, offset, n * width * dtype.itemsize)
        reader.drop(f.url)
        return Segment(f, offset, n, dtype.str)

    out = {}
    for domain, d in index["domains"].items():
        segments = [s for s in in_parallel(describe, d["shards"]) if s.tokens]
        if segments:
            out[domain] = ShardRows(segments, seq_len, options)
            out[domain].vocab_size = vocab_size
    return out, reader


def in_parallel(describe: Callable[[str], T], items: list[str]) -> list[T]:
    """``describe`` of every item, in order, ``DESCRIBE_THREADS`` at a time: a corpus of thousands of
    files in an object store is described in seconds, not thousands of sequential round trips (HEAD and
    header GET per file); the first error (naming its file) is raised."""
    if len(items) <= 1:
        return [describe(x) for x in items]
    with ThreadPoolExecutor(min(DESCRIBE_THREADS, len(items))) as pool:
        return list(pool.map(describe, items))


def identity_digest(files: list[FileIdentity]) -> str:
    """The corpus's identity from what the store says of its files (names, sizes, version tags), not
    from hashing every byte at every start."""
    import hashlib

    return hashlib.sha256("\n".join(f"{f.url}\t{f.size}\t{f.version}" for f in files).encode()).hexdigest()
