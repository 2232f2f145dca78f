"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``), read and written.

The format, as megatron-core's ``IndexedDataset`` reads it (``megatron/core/datasets/indexed_dataset.py``):
``.bin`` holds every sequence's tokens back to back in one dtype; ``.idx`` is the header
``MMIDIDX\\x00\\x00``, version 1 (uint64), the dtype code (uint8: uint8 1, int8 2, int16 3, int32 4,
int64 5, float64 6, float32 7, uint16 8), the sequence count and the document-index count (uint64 each),
then the sequences' lengths (int32), their byte offsets into ``.bin`` (int64) and the document
indices (int64: sequence numbers where documents begin, from 0, ending with the sequence count).
Megatron's ``preprocess_data.py`` writes one sequence per document (``--append-eod`` ends each with the
tokenizer's end-of-document token).

Ours rather than megatron-core's code: megatron-core is a training framework of its own (torch, its
parallel state, optional Transformer Engine); raysc reads the two files with numpy memmaps and keeps
megatron-core as the independent reader and writer its tests check against (tests/test_megatron.py).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # the magic, version, dtype code and the two counts
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


class IndexedDatasetError(ValueError):
    """Not a readable Megatron indexed dataset; the message names the file and what is wrong."""


def prefix_of(path: str | Path) -> Path | None:
    """The dataset prefix of ``path`` (``x`` for ``x``, ``x.bin`` or ``x.idx`` when ``x.idx`` exists); else None."""
    p = Path(path)
    if p.suffix in (".bin", ".idx"):
        p = p.with_suffix("")
    return p if p.with_suffix(".idx").is_file() else None


def parse_header(head: bytes, where: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document-index count) from the first ``HEADER_BYTES`` of an ``.idx``
    (``where`` names it in the error of a damaged one)."""
    if len(head) < HEADER_BYTES or head[:9] != HEADER:
        raise IndexedDatasetError(f"{where} is not a Megatron index (its header is not MMIDIDX)")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:HEADER_BYTES])
    if version != 1 or code not in DTYPES:
        raise IndexedDatasetError(
            f"{where}: version {version}, dtype code {code}; raysc reads version 1 with codes {sorted(DTYPES)}"
        )
    return np.dtype(DTYPES[code]), n_seq, n_doc


def read_index(prefix: str | Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths, sequence byte offsets, document indices) from ``PREFIX.idx``."""
    idx = Path(prefix).with_suffix(".idx")
    with open(idx, "rb") as f:
        dtype, n_seq, n_doc = parse_header(f.read(HEADER_BYTES), str(idx))
    buf = np.memmap(idx, mode="r", dtype=np.uint8)
    need = 34 + n_seq * 4 + n_seq * 8 + n_doc * 8
    if len(buf) < need:
        raise IndexedDatasetError(
            f"{idx} is truncated: {len(buf)} bytes for {n_seq} sequences and {n_doc} document indices ({need} needed)"
        )
    lengths = np.frombuffer(buf, np.int32, n_seq, 34)
    pointers = np.frombuffer(buf, np.int64, n_seq, 34 + lengths.nbytes)
    documents = np.frombuffer(buf, np.int64, n_doc, 34 + lengths.nbytes + pointers.nbytes)
    return dtype, lengths, pointers, documents


def read_documents(prefix: str | Path, fs=None) -> list[np.ndarray]:
    """Each document's tokens (its sequences joined), in order, from ``PREFIX.bin``/``.idx`` (on local disk,
    or on the fsspec filesystem ``fs``, read whole)."""
    if fs is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # the two files, local for the memmaps
            local = Path(tmp) / "d"
            for suffix in (".idx", ".bin"):
                local.with_suffix(suffix).write_bytes(fs.cat_file(f"{prefix}{suffix}"))
            return [np.array(d) for d in read_documents(local)]
    dtype, lengths, pointers, documents = read_index(prefix)
    bin_path = Path(prefix).with_suffix(".bin")
    data = np.memmap(bin_path, mode="r", dtype=dtype)
    end = int(pointers[-1] // dtype.itemsize + lengths[-1]) if len(lengths) else 0
    if end > len(data):
        raise IndexedDatasetError(f"{bin_path} is truncated: {len(data)} tokens, its index needs {end}")
    starts = pointers // dtype.itemsize
    out = []
    for a, b in zip(documents[:-1], documents[1:]):
        parts = [data[starts[i] : starts[i] + lengths[i]] for i in range(a, b)]
        out.append(np.concatenate(parts) if parts else np.zeros(0, dtype))
    return out


def encode_indexed(documents: list[np.ndarray], dtype: np.dtype) -> tuple[bytes, bytes]:
    """The ``.bin`` and ``.idx`` bytes of ``documents``, one sequence each (as ``preprocess_data.py`` writes)."""
    dtype = np.dtype(dtype)
    if dtype not in CODES:
        raise ValueError(f"Megatron's index has no code for {dtype}")
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * dtype.itemsize
    data = b"".join(np.asarray(d, dtype=dtype).tobytes() for d in documents)
    index = b"".join(
        [
            HEADER,
            struct.pack("<QBQQ", 1, CODES[dtype], len(lengths), len(lengths) + 1),
            lengths.tobytes(),
            pointers.tobytes(),
            np.arange(len(lengths) + 1, dtype=np.int64).tobytes(),
        ]
    )
    return data, index


def write_indexed(prefix: str | Path, documents: list[np.ndarray], dtype: np.dtype) -> None:
    """Write ``documents`` as ``PREFIX.bin`` and ``PREFIX.idx`` on local disk."""
    data, index = encode_indexed(documents, dtype)
    Path(prefix).with_suffix(".bin").write_bytes(data)
    Path(prefix).with_suffix(".idx").write_bytes(index)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype Megatron's preprocessing would pick for ids below ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)
