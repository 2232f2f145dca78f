"""Calibration tokens for quantization: rows of the run's own training split, drawn with a seed,
never the validation split (which is what quality is measured on), and their SHA-256.

The rows come from ``raysc.data.prepare.prepare_data`` with the run's config, so they are the rows
it trained on: the bundled corpus or a plain corpus packed with the run's tokenizer, or a ``raysc
pack`` directory (its domains in name order). ``heldout_rows`` gives the validation rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from raysc.data.packing import PackedData


@dataclass
class Calibration:
    tokens: torch.Tensor  # (rows, seq_len) int64: model inputs
    sha256: str  # of the rows' token ids (int64, little-endian) and their shape
    seed: int
    rows: list[int]  # indices into the training rows

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())


def train_rows(packed: PackedData) -> np.ndarray:
    """The training split as one array (per-domain rows concatenated in domain-name order)."""
    if isinstance(packed.train, dict):
        return np.concatenate([packed.train[k] for k in sorted(packed.train)])
    return packed.train


def calibration(packed: PackedData, n_tokens: int, seed: int) -> Calibration:
    """``ceil(n_tokens / seq_len)`` training rows drawn without replacement with ``seed``; each row's
    first ``seq_len`` tokens."""
    rows = train_rows(packed)
    seq = packed.seq_len
    want = max(1, -(-n_tokens // seq))
    if want > len(rows):
        raise ValueError(
            f"--calib-tokens {n_tokens} needs {want} rows of {seq} tokens but the training split "
            f"has {len(rows)}; pass --calib-tokens {len(rows) * seq} or less"
        )
    idx = np.sort(np.random.default_rng(seed).choice(len(rows), size=want, replace=False))
    tokens = torch.from_numpy(rows[idx, :seq].astype(np.int64))
    return Calibration(tokens, tokens_sha256(tokens), seed, [int(i) for i in idx])


def heldout_rows(packed: PackedData, max_rows: int) -> torch.Tensor:
    """Up to ``max_rows`` validation rows (seq_len + 1 tokens each), from the start of the split."""
    if len(packed.val) == 0:
        raise ValueError(
            "the run's data has no validation rows (data.val_fraction = 0): quality cannot be "
            "measured on held-out text; set data.val_fraction > 0"
        )
    return torch.from_numpy(packed.val[:max_rows].astype(np.int64))


def tokens_sha256(tokens: torch.Tensor) -> str:
    h = hashlib.sha256(str(tuple(tokens.shape)).encode())
    h.update(tokens.to(torch.int64).numpy().astype("<i8").tobytes())
    return h.hexdigest()
