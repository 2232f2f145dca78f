"""Training rows read where the corpus lies: descriptors of token files that each rank reads itself.

A ``RowSource`` looks to the loaders like the array of packed rows it stands for (``len``, indexing by
an int, a slice or an array of row numbers, rows of ``seq_len + 1`` tokens in the stored dtype), but
holds only what describes the files: URLs, byte offsets, token counts, sizes and version tags, O(files).
It pickles as that description (a few KB through Ray's object store, whatever the corpus size) and
each process opens its own ``RangeReader`` on first use.

- ``TokenRows``: rows cut from a token stream, the files' tokens joined in order (OLMo / Dolma ``.npy``
  token files, numpy's format or raw memmaps): row ``i`` is tokens ``i·L .. i·L + L`` (``L`` =
  ``seq_len``), consecutive rows sharing one boundary token, as ``raysc.data.packing.pack_tokens`` cuts
  a stream in memory;
- ``ShardRows``: rows stored as they are trained on, ``(n, L + 1)`` arrays in ``.npy`` shards
  (``raysc pack``'s output, the packed cache of a plain-text corpus);
- ``SplitRows``: the training or the held-out rows of a source, every ``k``-th row held out
  (``raysc.data.packing.split_rows``), computed rather than copied;
- ``ConcatRows``: several sources one after another (the held-out rows of every domain).

Rows past the model's vocabulary are another tokenizer's: refused, naming the file that holds them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from raysc.data.ranged import DataSourceError, FileIdentity, RangeReader


class RowSource:
    """The part every source shares: indexing, dtype checks, the per-process reader."""

    seq_len: int
    dtype: np.dtype
    vocab_size: int | None = None
    read_unit: int = 0  # rows per read unit (the loader's shuffle block): an object store's GET covers one
    stored_order: bool = False  # read in numpy's stored permutation (raysc.data.order.keeps_stored_order)

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self), self.seq_len + 1)

    @property
    def row_bytes(self) -> int:
        return (self.seq_len + 1) * np.dtype(self.dtype).itemsize

    def __getitem__(self, key):
        if isinstance(key, tuple):  # rows, then columns of them (rows[idx, :seq], as on an array)
            first, *rest = key
            return self[first][
                tuple(rest) if np.ndim(first) == 0 and not isinstance(first, slice) else (slice(None), *rest)
            ]
        if isinstance(key, slice):
            return self.take(np.arange(*key.indices(len(self))))
        if np.ndim(key) == 0:
            return self.take(np.asarray([int(key)]))[0]
        return self.take(np.asarray(key, dtype=np.int64))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self.take(np.arange(len(self)))
        return rows if dtype is None else rows.astype(dtype)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (any order, repeats allowed) as one ``(k, seq_len + 1)`` array."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows outside [0, {len(self)})")
        unique, back = np.unique(rows, return_inverse=True)
        out = np.empty((len(unique), self.seq_len + 1), dtype=self.dtype)
        self._read_sorted(unique, out)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            bad = int(unique[np.flatnonzero((out >= self.vocab_size).any(axis=1))[0]])
            raise DataSourceError(
                f"{self.file_of(bad)} holds token id {int(out.max())} but model.vocab_size is {self.vocab_size}: it "
                f"was made with another tokenizer than the run's (or is not {np.dtype(self.dtype)}: data.token_dtype)"
            )
        return out[back]

    def _read_sorted(self, rows: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def file_of(self, row: int) -> str:
        raise NotImplementedError

    def files(self) -> list[FileIdentity]:
        raise NotImplementedError

    @property
    def reader(self) -> RangeReader:
        reader = self.__dict__.get("_reader")
        if reader is None:
            reader = self.__dict__["_reader"] = RangeReader(dict(self.options))
        return reader

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_reader"}  # each process reads for itself

    def __repr__(self) -> str:  # never the storage options (they may hold credentials)
        return f"{type(self).__name__}({len(self)} rows of {self.seq_len + 1} {np.dtype(self.dtype)} tokens)"


@dataclass(frozen=True)
class Segment:
    """One file's part: ``tokens`` ids (``ShardRows``: rows) of ``dtype`` from byte ``offset`` (after a
    numpy header)."""

    file: FileIdentity
    offset: int
    tokens: int
    dtype: str


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Sorted unique rows as (first index, end index) runs of consecutive row numbers."""
    if not len(rows):
        return []
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [len(rows)]])
    return list(zip(starts.tolist(), ends.tolist()))


def _byte(seg: Segment, base: int, token: int) -> int:
    """The byte in ``seg``'s file of stream token ``token`` (clamped to the file; ``base``: its first)."""
    return seg.offset + (min(max(token, base), base + seg.tokens) - base) * np.dtype(seg.dtype).itemsize


class TokenRows(RowSource):
    """Rows cut from the token stream of ``segments`` joined in order (module docstring)."""

    def __init__(self, segments: list[Segment], seq_len: int, options: dict | None = None) -> None:
        self.segments = list(segments)
        self.dtype = max((np.dtype(s.dtype) for s in self.segments), key=lambda d: d.itemsize)  # files may differ
        self.seq_len = seq_len
        self.options = dict(options or {})
        self.starts = np.cumsum([0] + [s.tokens for s in self.segments]).tolist()  # token offset of each file
        total = self.starts[-1]
        self.n = max(0, (total - 1) // seq_len)
        if self.n < 1:
            raise ValueError(
                f"the token files hold {total} tokens, too few for one sequence of train.seq_len={seq_len}; "
                f"add data or shorten train.seq_len"
            )

    def __len__(self) -> int:
        return self.n

    def _read_sorted(self, rows: np.ndarray, out: np.ndarray) -> None:
        L, u = self.seq_len, self.read_unit
        for a, b in _runs(rows):
            first, last = int(rows[a]), int(rows[b - 1])
            unit = (first // u * u * L, min(self.starts[-1], ((last // u + 1) * u) * L + 1)) if u else None
            tokens = self._tokens(first * L, last * L + L + 1, unit)
            count = last - first + 1
            view = np.lib.stride_tricks.as_strided(
                tokens, shape=(count, L + 1), strides=(L * tokens.itemsize, tokens.itemsize), writeable=False
            )
            out[a:b] = view

    def _tokens(self, lo: int, hi: int, unit: tuple[int, int] | None = None) -> np.ndarray:
        """Stream tokens ``[lo, hi)``, read from the files that hold them (``unit``: the stream tokens of the
        read unit around them)."""
        parts = []
        k = bisect.bisect_right(self.starts, lo) - 1
        while lo < hi:
            seg, base = self.segments[k], self.starts[k]
            end = min(hi, base + seg.tokens)
            span = (_byte(seg, base, unit[0]), _byte(seg, base, unit[1])) if unit else None
            blob = self.reader.read(seg.file, _byte(seg, base, lo), _byte(seg, base, end), span)
            parts.append(np.frombuffer(blob, dtype=seg.dtype).astype(self.dtype))
            lo, k = end, k + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def file_of(self, row: int) -> str:
        k = bisect.bisect_right(self.starts, row * self.seq_len) - 1
        return self.segments[k].file.url

    def files(self) -> list[FileIdentity]:
        return [s.file for s in self.segments]


class ShardRows(RowSource):
    """Rows stored ``(n, seq_len + 1)`` in ``.npy`` shards (``segments``' ``tokens`` count rows here)."""

    def __init__(self, segments: list[Segment], seq_len: int, options: dict | None = None) -> None:
        self.segments = list(segments)
        self.dtype = np.dtype(self.segments[0].dtype)
        if any(np.dtype(s.dtype) != self.dtype for s in self.segments):
            raise ValueError(f"shards of {sorted({s.dtype for s in self.segments})} rows in one domain")
        self.seq_len = seq_len
        self.options = dict(options or {})
        self.starts = np.cumsum([0] + [s.tokens for s in self.segments]).tolist()  # first row of each shard

    def __len__(self) -> int:
        return self.starts[-1]

    def _read_sorted(self, rows: np.ndarray, out: np.ndarray) -> None:
        width = self.row_bytes
        for a, b in _runs(rows):
            while a < b:
                first = int(rows[a])
                k = bisect.bisect_right(self.starts, first) - 1
                seg, base = self.segments[k], self.starts[k]
                stop = min(b, a + (base + seg.tokens - first))  # this shard's part of the run
                lo = seg.offset + (first - base) * width
                u = self.read_unit
                unit = None
                if u:  # the read unit's rows inside this shard
                    r0, r1 = max(base, first // u * u), min(base + seg.tokens, (int(rows[stop - 1]) // u + 1) * u)
                    unit = (seg.offset + (r0 - base) * width, seg.offset + (r1 - base) * width)
                blob = self.reader.read(seg.file, lo, lo + (stop - a) * width, unit)
                out[a:stop] = np.frombuffer(blob, dtype=self.dtype).reshape(stop - a, self.seq_len + 1)
                a = stop

    def file_of(self, row: int) -> str:
        return self.segments[bisect.bisect_right(self.starts, row) - 1].file.url

    def files(self) -> list[FileIdentity]:
        return [s.file for s in self.segments]


class SplitRows(RowSource):
    """The training rows (``held=False``) or the held-out rows (``held=True``) of ``source``: every
    ``every``-th row, counted from the start, held out; ``every`` = 0 holds out nothing."""

    def __init__(self, source: RowSource, every: int, held: bool) -> None:
        self.source, self.every, self.held = source, every, held
        n = len(source)
        held_n = n // every if every else 0
        self.n = held_n if held else n - held_n

    @property
    def seq_len(self) -> int:  # type: ignore[override]
        return self.source.seq_len

    @property
    def dtype(self):  # type: ignore[override]
        return self.source.dtype

    @property
    def vocab_size(self):  # type: ignore[override]
        return self.source.vocab_size

    @property
    def stored_order(self) -> bool:  # type: ignore[override]
        return self.source.stored_order

    @property
    def read_unit(self) -> int:  # type: ignore[override]
        return self.source.read_unit

    @read_unit.setter
    def read_unit(self, rows: int) -> None:
        self.source.read_unit = rows  # (the training rows' unit, near enough the source's)

    def __len__(self) -> int:
        return self.n

    def _underlying(self, rows: np.ndarray) -> np.ndarray:
        e = self.every
        if not e:
            return rows
        return rows * e + e - 1 if self.held else rows + rows // (e - 1)

    def take(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows outside [0, {len(self)})")
        return self.source.take(self._underlying(rows))

    def file_of(self, row: int) -> str:
        return self.source.file_of(int(self._underlying(np.asarray([row]))[0]))

    def files(self) -> list[FileIdentity]:
        return self.source.files()

    @property
    def reader(self) -> RangeReader:
        return self.source.reader


class ConcatRows(RowSource):
    """``sources`` one after another (all of one ``seq_len`` and dtype)."""

    def __init__(self, sources: list[RowSource]) -> None:
        self.sources = [s for s in sources if len(s)]
        self.starts = np.cumsum([0] + [len(s) for s in self.sources]).tolist()
        self.seq_len = sources[0].seq_len if sources else 0
        self.dtype = sources[0].dtype if sources else np.dtype(np.uint16)

    def __len__(self) -> int:
        return self.starts[-1]

    def take(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.seq_len + 1), dtype=self.dtype)
        which = np.searchsorted(self.starts, rows, side="right") - 1
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.sources[k].take(rows[sel] - self.starts[k])
        return out

    def file_of(self, row: int) -> str:
        k = bisect.bisect_right(self.starts, row) - 1
        return self.sources[k].file_of(row - self.starts[k])

    def files(self) -> list[FileIdentity]:
        return [f for s in self.sources for f in s.files()]
