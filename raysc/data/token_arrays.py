"""OLMo / Dolma-style token files as a ``data.source``: flat arrays of token ids, documents separated by
the tokenizer's EOS, one or many ``.npy`` files read in name order.

Two layouts carry the ``.npy`` name: numpy's own format (a header saying dtype and shape, what
``np.save`` writes) and the raw memmaps OLMo's and Dolma's tokenizers write (no header: the dtype must
be known, uint16 for vocabularies up to 65,536 tokens and uint32 above, OLMo's rule, or
``data.token_dtype``). A file is read as numpy's format when it starts with numpy's magic bytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NPY_MAGIC = b"\x93NUMPY"


def token_files(source: str | Path) -> list[Path] | None:
    """The ``.npy`` files of ``source`` (the file, or a directory's, sorted); None when it is neither."""
    p = Path(source)
    if p.is_file() and p.suffix == ".npy":
        return [p]
    if p.is_dir() and not (p / "index.json").exists():
        files = sorted(p.glob("*.npy"))
        return files or None
    return None


def token_dtype(name: str, vocab_size: int) -> np.dtype:
    """``data.token_dtype``: uint16 / uint32, or auto = OLMo's rule from the vocabulary size."""
    if name == "auto":
        return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)
    return np.dtype(name)


def read_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    """One file's token ids: numpy's format by its header, else a raw array of ``dtype``."""
    with open(path, "rb") as f:
        magic = f.read(len(NPY_MAGIC))
    if magic == NPY_MAGIC:
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise ValueError(
                f"{path} holds a {arr.dtype} array of shape {arr.shape}; a token file is one flat array of unsigned ids"
            )
        return arr
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype} ids: it was written with "
            f"another dtype; set data.token_dtype"
        )
    return np.memmap(path, mode="r", dtype=dtype)
