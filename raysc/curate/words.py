"""Words of a document and their 64-bit hashes, for MinHash shingles (``raysc.curate.minhash``) and the
quality measurements (``raysc.curate.quality``).

``words(text)``: the runs of ``\\w`` in the lowercased text (Python's Unicode ``\\w``).

``word_hashes(texts)``: every word's hash for a whole batch at once, from the texts' UTF-8 bytes with
numpy. An ASCII text's words are its runs of ``[A-Za-z0-9_]`` bytes (exactly what ``\\w`` matches in
ASCII text), lowercased by a byte table; any other text is split by ``words()`` in Python and its words
rejoined with spaces, so the same byte pass finds them. A word's hash (``word_hash``) is the polynomial
``sum(byte_i · P^i) mod 2^64`` of its UTF-8 bytes through splitmix64's finaliser: prefix sums of
``byte · P^position`` over a chunk of bytes, the difference at a word's two ends, times ``P^-start``
(``P`` is odd, so it has an inverse modulo 2^64). It is the same in every process (Python's ``hash`` is
not). Ours because no library hashes the words of many strings at once: a regex ``findall`` per text and
a crc32 per distinct word took 0.22 s per 5,000 web documents (10 CPU-s of raysc curate at 100k, with
the shingles), this 0.08 s.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

_WORD = re.compile(r"\w+", re.UNICODE)
_P = np.uint64(0x9E3779B97F4A7C15)  # odd
_P_INV = np.uint64(pow(int(_P), -1, 2**64))
_CHUNK = 1 << 18  # bytes per numpy pass (a few MiB of uint64 arrays: stays in cache, no page faults)
_LOWER = np.arange(256, dtype=np.uint8)
_LOWER[ord("A") : ord("Z") + 1] += 32
_IS_WORD = np.zeros(256, dtype=bool)  # [A-Za-z0-9_] and every byte of a non-ASCII character
for _lo, _hi in (("0", "9"), ("A", "Z"), ("a", "z"), ("_", "_")):
    _IS_WORD[ord(_lo) : ord(_hi) + 1] = True
_IS_WORD[0x80:] = True  # only in the rejoined words of non-ASCII texts, which hold word characters and spaces


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _powers(base: np.uint64, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    out[0] = 1
    with np.errstate(over="ignore"):
        np.cumprod(np.full(n - 1, base, dtype=np.uint64), out=out[1:])
    return out


_POW, _POW_INV = _powers(_P, _CHUNK), _powers(_P_INV, _CHUNK)


def _finalise(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def word_hash(word: str) -> int:
    """One word's hash, as ``word_hashes`` computes it (the definition, for tests)."""
    poly = sum(b * pow(int(_P), i, 2**64) for i, b in enumerate(word.encode())) % 2**64
    return int(_finalise(np.array([poly], dtype=np.uint64))[0])


def _chunk_words(data: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unfinalised hashes of the words in ``data`` (the bytes of texts starting at ``offsets``, which
    begin at 0) and each text's first word's index; words never cross texts."""
    n = len(data)
    if n == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(len(offsets), dtype=np.int64)
    pows, pows_inv = (_POW, _POW_INV) if n <= _CHUNK else (_powers(_P, n), _powers(_P_INV, n))
    is_word = _IS_WORD[data]
    after_word = np.empty(n, dtype=bool)  # the previous byte is a word byte of the same text
    after_word[0] = False
    after_word[1:] = is_word[:-1]
    before_word = np.empty(n, dtype=bool)  # the next byte is a word byte of the same text
    before_word[-1] = False
    before_word[:-1] = is_word[1:]
    inner = offsets[1:-1]
    inner = inner[(inner > 0) & (inner < n)]
    after_word[inner] = False
    before_word[inner - 1] = False
    starts = np.flatnonzero(is_word & ~after_word)
    ends = np.flatnonzero(is_word & ~before_word) + 1
    prefix = np.empty(n + 1, dtype=np.uint64)
    prefix[0] = 0
    with np.errstate(over="ignore"):
        np.cumsum(_LOWER[data] * pows[:n], out=prefix[1:])
        poly = (prefix[ends] - prefix[starts]) * pows_inv[starts]
    return poly, np.searchsorted(starts, offsets)


def _utf8(texts: list[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The texts' UTF-8 bytes, a non-ASCII text replaced by its ``words()`` joined with spaces, and
    each text's start offset (one more at the end)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    arr = texts if isinstance(texts, pa.Array) else pa.array(texts, pa.large_string())
    other = pc.invert(pc.string_is_ascii(arr))
    if pc.any(other).as_py():
        joined = [" ".join(words(t)) for t in pc.filter(arr, other).to_pylist()]
        arr = pc.replace_with_mask(arr, other, pa.array(joined, arr.type))
    if len(arr) == 0:
        return np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    _, offset_buf, data_buf = arr.buffers()
    offset_type = np.int64 if pa.types.is_large_string(arr.type) else np.int32
    offsets = np.frombuffer(offset_buf, dtype=offset_type)[arr.offset : arr.offset + len(arr) + 1].astype(np.int64)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, dtype=np.uint8)
    return data[offsets[0] : offsets[-1]], offsets - offsets[0]


def word_hashes(texts: list[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The hashes of every text's ``words()``, concatenated (uint64), and each text's first word's index
    into them (one more at the end: the total)."""
    data, offsets = _utf8(texts)
    hashes, bounds, done, first = [], [np.zeros(1, dtype=np.int64)], 0, 0
    while first < len(offsets) - 1:  # chunks of whole texts of up to _CHUNK bytes (or one longer text)
        last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + _CHUNK, side="right")) - 1)
        lo, hi = offsets[first], offsets[last]
        poly, starts = _chunk_words(data[lo:hi], offsets[first : last + 1] - lo)
        hashes.append(poly)
        bounds.append(starts[1:] + done)
        done += len(poly)
        first = last
    return _finalise(np.concatenate(hashes)) if hashes else np.zeros(0, dtype=np.uint64), np.concatenate(bounds)
