"""Tokenize and pack a corpus into fixed-length training sequences.

Documents are encoded with the run's tokenizer, each followed by the tokenizer's end-of-text
token (and preceded by its begin-of-text token when the tokenizer adds one: Llama 2 and 3,
Mistral; ``raysc.data.special_tokens``), concatenated in corpus order and cut into rows of
``seq_len + 1`` tokens (inputs are ``row[:-1]``, targets ``row[1:]``); consecutive rows share one boundary token
so no token is lost as a target. Every ``round(1/val_fraction)``-th row is held
out for validation, which spreads the held-out set over every domain.

A plain-text corpus is encoded by Ray tasks into token files (``raysc.data.text_cache``) that are cut
into rows as they are read; ``pack_tokens`` and ``split_rows`` are the in-memory definitions of those
rows (``raysc.data.row_source`` computes the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from raysc.data.special_tokens import RAYSC, SpecialTokens


@dataclass
class PackedData:
    """Packed token rows (n, seq_len + 1) split into train and validation rows; ``train`` is
    ``{domain: rows}`` when the data comes per domain for the mixture loader."""

    train: np.ndarray | dict[str, np.ndarray]
    val: np.ndarray
    info: dict

    @property
    def seq_len(self) -> int:
        return self.val.shape[1] - 1


def pack_tokens(stream: np.ndarray, seq_len: int) -> np.ndarray:
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"the corpus has {len(stream)} tokens, too few for one sequence of train.seq_len={seq_len}; "
            f"add data or shorten train.seq_len"
        )
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def encode_corpus(texts: list[str], tok: Tokenizer, vocab_size: int, special: SpecialTokens = RAYSC) -> np.ndarray:
    """The documents' tokens, each document as ``[BOS] ids EOS`` (BOS when ``special.add_bos``), joined.
    The tokenizer's own post-processor is not run (``add_special_tokens=False``): BOS and EOS are added
    here, once each, whatever the tokenizer's template would add."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    head = np.asarray([special.bos_id] if special.add_bos else [], dtype=dtype)
    tail = np.asarray([special.eos_id], dtype=dtype)
    pieces = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids = enc.ids
        # a document whose text already begins with BOS or ends with EOS keeps one of each, never two
        start = 1 if special.add_bos and ids[:1] == [special.bos_id] else 0
        stop = len(ids) - 1 if len(ids) > start and ids[-1] == special.eos_id else len(ids)
        pieces += [head, np.asarray(ids[start:stop], dtype=dtype), tail]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def val_every(val_fraction: float) -> int:
    """Every how many rows one is held out for validation (``split_rows``)."""
    return max(2, round(1 / val_fraction))


def split_rows(rows: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): every ``val_every``-th row, counted from the start, is held out."""
    if val_fraction <= 0 or len(rows) < 2:
        return rows, rows[:0]
    every = val_every(val_fraction)
    mask = (np.arange(len(rows)) % every) == every - 1
    return rows[~mask], rows[mask]
