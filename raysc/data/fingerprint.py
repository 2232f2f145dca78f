"""A fingerprint of the rows a step trains on that does not depend on how the batch was split.

Each row (tokens, as the loader returns them) maps to a weighted sum of its tokens modulo the prime
2^31-1 (weights below 2^20, so the int64 sums are exact for rows up to 2^23 tokens of ids below 2^20);
a set of rows maps to the sum of its rows' values modulo the same prime. Sums compose: the data-parallel
ranks' fingerprints, all-reduced and taken modulo the prime, are the fingerprint of the global batch,
whatever the data-parallel size. Two steps with the same rows (in any order within the step, which a
step's mean gradient does not see) have the same fingerprint; other rows differ with probability about
2^-31. It is what shows that an elastic run trained on the run's own sample sequence at every size.
"""

from __future__ import annotations

import torch

PRIME = 2**31 - 1
_WEIGHT_MOD = 2**20 - 3


def row_weights(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed per-position weights (1 .. 2^20-3), the same on every rank and in every run."""
    pos = torch.arange(length, dtype=torch.int64, device=device)
    return (pos * 2654435761 + 40503) % _WEIGHT_MOD + 1


def rows_fingerprint(rows: torch.Tensor) -> int:
    """The fingerprint (0 .. PRIME-1) of the int64 rows ``(n, length)``."""
    if rows.numel() == 0:
        return 0
    per_row = (rows.to(torch.int64) * row_weights(rows.shape[1], rows.device)).sum(dim=1) % PRIME
    return int(per_row.sum().item() % PRIME)
