"""MinHash signatures and LSH band keys for near-duplicate detection, vectorised with numpy.

A document is the set of its word ``n``-gram shingles (``dedup.shingle``, default 5) of ``words()``.
Each word gets a stable 64-bit hash (``raysc.curate.words.word_hashes``: from the UTF-8 bytes of a whole
batch at once; Python's own ``hash`` differs between processes); a shingle's 64-bit hash combines its
words' hashes with fixed odd multipliers, computed for all windows of all documents of a batch at once
(shifted slices of the batch's word hashes).

A signature has ``num_perm`` values, computed by one of two schemes (``dedup.minhash``):

- ``one_permutation`` (the default): one-permutation hashing with optimal densification (Li, Owen and
  Zhang 2012; Shrivastava 2017). Each shingle hash is mixed once (splitmix64's finaliser of the hash xor a
  seeded key); its high 32 bits pick one of the ``num_perm`` bins, its low 32 bits are its value, and a bin
  keeps the minimum value of its shingles (``np.minimum.at`` over document × bin). An empty bin takes the
  value of the first non-empty bin of a fixed, seeded sequence of bins for that bin (the same sequence in
  every document, so two documents' values agree with probability their Jaccard similarity). One hash per
  shingle instead of ``num_perm``: half the signature time of the other scheme on web text, with the same
  accuracy on near-duplicate pairs (docs/data.md).
- ``k_permutations``: ``num_perm`` multiply-shift hashes ``(a·x + b) mod 2^64 >> 32`` with random odd
  ``a`` (a 2-universal family, Dietzfelbinger et al. 1997), each minimised over the document's shingles
  (what datasketch's ``MinHash`` computes): applied to a block of shingle hashes as one
  ``(num_perm, shingles)`` array and reduced per document with ``np.minimum.reduceat``.

Documents are hashed in slices of ``_DOCS_PER_SLICE``: on these VMs the first touch of memory a process has
not used costs up to ~7 s per GiB, so a read task's first file paid ~0.5 s of page faults for arrays as
large as all its shingles. No Python loop runs over hash functions, shingles or the words of ASCII text.

LSH: the signature is cut into ``bands`` bands of ``rows`` values; two documents become a
candidate pair when any band matches. Each band is folded to one 64-bit key, so buckets
are a group-by on (band, key). The probability that a pair with Jaccard similarity
``s`` becomes a candidate is ``1 - (1 - s^rows)^bands`` (``candidate_probability``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raysc.curate.words import word_hashes, words

if TYPE_CHECKING:
    import pyarrow as pa

_MAX_BATCH_CELLS = 1 << 18  # num_perm × shingles per numpy block (2 MiB of uint64: stays in cache)
_DOCS_PER_SLICE = 512  # documents hashed at once (~1 MiB of shingle hashes per array for web text)
_JUMPS = 4096  # densification sequence per bin: P(a 1-shingle document still has an empty bin) < 1e-13
_PROBE = 16  # the first bins of an empty bin's sequence tried directly
_DENSIFY_CELLS = 1 << 21  # empty bins × candidate bins compared at once past those (16 MiB of int64)
SCHEMES = ("one_permutation", "k_permutations")
_EMPTY = np.uint32(0xFFFFFFFF)


def candidate_probability(s: float | np.ndarray, bands: int, rows: int):
    """Chance that two documents with Jaccard similarity ``s`` share at least one LSH band."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


@dataclass(frozen=True)
class MinHasher:
    num_perm: int = 112
    bands: int = 14
    rows: int = 8
    shingle: int = 5
    seed: int = 1
    scheme: str = "one_permutation"

    def __post_init__(self) -> None:
        if self.bands * self.rows != self.num_perm:
            raise ValueError(
                f"dedup.bands × dedup.rows must equal dedup.num_perm ({self.bands} × {self.rows} != {self.num_perm})"
            )
        if self.scheme not in SCHEMES:
            raise ValueError(f"dedup.minhash = {self.scheme!r}: use one of {', '.join(SCHEMES)}")
        rng = np.random.default_rng(self.seed)
        object.__setattr__(self, "_a", rng.integers(1, 2**63, self.num_perm, dtype=np.uint64) * 2 + 1)
        object.__setattr__(self, "_b", rng.integers(0, 2**63, self.num_perm, dtype=np.uint64))
        object.__setattr__(self, "_mix", rng.integers(1, 2**63, self.shingle, dtype=np.uint64) * 2 + 1)
        object.__setattr__(self, "_band_mix", rng.integers(1, 2**63, self.rows, dtype=np.uint64) * 2 + 1)
        # one-permutation hashing: the seeded key of the one mix, and each bin's sequence of bins to copy from
        object.__setattr__(self, "_key", rng.integers(0, 2**63, dtype=np.uint64) * 2 + 1)
        k = self.num_perm
        jump = rng.integers(0, k, (k, _JUMPS), dtype=np.int64)
        # where each bin j first appears in bin i's sequence (_JUMPS + j if never: then the smallest such j)
        first = np.tile(_JUMPS + np.arange(k, dtype=np.int64), k)
        np.minimum.at(first, (np.arange(k)[:, None] * k + jump).ravel(), np.tile(np.arange(_JUMPS), k))
        object.__setattr__(self, "_jump", jump)
        object.__setattr__(self, "_first", first.reshape(k, k))

    def __reduce__(self) -> tuple:
        """Pickled as its parameters (the arrays above are drawn again from the seed): a Ray task gets
        a few bytes, not the 3.7 MB of densification sequences."""
        return MinHasher, (self.num_perm, self.bands, self.rows, self.shingle, self.seed, self.scheme)

    def shingle_hashes(self, texts: list[str] | pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """64-bit hashes of every document's word shingles, concatenated, and each document's
        start offset. A document shorter than ``shingle`` words is one shingle of all its words;
        one without words gets the hash of nothing, so it matches only other empty documents."""
        n = self.shingle
        wh, bounds = word_hashes(texts)
        lengths = np.diff(bounds)
        counts = np.maximum(1, lengths - n + 1)  # windows per document
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        with np.errstate(over="ignore"):
            # every full window of the concatenated words, by n shifted slices (contiguous, no gathers)
            full = np.zeros(max(0, len(wh) - n + 1), dtype=np.uint64)
            for k in range(n):
                full += wh[k : k + len(full)] * self._mix[k]
            short = np.flatnonzero(lengths < n)  # one window of all their words (none: the hash of nothing)
            short_acc = np.zeros(len(short), dtype=np.uint64)
            for k in range(n):
                has = lengths[short] > k
                short_acc[has] += wh[bounds[short[has]] + k] * self._mix[k]
            # a document's windows start at each of its words but the last n - 1
            doc_of = np.repeat(np.arange(len(lengths)), counts)
            index = bounds[:-1][doc_of] + (np.arange(int(counts.sum())) - starts[doc_of])
            index[starts[short]] = len(full) + np.arange(len(short))
            acc = np.concatenate([full, short_acc])[index]
            acc ^= acc >> np.uint64(29)  # a finaliser (splitmix64) spreads the sum's bits
            acc *= np.uint64(0xBF58476D1CE4E5B9)
            acc ^= acc >> np.uint64(32)
        return acc, starts

    def signatures(self, texts: list[str] | pa.Array) -> np.ndarray:
        """MinHash signatures, shape (documents, num_perm), uint32, by ``scheme``."""
        sig = np.empty((len(texts), self.num_perm), dtype=np.uint32)
        one = self.scheme == "one_permutation"
        for lo in range(0, len(texts), _DOCS_PER_SLICE):
            part = texts[lo : lo + _DOCS_PER_SLICE]
            hashes, starts = self.shingle_hashes(part)
            sig[lo : lo + len(part)] = (self._one_permutation if one else self._k_permutations)(hashes, starts)
        return sig

    def _one_permutation(self, hashes: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Each shingle in one bin, a bin's minimum, empty bins densified (module docstring)."""
        n, k = len(starts), self.num_perm
        with np.errstate(over="ignore"):
            x = hashes ^ self._key
            x ^= x >> np.uint64(30)
            x *= np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(27)
            x *= np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
            cell = ((x >> np.uint64(32)) * np.uint64(k)) >> np.uint64(32)  # the bin, uniform in [0, k)
        cell += np.repeat(np.arange(n, dtype=np.uint64) * np.uint64(k), np.diff(np.append(starts, len(hashes))))
        sig = np.full(n * k, _EMPTY, dtype=np.uint32)
        # a value of 2^32 - 1 would read as empty: it becomes 2^32 - 2 (one value in 2^32 merged)
        np.minimum.at(sig, cell.astype(np.int64), np.minimum(x.astype(np.uint32), _EMPTY - np.uint32(1)))
        return self._densify(sig.reshape(n, k))

    def _densify(self, sig: np.ndarray) -> np.ndarray:
        """Each empty bin takes the value of its sequence's earliest full bin (the least ``_first``)."""
        k = self.num_perm
        full = sig != _EMPTY
        doc, bin_ = np.nonzero(~full)
        held = full.sum(axis=1)
        # where a document has at least 1/8 of its bins full, the first _PROBE bins of the sequence hold
        # that bin for most empty bins (a third full: 1 - (2/3)^16 of them)
        probe = np.flatnonzero(held[doc] * 8 >= k)
        window = self._jump[bin_[probe], :_PROBE]
        hit = full[doc[probe][:, None], window]
        found = np.flatnonzero(hit.any(axis=1))
        took = probe[found]
        sig[doc[took], bin_[took]] = sig[doc[took], window[found, hit[found].argmax(axis=1)]]
        doc, bin_ = np.delete(doc, took), np.delete(bin_, took)
        # the rest: the least ``_first`` among the document's own full bins; pairs ordered by how many bins
        # their document holds, so that a chunk compares only as many candidates as its documents hold
        order = np.argsort(held[doc], kind="stable")
        doc, bin_ = doc[order], bin_[order]
        full_first = np.argsort(~full, axis=1, kind="stable")  # a document's full bins, then its empty ones
        lo = 0
        while lo < len(doc):
            width = int(held[doc[lo]])
            same = int(np.searchsorted(held[doc], width, "right"))  # the pairs of documents holding as many
            hi = min(same, lo + max(1, _DENSIFY_CELLS // width))
            d, b = doc[lo:hi], bin_[lo:hi]
            candidates = full_first[d, :width]
            best = self._first[b[:, None], candidates].argmin(axis=1)
            sig[d, b] = sig[d, candidates[np.arange(len(d)), best]]
            lo = hi
        return sig

    def _k_permutations(self, hashes: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Each of the num_perm multiply-shift hashes minimised over each document's shingles."""
        sig = np.empty((len(starts), self.num_perm), dtype=np.uint32)
        # process documents in blocks so that num_perm × shingles stays bounded
        ends = np.append(starts[1:], len(hashes))
        doc = 0
        while doc < len(starts):
            last = doc
            while last + 1 < len(starts) and (ends[last + 1] - starts[doc]) * self.num_perm <= _MAX_BATCH_CELLS:
                last += 1
            lo, hi = starts[doc], ends[last]
            buf = np.empty((self.num_perm, hi - lo), dtype=np.uint64)  # in place: one pass of memory per op
            np.multiply(self._a[:, None], hashes[None, lo:hi], out=buf)
            np.add(buf, self._b[:, None], out=buf)
            # ``>> 32`` is monotone, so it commutes with the minimum: shifting the reduced signatures
            # instead of the whole (num_perm, shingles) buffer saves one pass over it
            low = np.minimum.reduceat(buf, starts[doc : last + 1] - lo, axis=1)
            sig[doc : last + 1] = (low >> np.uint64(32)).T
            doc = last + 1
        return sig

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """One 64-bit key per (document, band): shape (documents, bands), uint64."""
        blocks = sig.reshape(len(sig), self.bands, self.rows).astype(np.uint64)
        with np.errstate(over="ignore"):
            keys = (blocks * self._band_mix[None, None, :]).sum(axis=2, dtype=np.uint64)
            keys ^= np.arange(self.bands, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15)
            keys ^= keys >> np.uint64(31)
        return keys


def jaccard(a: str, b: str, shingle: int = 5) -> float:
    """Exact Jaccard similarity of two documents' word-shingle sets (for audits and tests)."""

    def grams(t: str) -> set:
        w = words(t)
        return {tuple(w[i : i + shingle]) for i in range(max(1, len(w) - shingle + 1))}

    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y) if x | y else 1.0
