"""``raysc quantize --out s3://bucket/prefix``: the quantized folder is written locally, then
uploaded through the project's object-store layer (``raysc.checkpoint.storage.Storage``: fsspec,
so any URL it takes works, ``gs://`` too), which is also what ``raysc serve`` mirrors from.

Commit last, never overwrite: the store is probed before any quantization work, a prefix that
already holds a ``quantize_manifest.json`` is refused, every other file is uploaded and its size
checked, and the manifest goes last, so a prefix with a manifest is a complete folder.
Credentials: the run's ``checkpoint.storage_options`` (secrets are redacted in a run's
config.toml, so the environment's ``AWS_*`` variables supply them there).
"""

from __future__ import annotations

from pathlib import Path

from raysc.checkpoint.storage import Storage, StorageError
from raysc.quantize.manifest import MANIFEST


def is_remote(out: str | Path) -> bool:
    """Whether ``--out`` names an object store (``s3://...``) rather than a local folder."""
    text = str(out)
    return "://" in text and not text.startswith("file://")


def open_destination(uri: str, options: dict) -> Storage:
    """The store at ``uri``, checked writable and free of an earlier quantized folder; a ``ValueError``
    (the CLI prints it and exits 2) names what is wrong with ``--out`` otherwise."""
    storage = Storage(uri.rstrip("/"), options)
    try:
        storage.probe()
    except StorageError as e:
        raise ValueError(str(e).replace("checkpoint.uri", "--out", 1)) from None
    if storage.exists(MANIFEST):
        raise ValueError(
            f"--out {uri} already holds a quantized checkpoint ({MANIFEST}); nothing is "
            f"overwritten: choose another prefix"
        )
    return storage


def upload_folder(local: str | Path, storage: Storage) -> int:
    """Upload every file under ``local`` to ``storage`` (relative paths kept), the manifest last;
    returns the bytes sent."""
    local = Path(local)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != MANIFEST)
    sent = 0
    for f in [*files, local / MANIFEST]:
        rel = f.relative_to(local).as_posix()
        size, _ = storage.upload_file(str(f), rel)
        if storage.size(rel) != size:
            raise StorageError(f"--out {storage.uri}: {rel} reads back {storage.size(rel)} bytes, {size} were sent")
        sent += size
    return sent
