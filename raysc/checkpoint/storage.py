"""Where checkpoints live: any fsspec URL (a local path, ``file://``, ``s3://``, ``gs://``, ...).

A thin layer over an fsspec filesystem that speaks in checkpoint terms (step
prefixes, files, manifests) and turns the storage's failures into errors that
say what is wrong and how to fix it. Credentials come from
``checkpoint.storage_options`` or the standard environment variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...); they are never written to
the config, the manifest, events or logs (``redact``).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from raysc.config.secrets import redact  # noqa: F401  (re-exported: callers redact storage options)
from raysc.hashing import pump

WHOLE_OBJECT_MAX = 512 << 20  # files up to this size move in memory (in parallel parts where the store allows)
MIN_PART = 8 << 20  # smallest part of a parallel transfer (S3's multipart minimum is 5 MiB)


def step_name(step: int) -> str:
    """The name of checkpoint ``step`` under the store's root: ``step_00000100``."""
    return f"step_{step:08d}"


def default_concurrency() -> int:
    """Parallel requests per file: the client's hashing and TLS work scales with its cores."""
    return min(8, max(2, os.cpu_count() or 2))


def _hash_in_thread(parts: list[bytes]):
    """Start SHA-256 of the concatenated ``parts`` in a thread (hashlib releases the GIL, so it
    overlaps the transfer or the disk write); return a function that waits for the hex digest."""
    import threading

    def run() -> None:
        h = hashlib.sha256()
        for p in parts:
            h.update(p)
        out.append(h.hexdigest())

    out: list[str] = []
    t = threading.Thread(target=run)
    t.start()
    return lambda: (t.join(), out[0])[1]


def parse_storage_options(text: str) -> dict[str, Any]:
    """``checkpoint.storage_options`` is a JSON object (TOML inline tables arrive as JSON here)."""
    if not text.strip():
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
    return value


def _fs_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    opts = dict(options)
    if protocol in ("s3", "s3a"):
        # s3fs takes the endpoint inside client_kwargs; accept it at the top level too
        client = dict(opts.pop("client_kwargs", {}))
        for key in ("endpoint_url", "region_name"):
            if key in opts:
                client[key] = opts.pop(key)
        if "endpoint_url" not in client and os.environ.get("AWS_ENDPOINT_URL"):
            client["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
        if client:
            opts["client_kwargs"] = client
    return opts


class StorageError(RuntimeError):
    """The checkpoint location cannot be used; the message names the URI, the cause and a fix."""


@dataclass
class Storage:
    uri: str
    options: dict[str, Any]
    concurrency: int = 0  # parallel parts per file transfer; 0 = default_concurrency()

    def __post_init__(self) -> None:
        protocol = fsspec.utils.get_protocol(self.uri)
        self.fs, self.root = fsspec.core.url_to_fs(self.uri, **_fs_options(protocol, self.options))
        self.root = self.root.rstrip("/")
        self.is_local = protocol in ("file", "local")
        self.is_s3 = protocol in ("s3", "s3a")
        self.concurrency = self.concurrency or default_concurrency()
        # ranged GETs in parallel need an async fsspec implementation (s3fs, gcsfs, adlfs, http)
        self.parallel_reads = bool(getattr(self.fs, "async_impl", False)) and self.concurrency > 1

    # ---- paths ----
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_prefix(self, step: int) -> str:
        return step_name(step)

    # ---- basic operations ----
    def write_bytes(self, rel: str, data: bytes) -> None:
        full = self.path(rel)
        if self.is_local:
            self.fs.makedirs(os.path.dirname(full), exist_ok=True)
        self.fs.pipe_file(full, data)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def _fresh(self, full: str) -> str:
        """Drop fsspec's cached listings: other processes (workers, other runs) write here."""
        self.fs.invalidate_cache(full)
        return full

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._fresh(self.path(rel)))

    def size(self, rel: str) -> int:
        return int(self.fs.info(self._fresh(self.path(rel)))["size"])

    def delete_prefix(self, rel: str) -> None:
        if self.fs.exists(self._fresh(self.path(rel))):
            self.fs.rm(self.path(rel), recursive=True)

    def usage(self, rel: str) -> int:
        """Bytes stored under ``rel`` (0 if nothing is there)."""
        try:
            return int(
                sum(info.get("size", 0) for info in self.fs.find(self._fresh(self.path(rel)), detail=True).values())
            )
        except FileNotFoundError:
            return 0

    def delete(self, rel: str) -> None:
        self.fs.rm_file(self.path(rel))

    def upload_file(
        self, local_path: str, rel: str, known: tuple[int, str] | None = None, chunk: int = 8 << 20
    ) -> tuple[int, str]:
        """Send a local file to ``rel``; return (size, sha256).

        ``known`` is the digest taken when the file was written (``staging.HashingFileSystem``):
        the bytes are not hashed again, only their size is checked. Otherwise files up to
        ``WHOLE_OBJECT_MAX`` are hashed in a second thread while they upload as one object, and
        larger ones are streamed in ``chunk`` blocks."""
        full = self.path(rel)
        if self.is_local:
            self.fs.makedirs(os.path.dirname(full), exist_ok=True)
        size = os.path.getsize(local_path)
        if size <= WHOLE_OBJECT_MAX:
            with open(local_path, "rb") as f:
                data = f.read()
            if known is not None and known[0] != len(data):
                raise OSError(f"{local_path}: {len(data)} bytes on disk, {known[0]} written (staging corrupted)")
            digest = (lambda: known[1]) if known is not None else _hash_in_thread([data])
            self.fs.pipe_file(full, data)  # s3fs sends large objects as parallel multipart parts
            return len(data), digest()
        with open(local_path, "rb") as src, self.fs.open(full, "wb") as dst:
            return pump(src, dst, chunk)

    def _get(self, full: str, size: int) -> list[bytes]:
        """The bytes of one object as a list of parts: ``concurrency`` ranged GETs in parallel
        when the store supports them and the object has the expected ``size``, else one GET."""
        if self.parallel_reads and size >= 2 * MIN_PART:
            actual = int(self.fs.info(self._fresh(full))["size"])
            if actual == size:  # a truncated object is read whole, so the caller sees its real size
                part = max(MIN_PART, -(-size // self.concurrency))
                starts = list(range(0, size, part))
                return self.fs.cat_ranges(
                    [full] * len(starts), starts, [min(size, a + part) for a in starts], on_error="raise"
                )
        return [self.fs.cat_file(full)]

    def download_file(self, rel: str, local_path: str, size_hint: int = 0, chunk: int = 8 << 20) -> tuple[int, str]:
        """Bring ``rel`` to a local file; return (size, sha256) of the bytes received."""
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        if size_hint and size_hint <= WHOLE_OBJECT_MAX:
            parts = self._get(self.path(rel), size_hint)
            digest = _hash_in_thread(parts)
            with open(local_path, "wb") as dst:
                for p in parts:
                    dst.write(p)
            return sum(map(len, parts)), digest()
        with self.fs.open(self.path(rel), "rb") as src, open(local_path, "wb") as dst:
            return pump(src, dst, chunk)

    def sha256(self, rel: str) -> str:
        with self.fs.open(self.path(rel), "rb") as f:
            return pump(f)[1]

    def step_dirs(self) -> Iterator[str]:
        """Names of the ``step_*`` prefixes under the root (committed or not)."""
        try:
            self.fs.invalidate_cache()
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return
        for e in entries:
            name = e.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("step_"):
                yield name

    # ---- fail fast ----
    def probe(self) -> None:
        """Write, read back and delete a small object; raise StorageError naming the problem."""
        rel = f".raysc-probe-{uuid.uuid4().hex}"
        payload = b"raysc write probe"
        try:
            self.write_bytes(rel, payload)
            if self.read_bytes(rel) != payload:
                raise StorageError(f"checkpoint.uri {self.uri!r}: a probe object read back different bytes")
            self.delete(rel)
        except StorageError:
            raise
        except FileNotFoundError as e:
            raise StorageError(
                f"checkpoint.uri {self.uri!r}: the bucket or directory does not exist ({e}). "
                f"Create it first (e.g. `aws s3 mb s3://BUCKET`) or fix the URI."
            ) from None
        except PermissionError as e:
            raise StorageError(
                f"checkpoint.uri {self.uri!r}: access denied ({e}). Check the credentials "
                f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or checkpoint.storage_options) and that "
                f"they may write, read and delete under this prefix."
            ) from None
        except Exception as e:
            if not isinstance(e, OSError) and not _unreachable(e):
                raise StorageError(
                    f"checkpoint.uri {self.uri!r}: write probe failed: {type(e).__name__}: {e}"
                ) from None
            raise StorageError(
                f"checkpoint.uri {self.uri!r}: the store is unreachable or refused the probe ({e}). "
                f"Check the endpoint (AWS_ENDPOINT_URL or storage_options.endpoint_url) and network."
            ) from None


def _unreachable(e: Exception) -> bool:
    """Whether a client error says the endpoint could not be reached (botocore's connection errors
    are not OSErrors, and botocore and other clients have no common base class: by class name)."""
    return any(
        c.__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError")
        for c in type(e).__mro__
    )
