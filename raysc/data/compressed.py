"""Reading corpus files as people store them: ``.gz`` and ``.zst`` (Dolma, RedPajama and FineWeb dumps)
beside plain files, on local disk or an object store.

fsspec opens the file (any of its filesystems) and decompresses gzip (Python's codec), chosen from the
file's suffix. zstd is decompressed here frame by frame with the ``zstandard`` package's decompressor:
fsspec's zstd codec reads a truncated frame as a clean end of file, silently losing the rest, where
the decompressor says whether each frame ended. What is ours is reading a damaged file without losing
the whole job: ``read_bytes`` returns what decompressed before the damage and the reason it stopped, so
curation counts a damaged file as a reason in its report.
"""

from __future__ import annotations

import zlib

CODECS = {".gz": "gzip", ".zst": "zstd"}


def split_codec(name: str) -> tuple[str, str | None]:
    """(the name without its compression suffix, fsspec's codec or None): ``a.jsonl.zst`` -> ``a.jsonl``, zstd."""
    for suffix, codec in CODECS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], codec
    return name, None


def _decompress_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


def _zstd_frames(blob: bytes) -> tuple[bytes, str]:
    """Every zstd frame of ``blob`` decompressed; and '' or why decoding stopped (a frame cut short or
    not zstd)."""
    try:
        import zstandard
    except ImportError:
        raise ImportError(
            "reading .zst files needs the zstandard package (a raysc dependency): pip install 'zstandard>=0.22,<1'"
        ) from None

    out: list[bytes] = []
    while blob:
        frame = zstandard.ZstdDecompressor().decompressobj()
        try:
            out.append(frame.decompress(blob))
        except zstandard.ZstdError:
            return b"".join(out), "corrupt or truncated zstd file (ZstdError)"
        if not frame.eof:
            return b"".join(out), "corrupt or truncated zstd file (a frame ends before its end mark)"
        blob = frame.unused_data
    return b"".join(out), ""


def read_bytes(uri: str, options: dict | None = None) -> tuple[bytes, str]:
    """The file's bytes, decompressed by its suffix; and '' or why reading stopped early (a corrupt or
    truncated compressed file: what came before the damage is returned)."""
    import fsspec

    _, codec = split_codec(uri)
    if codec == "zstd":
        with fsspec.open(uri, "rb", **(options or {})) as f:
            return _zstd_frames(f.read())
    chunks: list[bytes] = []
    f = fsspec.open(uri, "rb", compression=codec, **(options or {})).open()  # a missing file raises here
    try:
        while chunk := f.read(1 << 22):
            chunks.append(chunk)
    except _decompress_errors() as e:
        if codec is None:
            raise
        return b"".join(chunks), f"corrupt or truncated {codec} file ({type(e).__name__})"
    finally:
        f.close()
    return b"".join(chunks), ""
