"""Deterministic, exactly resumable batch loader over packed sequences.

The data order is a pure function of (seed, global cursor): global sample ``j``
is row ``perm_e[j mod n]`` where ``e = j div n`` is the epoch and ``perm_e`` a
permutation seeded by ``(seed, e)``. Global batch ``b`` covers samples
``[cursor_b, cursor_b + global_batch)`` and data-parallel rank ``r`` of ``dp``
takes the ``r``-th contiguous slice of it. Resuming needs only the cursor, and
the sequence of global batches does not depend on the number of ranks.

Rows live in memory (a packed corpus is small next to the model), so a batch is
one numpy gather; no prefetch thread is needed at these sizes.
"""

from __future__ import annotations

import numpy as np
import torch

from raysc.config.schema import Config
from raysc.config.syntax import parse_schedule

PERMS_KEPT = 4  # permutations kept per loader: the epochs a batch can straddle, with room for a resume


class BatchLoader:
    def __init__(self, rows: np.ndarray, seed: int, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if len(rows) == 0:
            raise ValueError("no training sequences: the packed corpus is empty")
        self.rows = rows
        self.seed = seed
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cursor = 0  # global samples consumed so far
        self._perms: dict[int, np.ndarray] = {}  # epoch -> permutation, oldest first

    def _perm(self, epoch: int) -> np.ndarray:
        """The seeded permutation of ``epoch``; the newest few kept on this loader (a method-level
        ``lru_cache`` would share one cache among every loader and keep each alive)."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
            while len(self._perms) > PERMS_KEPT:
                del self._perms[next(iter(self._perms))]
        return perm

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Row indices of global samples ``start .. start+count-1``."""
        n = len(self.rows)
        j = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(j // n):
            sel = (j // n) == epoch
            out[sel] = self._perm(int(epoch))[j[sel] % n]
        return out

    def next_batch(self) -> torch.Tensor:
        """This rank's slice of the next global batch as int64 (local_batch, seq_len + 1)."""
        local = self.global_batch // self.dp_size
        idx = self.sample_indices(self.cursor + self.dp_rank * local, local)
        self.cursor += self.global_batch
        return torch.from_numpy(self.rows[idx].astype(np.int64))

    def skip(self, batches: int) -> None:
        self.cursor += batches * self.global_batch

    @property
    def epoch(self) -> int:
        return self.cursor // len(self.rows)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader seed {self.seed} differs from the checkpoint's {state['seed']}")
        self.cursor = int(state["cursor"])


def build_loader(cfg: Config, rows: np.ndarray | dict[str, np.ndarray], dp_rank: int, dp_size: int):
    """The run's loader: ``BatchLoader`` over one array of rows, or, for per-domain rows (a
    ``raysc pack`` source), a prefetching ``MixtureLoader`` following ``data.schedule``
    (empty = the domains' natural proportions)."""
    gb = cfg.train.global_batch_sequences
    if not isinstance(rows, dict):
        return BatchLoader(rows, cfg.train.seed, gb, dp_rank, dp_size)
    from raysc.data.mixture import MixtureLoader, Prefetcher
    from raysc.data.prepare import natural_schedule

    schedule = cfg.data.schedule or natural_schedule({k: len(v) for k, v in rows.items()})
    mixture = MixtureLoader(
        rows, parse_schedule(schedule, list(rows)), cfg.train.seed, gb, cfg.train.seq_len, dp_rank, dp_size
    )
    return Prefetcher(mixture, cfg.data.prefetch)
