"""SHA-256 of files and streams, in one place (corpus ids, checkpoint manifests, uploads).

``pump`` copies a stream to another (or to nowhere) while hashing it, so a file is read once
whether it is being verified, uploaded or downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

CHUNK = 8 << 20


def pump(src: BinaryIO, dst: BinaryIO | None = None, chunk: int = CHUNK) -> tuple[int, str]:
    """Read ``src`` to the end (writing to ``dst`` if given); return (bytes, sha256 hex)."""
    h, n = hashlib.sha256(), 0
    for block in iter(lambda: src.read(chunk), b""):
        h.update(block)
        if dst is not None:
            dst.write(block)
        n += len(block)
    return n, h.hexdigest()


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return pump(f)[1]
