"""Byte ranges of token files where they lie: local disk (``os.pread``) or any fsspec URL (ranged GETs).

A rank reads only the bytes of its own rows. On local disk and shared file systems a read is one
``pread`` of exactly the rows' bytes (no memory map: its touched pages would count in the rank's
resident memory for the whole run). On an object store every request costs a round trip, so a miss
fetches the caller's whole read unit (the shuffle block of ``raysc.data.order`` the rows belong to, about
a MiB) in one GET and keeps it in a bounded least-recently-used cache: the rows a rank reads from that
block over a window are then served from memory, about one GET per MiB, each byte fetched once.

Transient store errors (throttling, 5xx, timeouts, dropped connections) are retried with exponential
backoff; a permanent one (the file gone, access denied) or a file shorter than the run recorded
(truncated) raises ``DataSourceError`` naming the file at once. Every file is checked against the
identity recorded when the run prepared its data (size, and the store's ETag or modification time): a
file replaced under a running or resumed run is refused, never read as if it were the same corpus.

Ours rather than fsspec's block caches: those cache per open file object without a bound across files,
and retry nothing; we need per-request accounting (GETs and bytes, for the benchmark and the tests) too.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from raysc.checkpoint.failures import permanent_reason


class DataSourceError(ValueError):
    """A token file that cannot be read as the run recorded it; the message names the file and the fix."""


@dataclass(frozen=True)
class FileIdentity:
    """What a run knows of a file without reading it: its URL, size, and the store's version tag (ETag,
    or the modification time on a file system)."""

    url: str
    size: int
    version: str


@dataclass
class ReadStats:
    requests: int = 0  # reads issued to the store (GETs / preads)
    bytes_fetched: int = 0  # bytes those reads returned
    bytes_used: int = 0  # bytes handed to the caller
    retries: int = 0
    wait_s: float = 0.0  # time spent in reads


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def identity(url: str, options: dict | None = None) -> FileIdentity:
    """The size and version tag of ``url`` from the store's metadata (no byte of it read)."""
    if is_local(url):
        st = os.stat(_local_path(url))
        return FileIdentity(url, st.st_size, str(st.st_mtime_ns))
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    info = fs.info(path)
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
    return FileIdentity(url, int(info["size"]), str(version).strip('"'))


@dataclass
class RangeReader:
    """Reads byte ranges of the files of one corpus (see the module docstring). Not shared between
    processes: each process opens its own (``reader_for``)."""

    options: dict = field(default_factory=dict)
    cache_bytes: int = 256 << 20
    retries: int = 5
    backoff_s: float = 0.2
    stats: ReadStats = field(default_factory=ReadStats)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._units: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._cached = 0
        self._checked: dict[str, FileIdentity] = {}

    def check(self, want: FileIdentity) -> None:
        """Refuse a file whose size or version differs from what the run recorded (once per file)."""
        if want.url in self._checked:
            return
        try:
            have = identity(want.url, self.options)
        except FileNotFoundError:
            raise DataSourceError(
                f"{want.url} is gone: the run's data.source lists it; restore the file (the newest checkpoint "
                f"is intact), or start a new run on the data as it is now"
            ) from None
        if (have.size, have.version) != (want.size, want.version):
            raise DataSourceError(
                f"{want.url} changed since the run recorded it (size {want.size} -> {have.size}, version "
                f"{want.version!r} -> {have.version!r}): a run never reads another corpus under the same name; "
                f"put the original file back, or start a new run (a new run directory or --overwrite)"
            )
        self._checked[want.url] = want

    def read(self, f: FileIdentity, start: int, end: int, unit: tuple[int, int] | None = None) -> bytes:
        """Bytes ``[start, end)`` of ``f`` (checked against its identity first). ``unit``: the byte range the
        caller will read from next (a shuffle block): on an object store, a miss fetches all of it in one
        GET and keeps it."""
        if end > f.size:
            raise DataSourceError(
                f"{f.url} is truncated: bytes {start}..{end} asked of a file of {f.size}; restore the file (the "
                f"newest checkpoint is intact)"
            )
        self.check(f)
        t0 = time.perf_counter()
        if is_local(f.url):
            data = self._read_local(f, start, end)
        else:
            data = self._read_unit(f, start, end, unit or (start, end))
        with self._lock:
            self.stats.bytes_used += end - start
            self.stats.wait_s += time.perf_counter() - t0
        return data

    def _read_local(self, f: FileIdentity, start: int, end: int) -> bytes:
        fd = self._fds.get(f.url)
        if fd is None:
            fd = self._fds[f.url] = os.open(_local_path(f.url), os.O_RDONLY)
        data = self._retrying(f, lambda: os.pread(fd, end - start, start))
        if len(data) != end - start:
            raise DataSourceError(
                f"{f.url} is truncated: {start + len(data)} bytes where the run recorded {f.size}; restore the "
                f"file (the newest checkpoint is intact)"
            )
        with self._lock:
            self.stats.requests += 1
            self.stats.bytes_fetched += len(data)
        return data

    def _read_unit(self, f: FileIdentity, start: int, end: int, unit: tuple[int, int]) -> bytes:
        """``[start, end)`` from the cached copy of ``unit`` (a shuffle block's bytes), fetched in one GET
        on a miss; a read with no unit of its own is fetched as it is and not kept."""
        u0, u1 = min(start, unit[0]), min(f.size, max(end, unit[1]))
        key = (f.url, u0, u1)
        with self._lock:
            blob = self._units.get(key)
            if blob is not None:
                self._units.move_to_end(key)
        if blob is None:
            blob = self._retrying(f, lambda: self._get(f.url, u0, u1))
            if len(blob) != u1 - u0:
                raise DataSourceError(
                    f"{f.url} is truncated: {u0 + len(blob)} bytes where the run recorded {f.size}; restore the "
                    f"object (the newest checkpoint is intact)"
                )
            with self._lock:
                self.stats.requests += 1
                self.stats.bytes_fetched += len(blob)
                if unit != (start, end):
                    self._put(key, blob)
        return blob[start - u0 : end - u0]

    def _put(self, key: tuple[str, int, int], blob: bytes) -> None:
        self._units[key] = blob
        self._cached += len(blob)
        while self._cached > self.cache_bytes and len(self._units) > 1:
            _, old = self._units.popitem(last=False)
            self._cached -= len(old)

    def _get(self, url: str, start: int, end: int) -> bytes:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **self.options)  # (fsspec keeps one instance per store)
        return fs.cat_file(path, start=start, end=end)

    def _retrying(self, f: FileIdentity, read):
        for attempt in range(self.retries + 1):
            try:
                return read()
            except Exception as e:  # noqa: BLE001 (classified below)
                why = permanent_reason(e)
                if why is not None:
                    raise DataSourceError(
                        f"{f.url}: {why} ({type(e).__name__}: {e}); the run cannot read its data. Restore access "
                        f"(the newest checkpoint is intact) and resume"
                    ) from None
                if attempt == self.retries:
                    raise DataSourceError(
                        f"{f.url}: the store kept failing after {self.retries} retries ({type(e).__name__}: {e})"
                    ) from None
                with self._lock:
                    self.stats.retries += 1
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def drop(self, url: str) -> None:
        """Forget the cached units of ``url`` (a file described once, not read again by this reader)."""
        with self._lock:
            for key in [k for k in self._units if k[0] == url]:
                self._cached -= len(self._units.pop(key))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._units.clear()
        self._cached = 0
