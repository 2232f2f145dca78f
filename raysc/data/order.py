"""The order a run reads its rows in: a seeded bijection from positions to rows, computed, never stored.

An epoch over ``n`` rows is a permutation of them, but a shuffled index array is O(rows) memory and
start-up (Megatron's sample index, Mosaic's epoch order), and a permutation of single rows makes every
read a few KB at a random offset. ``SampleOrder`` instead computes row ``rows(p)`` of position ``p``
from a few keyed Feistel bijections (``Feistel``), in O(1) memory, and keeps reads large:

- the rows are cut into blocks of ``block_rows`` neighbouring rows (about a MiB, ``data.shuffle_block_kib``),
  and the blocks are permuted (a bijection over the block ids);
- the blocks are read ``global_batch`` at a time (a window): global batch ``b`` of a window takes one
  row from each of the window's blocks (position ``q`` of a window is block ``q mod m``, row
  ``q div m`` of it, ``m`` the window's blocks), so a batch draws from ``global_batch`` blocks spread
  over the whole corpus, and a data-parallel rank's contiguous slice of every batch reads the same few
  blocks all window long: each rank fetches whole blocks and uses every row of them;
- inside a block the rows come in a permuted order of their own (keyed by the block);
- the rows past the last whole window (fewer than ``global_batch`` blocks, and the short last block)
  come last in the epoch, in a permuted order of their own. A corpus smaller than one window is all
  tail: an ordinary seeded permutation.

What that costs in randomness (docs/data.md): consecutive batches of a window draw from the same
blocks, so rows a MiB apart in the corpus meet within ``block_rows`` steps of each other; within a batch
no two rows share a block. The order is a pure function of (seed, epoch, n, global batch, block size):
the same at every data-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (a bijection of 64-bit words with good avalanche)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def key_of(parts: Sequence[int]) -> np.uint64:
    """A 64-bit key from a tuple of integers (seed, epoch, domain, ...)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for p in parts:
            h = _mix(np.asarray(h ^ np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF), dtype=np.uint64))[()]
            h = np.uint64(h + np.uint64(0x9E3779B97F4A7C15))
    return np.uint64(h)


class Feistel:
    """A keyed bijection of ``[0, n)``: a balanced Feistel network over the smallest even number of bits
    that holds ``n``, walked again from any value past ``n`` (cycle walking) until it lands inside.
    ``tweak`` (an array as long as the input, or a scalar) keys each element on its own: one call
    permutes the rows of many blocks, each block by its own permutation."""

    ROUNDS = 6

    def __init__(self, n: int, key: np.uint64) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.half = np.uint64(half)
        self.mask = np.uint64((1 << half) - 1)
        self.key = np.uint64(key)

    def __call__(self, x: np.ndarray, tweak: np.ndarray | int = 0) -> np.ndarray:
        x = np.asarray(x, dtype=np.uint64)
        if self.n == 1:
            return np.zeros_like(x)
        tweak = np.asarray(tweak, dtype=np.uint64)
        out = self._round_trip(x, tweak)
        outside = out >= np.uint64(self.n)
        while outside.any():  # cycle walking: at most a few rounds (the domain is < 4n)
            t = tweak if tweak.ndim == 0 else tweak[outside]
            out[outside] = self._round_trip(out[outside], t)
            outside = out >= np.uint64(self.n)
        return out

    def _round_trip(self, x: np.ndarray, tweak: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        with np.errstate(over="ignore"):
            for r in range(self.ROUNDS):
                k = _mix(
                    self.key + np.uint64(r) * np.uint64(0xD6E8FEB86659FD93) + tweak * np.uint64(0xA0761D6478BD642F)
                )
                left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right


class SampleOrder:
    """Rows of positions ``0 .. n-1`` of one epoch (module docstring)."""

    def __init__(self, n: int, global_batch: int, block_rows: int, key: Sequence[int]) -> None:
        self.n, self.g, self.b = n, max(1, global_batch), max(1, block_rows)
        base = key_of(key)
        self.blocks = n // self.b  # whole blocks
        self.windows = self.blocks // self.g  # whole windows of global_batch blocks
        self.windowed = self.windows * self.g * self.b  # positions inside whole windows
        self._block_perm = Feistel(self.blocks, key_of([int(base), 1])) if self.blocks else None
        self._in_block = Feistel(self.b, key_of([int(base), 2]))
        self._tail = Feistel(n - self.windowed, key_of([int(base), 3])) if n > self.windowed else None

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """The row (int64) of each position."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        out = np.empty(p.shape, dtype=np.int64)
        inside = p < self.windowed
        if inside.any():
            q = p[inside]
            window, q = q // (self.g * self.b), q % (self.g * self.b)
            slot = window * self.g + q % self.g  # the window's blocks, one per column of a batch
            out[inside] = self._block_row(slot, q // self.g)
        if (~inside).any():
            t = self._tail(p[~inside] - self.windowed).astype(np.int64)
            rest = (self.blocks - self.windows * self.g) * self.b  # rows of the tail's whole blocks
            in_blocks = t < rest
            tail = np.empty(t.shape, dtype=np.int64)
            if in_blocks.any():
                slot = self.windows * self.g + t[in_blocks] // self.b
                tail[in_blocks] = self._block_row(slot, t[in_blocks] % self.b)
            tail[~in_blocks] = self.blocks * self.b + (t[~in_blocks] - rest)  # the short last block
            out[~inside] = tail
        return out

    def _block_row(self, slot: np.ndarray, i: np.ndarray) -> np.ndarray:
        """Row ``i`` (in the block's own permuted order) of the block at permuted ``slot``."""
        block = self._block_perm(slot).astype(np.int64)
        return block * self.b + self._in_block(i, block.astype(np.uint64)).astype(np.int64)


class StoredPermutation:
    """A stored seeded permutation with ``SampleOrder``'s interface: the order of rows held in memory (the
    data order of every run before issue 57; an O(rows) array, which rows in memory already are)."""

    def __init__(self, perm: np.ndarray) -> None:
        self.perm = perm

    def rows(self, positions: np.ndarray) -> np.ndarray:
        return self.perm[np.asarray(positions, dtype=np.int64)]


STORED_ORDER_ROWS = 1 << 22  # rows of a plain-text corpus up to which it keeps numpy's stored order (32 MiB)


def keeps_stored_order(rows) -> bool:
    """Whether ``rows`` are read in numpy's stored seeded permutation (``StoredPermutation``) rather than
    ``SampleOrder``: rows in memory, and the rows of a plain-text corpus of at most ``STORED_ORDER_ROWS``
    rows (``stored_order``: the order every plain-text run had when its rows were held in memory, so
    such a run resumes onto the same batches; a larger one could not be held and gets the computed order)."""
    return isinstance(rows, np.ndarray) or bool(getattr(rows, "stored_order", False))


def block_rows(seq_len: int, block_kib: int) -> int:
    """Rows per shuffle block: the fewest rows of ``seq_len + 1`` uint16 tokens that fill ``block_kib`` KiB
    (a block is one GET on an object store: at least that many bytes, so at most one GET per
    ``block_kib``). Counted in uint16 whatever the files' dtype, so that the order of a corpus does not
    depend on how its ids are stored (a uint32 corpus's blocks are twice the bytes)."""
    return max(1, -(-(block_kib * 1024) // (2 * (seq_len + 1))))
