"""``raysc data verify SOURCE``: every byte of a corpus read once and checked, when a user asks.

A run identifies its corpus from metadata (sizes, version tags, ``index.json``), never by hashing
every byte at every start (``raysc.data.streamed``). This is the full check, done on demand:

- a ``raysc pack`` directory: every file ``index.json`` lists under ``checksums`` (size and SHA-256,
  written by the task that wrote the file) is read and compared; a file that differs or is missing
  is named. A directory packed before checksums were recorded has nothing to compare against: it is
  read, its headers checked, and the hashes printed;
- ``.npy`` token files and Megatron ``PREFIX.bin``/``.idx`` datasets (nobody records checksums for
  them): their headers and sizes are checked as a run checks them, every token is read and checked
  against ``vocab_size`` when given, and each file's SHA-256 is printed to record beside the corpus.

Reads stream in ``CHUNK`` pieces (memory stays flat at any corpus size) through fsspec, local or remote;
progress is reported every ``PROGRESS_S`` seconds.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from raysc.data.indexed_rows import indexed_layout, indexed_prefix
from raysc.data.ranged import DataSourceError, FileIdentity, RangeReader, identity
from raysc.data.shards import read_index
from raysc.data.streamed import list_token_files, npy_layout
from raysc.data.token_arrays import token_dtype

CHUNK = 8 << 20
PROGRESS_S = 10.0


@dataclass
class Report:
    """What ``verify`` found: per file its size and SHA-256, the files that failed and why."""

    source: str
    kind: str
    files: dict[str, dict] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    recorded: bool = False  # whether checksums were recorded to compare against
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "kind": self.kind,
            "ok": self.ok,
            "checksums_recorded": self.recorded,
            "files": len(self.files),
            "bytes": self.bytes_read,
            "seconds": round(self.seconds, 2),
            "problems": self.problems,
            "sha256": {k: v["sha256"] for k, v in self.files.items()},
        }


class _Progress:
    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.log, self.done = total, log, 0
        self.t0 = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_S:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            left = (self.total - self.done) / rate if rate else 0
            self.log(
                f"verify: {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB read, {rate / 1e6:.0f} MB/s, "
                f"about {left:.0f} s left"
            )


def _hash_file(url: str, options: dict, progress: _Progress, ids: tuple[np.dtype, int] | None) -> dict:
    """Size and SHA-256 of ``url`` read in ``CHUNK`` pieces; with ``ids`` (their dtype, the data's byte
    offset), the largest token id too."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    h, size, top, odd = hashlib.sha256(), 0, -1, b""
    with fs.open(path, "rb", block_size=CHUNK) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if ids is not None:
                dtype, offset = ids
                body = odd + chunk[max(0, offset - size) :] if size + len(chunk) > offset else b""
                whole = len(body) - len(body) % dtype.itemsize
                if whole:
                    top = max(top, int(np.frombuffer(body[:whole], dtype=dtype).max()))
                odd = body[whole:]
            size += len(chunk)
            progress.add(len(chunk))
    return {"bytes": size, "sha256": h.hexdigest(), "max_id": top}


def verify_source(
    source: str, options: dict | None = None, vocab_size: int | None = None, log: Callable[[str], None] = print
) -> Report:
    """Read every byte of ``source`` and check it (the module docstring says against what)."""
    options = dict(options or {})
    t0 = time.monotonic()
    index = read_index(source, options)
    if index is not None:
        report = _verify_packed(source, index, options, log)
    else:
        report = _verify_tokens(source, options, vocab_size, log)
    report.seconds = time.monotonic() - t0
    return report


def _verify_packed(source: str, index: dict, options: dict, log: Callable[[str], None]) -> Report:
    base = source.rstrip("/")
    listed = index.get("checksums") or {}
    report = Report(source, "raysc pack directory", recorded=bool(listed))
    names = dict(listed)
    if not listed:
        log(
            f"verify: {source}/index.json records no checksums (packed by an older raysc): reading every shard "
            f"to check it can be read; re-run `raysc pack` to record them"
        )
        for d in index["domains"].values():
            for name in d["shards"]:
                parts = [f"{name}.bin", f"{name}.idx"] if index.get("format") == "megatron-indexed-v1" else [name]
                names.update({p: None for p in parts})
    sizes = {}
    for name in names:
        try:
            sizes[name] = identity(f"{base}/{name}", options).size
        except FileNotFoundError:
            report.problems.append(f"{base}/{name} is missing (index.json lists it); re-run `raysc pack`")
    progress = _Progress(sum(sizes.values()), log)
    for name in sizes:
        got = _hash_file(f"{base}/{name}", options, progress, None)
        report.files[name] = got
        report.bytes_read += got["bytes"]
        want = listed.get(name)
        if want is not None and [got["bytes"], got["sha256"]] != list(want):
            report.problems.append(
                f"{base}/{name} differs from what `raysc pack` wrote (size {want[0]} -> {got['bytes']}, SHA-256 "
                f"{want[1][:12]} -> {got['sha256'][:12]}): re-run `raysc pack`, or restore the file"
            )
    return report


def _verify_tokens(source: str, options: dict, vocab_size: int | None, log: Callable[[str], None]) -> Report:
    reader = RangeReader(options)
    prefix = indexed_prefix(source, options)
    targets: list[tuple[FileIdentity, tuple[np.dtype, int] | None]] = []
    files = None if prefix is not None else list_token_files(source, options)
    if prefix is None and not files:
        raise FileNotFoundError(
            f"{source} is neither a `raysc pack` directory, a Megatron dataset prefix nor .npy token files: "
            f"nothing raysc verifies"
        )
    report = Report(source, "Megatron indexed dataset" if prefix is not None else ".npy token files")
    try:  # the checks a run makes at its start: headers, sizes
        if prefix is not None:
            layout = indexed_layout(reader, prefix, options)
            targets = [(layout.bin, (np.dtype(layout.dtype), 0)), (layout.idx, None)]
        for url in files or []:
            f = identity(url, options)
            layout = npy_layout(reader, f)
            if layout is None:  # a raw array: OLMo's dtype rule
                targets.append((f, (token_dtype("auto", vocab_size), 0) if vocab_size else None))
                continue
            offset, dtype, shape = layout
            if f.size < offset + int(np.prod(shape)) * dtype.itemsize:
                raise DataSourceError(f"{url} is truncated: {f.size} bytes where its header needs more")
            targets.append((f, (dtype, offset)))
    except ValueError as e:  # DataSourceError, IndexedDatasetError: named by the message
        report.problems.append(str(e))
        return report
    progress = _Progress(sum(f.size for f, _ in targets), log)
    for f, spec in targets:
        url = f.url
        got = _hash_file(url, options, progress, spec if vocab_size else None)
        report.files[url] = got
        report.bytes_read += got["bytes"]
        if vocab_size and got["max_id"] >= vocab_size:
            report.problems.append(
                f"{url} holds token id {got['max_id']} but the vocabulary has {vocab_size}: it was made with "
                f"another tokenizer (or another dtype)"
            )
    return report
