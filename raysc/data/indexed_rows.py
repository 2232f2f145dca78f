"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read where they lie, as row sources.

What a run learns before training is O(1) per dataset: the ``.idx`` header (dtype, sequence and
document counts), its last pointer and length (the token count, checked against the ``.bin`` size), and
the first and last ``SAMPLED`` documents' last tokens, which say how the dataset was made:

- **with** ``--append-eod`` (every sampled document ends with the tokenizer's EOS): the ``.bin`` is the
  token stream as it stands, read as one raw token file (``TokenRows``);
- **without** (none does): ``DocumentRows`` adds one EOS after every document, finding documents from
  the ``.idx`` itself (a binary search over its document indices and pointers, read in place: no
  per-document array is built, whatever the corpus size);
- a dataset whose sampled documents do both is refused; one whose unsampled documents mix is refused
  when a rank reads the document that breaks the rule (in the EOS-adding mode), naming the file.

Ours rather than megatron-core's ``IndexedDataset``: it memory-maps both files locally and its
``GPTDataset`` builds O(samples) index files before the first step (``benchmarks/data_scale.py`` times
that beside us); a run here reads ``s3://`` prefixes too, one ranged read per shuffle block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysc.data.megatron import HEADER_BYTES, IndexedDatasetError, parse_header
from raysc.data.ranged import FileIdentity, RangeReader, identity, is_local
from raysc.data.row_source import Segment, TokenRows
from raysc.data.streamed import in_parallel

SAMPLED = 16  # documents checked at each end for their last token
SAMPLE_BYTES = 64 << 10  # ids of the .bin checked against the vocabulary at start
_INDEX_BLOCK = 1 << 20  # an object store's reads of the .idx: whole MiB blocks, cached


def indexed_prefix(source: str, options: dict | None = None) -> str | None:
    """The dataset prefix of ``source`` (``x``, ``x.bin`` or ``x.idx`` where ``x.idx`` exists, local or any
    fsspec URL); None otherwise."""
    prefix = source[:-4] if source.endswith((".bin", ".idx")) else source
    if is_local(prefix):
        from pathlib import Path

        return prefix if Path(prefix.removeprefix("file://") + ".idx").is_file() else None
    import fsspec

    fs, path = fsspec.core.url_to_fs(prefix, **(options or {}))
    return prefix if fs.isfile(f"{path}.idx") else None


@dataclass(frozen=True)
class IndexedLayout:
    """One dataset's files and the ``.idx`` offsets a reader needs (``idx_*``: byte offsets)."""

    idx: FileIdentity
    bin: FileIdentity
    dtype: str
    sequences: int
    documents: int  # documents (the .idx holds documents + 1 document indices)
    tokens: int  # tokens in the .bin
    idx_pointers: int
    idx_documents: int


def _ints(reader: RangeReader, f: FileIdentity, at: int, count: int, dtype) -> np.ndarray:
    """``count`` ints of ``dtype`` from byte ``at`` of ``f`` (an object store: its MiB block, cached)."""
    size = np.dtype(dtype).itemsize * count
    block = (at // _INDEX_BLOCK * _INDEX_BLOCK, min(f.size, (at + size) // _INDEX_BLOCK * _INDEX_BLOCK + _INDEX_BLOCK))
    return np.frombuffer(reader.read(f, at, at + size, block), dtype=dtype)


def indexed_layout(reader: RangeReader, prefix: str, options: dict | None = None) -> IndexedLayout:
    """The layout of ``PREFIX.idx``/``.bin`` from the index's header and last entries; a damaged or
    truncated pair is refused naming the file (``IndexedDatasetError``)."""
    idx, bin_ = identity(prefix + ".idx", options), identity(prefix + ".bin", options)
    dtype, n_seq, n_doc = parse_header(reader.read(idx, 0, min(idx.size, HEADER_BYTES)), idx.url)
    need = HEADER_BYTES + n_seq * 12 + n_doc * 8
    if idx.size < need or n_doc < 1:
        raise IndexedDatasetError(
            f"{idx.url} is truncated: {idx.size} bytes for {n_seq} sequences and {n_doc} document indices "
            f"({need} needed)"
        )
    at_pointers = HEADER_BYTES + 4 * n_seq
    tokens = 0
    if n_seq:
        last_len = int(_ints(reader, idx, HEADER_BYTES + 4 * (n_seq - 1), 1, np.int32)[0])
        last_ptr = int(_ints(reader, idx, at_pointers + 8 * (n_seq - 1), 1, np.int64)[0])
        tokens = last_ptr // dtype.itemsize + last_len
    if bin_.size < tokens * dtype.itemsize:
        raise IndexedDatasetError(
            f"{bin_.url} is truncated: {bin_.size // dtype.itemsize} tokens, its index needs {tokens}"
        )
    return IndexedLayout(idx, bin_, dtype.str, n_seq, n_doc - 1, tokens, at_pointers, at_pointers + 8 * n_seq)


class _Index:
    """Documents' token offsets in a ``.bin`` read from its ``.idx`` in place: ``start(d)`` is document
    ``d``'s first token (sequences stored back to back, as Megatron's writer stores them)."""

    def __init__(self, layout: IndexedLayout, reader: RangeReader) -> None:
        self.layout, self.reader = layout, reader
        self.itemsize = np.dtype(layout.dtype).itemsize
        self._memo: dict[int, int] = {}

    def start(self, d: int) -> int:
        got = self._memo.get(d)
        if got is not None:
            return got
        lay = self.layout
        seq = int(_ints(self.reader, lay.idx, lay.idx_documents + 8 * d, 1, np.int64)[0])
        if seq >= lay.sequences:
            got = lay.tokens
        else:
            got = int(_ints(self.reader, lay.idx, lay.idx_pointers + 8 * seq, 1, np.int64)[0]) // self.itemsize
        if len(self._memo) > 1 << 16:
            self._memo.clear()
        self._memo[d] = got
        return got

    def last_token(self, d: int) -> int | None:
        """Document ``d``'s last token id; None for an empty one."""
        a, b = self.start(d), self.start(d + 1)
        if b <= a:
            return None
        lay = self.layout
        return int(np.frombuffer(self.reader.read(lay.bin, (b - 1) * self.itemsize, b * self.itemsize), lay.dtype)[0])


def appends_eod(layout: IndexedLayout, reader: RangeReader, eos: int) -> bool:
    """Whether the dataset was made with ``--append-eod``, from its first and last ``SAMPLED`` documents."""
    index = _Index(layout, reader)
    docs = sorted(
        set(range(min(SAMPLED, layout.documents))) | set(range(max(0, layout.documents - SAMPLED), layout.documents))
    )
    ends = [index.last_token(d) for d in docs]
    ends = [t for t in ends if t is not None]
    with_eos = sum(t == eos for t in ends)
    if with_eos and with_eos < len(ends):
        raise IndexedDatasetError(
            f"{layout.bin.url} mixes documents that end with the end-of-document token (id {eos}) and documents "
            f"that do not: re-run Megatron's preprocess_data.py with --append-eod (or without) for all of them"
        )
    return bool(ends) and with_eos == len(ends)


class DocumentRows(TokenRows):
    """Rows of a dataset made without ``--append-eod``: its documents in order, one EOS after each (the
    stream ``raysc.data.packing`` cuts a tokenized corpus from), read where the files lie."""

    def __init__(self, layout: IndexedLayout, eos: int, seq_len: int, options: dict | None = None) -> None:
        self.layout, self.eos = layout, eos
        total = layout.tokens + layout.documents
        if (total - 1) // seq_len < 1:
            raise ValueError(
                f"{layout.bin.url} holds {total} tokens with its end-of-document tokens, too few for one sequence "
                f"of train.seq_len={seq_len}; add data or shorten train.seq_len"
            )
        super().__init__([Segment(layout.bin, 0, total, layout.dtype)], seq_len, options)

    def _index(self) -> _Index:
        index = self.__dict__.get("_idx")
        if index is None or index.reader is not self.reader:
            index = self.__dict__["_idx"] = _Index(self.layout, self.reader)
        return index

    def __getstate__(self) -> dict:
        return {k: v for k, v in super().__getstate__().items() if k != "_idx"}

    def files(self) -> list[FileIdentity]:
        return [self.layout.bin, self.layout.idx]  # documents are found from the .idx: it is part of the corpus

    def _doc_at(self, v: int) -> int:
        """The document whose tokens or EOS hold stream position ``v`` (its stream start: ``start(d) + d``)."""
        index, lo, hi = self._index(), 0, self.layout.documents - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if index.start(mid) + mid <= v:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _stored(self, v: int) -> int:
        """The stored token at stream position ``v`` (the next one when ``v`` is an added EOS)."""
        return v - self._doc_at(v)

    def _tokens(self, lo: int, hi: int, unit: tuple[int, int] | None = None) -> np.ndarray:
        index, d = self._index(), self._doc_at(lo)
        eos_at, empty = [], []  # stream positions of the EOS tokens in [lo, hi); whether their document is empty
        k = d
        while k < self.layout.documents:
            end = index.start(k + 1) + k  # this document's EOS
            if end >= hi:
                break
            if end >= lo:
                eos_at.append(end)
                empty.append(index.start(k + 1) == index.start(k))
            k += 1
        first = lo - d  # the stored token at stream position lo (or the next one, when lo is an EOS)
        stored = (hi - lo) - len(eos_at)
        itemsize = np.dtype(self.layout.dtype).itemsize
        span = None
        if unit is not None:  # the read unit's stored tokens (its EOS tokens are not in the file)
            u0, u1 = unit
            span = (self._stored(u0) * itemsize, min(self.layout.bin.size, (self._stored(u1 - 1) + 1) * itemsize))
        blob = self.reader.read(self.layout.bin, first * itemsize, (first + stored) * itemsize, span)
        ids = np.frombuffer(blob, dtype=self.layout.dtype).astype(self.dtype)
        places = np.asarray(eos_at, dtype=np.int64) - lo - np.arange(len(eos_at))
        out = np.insert(ids, places, self.eos)
        for pos, blank in zip(eos_at, empty):
            if not blank and pos > lo and out[pos - 1 - lo] == self.eos:
                raise IndexedDatasetError(
                    f"{self.layout.bin.url} mixes documents with and without the end-of-document token (id "
                    f"{self.eos}; one ends at token {self._stored(pos)}): re-run Megatron's preprocess_data.py "
                    f"with --append-eod (or without) for all of them"
                )
        return out


def indexed_rows(
    prefixes: list[str], seq_len: int, eos: int, vocab_size: int, options: dict | None = None
) -> tuple[TokenRows, int]:
    """Rows of the Megatron datasets ``prefixes`` (their documents in order, joined; one EOS after each
    where a dataset was made without ``--append-eod``, which only one dataset alone may be) and their
    document count."""
    reader = RangeReader(dict(options or {}))
    layouts = in_parallel(lambda p: indexed_layout(reader, p, options), prefixes)
    for lay in layouts:
        n = min(lay.tokens * np.dtype(lay.dtype).itemsize, SAMPLE_BYTES)
        head = np.frombuffer(reader.read(lay.bin, 0, n), dtype=lay.dtype)
        if len(head) and int(head.max()) >= vocab_size:
            raise IndexedDatasetError(
                f"{lay.bin.url} holds token id {int(head.max())} but model.vocab_size is {vocab_size}: it was made "
                f"with another tokenizer than the run's"
            )
    appended = [appends_eod(lay, reader, eos) for lay in layouts]
    documents = sum(lay.documents for lay in layouts)
    if all(appended):
        rows = TokenRows([Segment(lay.bin, 0, lay.tokens, lay.dtype) for lay in layouts], seq_len, options)
    elif len(layouts) == 1:
        rows = DocumentRows(layouts[0], eos, seq_len, options)
    else:
        raise IndexedDatasetError(
            f"{layouts[appended.index(False)].bin.url} was made without --append-eod; a domain of several Megatron "
            f"datasets reads only datasets whose documents end with the end-of-document token (id {eos})"
        )
    rows.vocab_size = vocab_size
    return rows, documents
