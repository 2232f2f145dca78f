"""Deterministic, exactly resumable batch loader over packed sequences.

The data order is a pure function of (seed, global cursor): global sample ``j``
is row ``order_e.rows(j mod n)`` where ``e = j div n`` is the epoch and ``order_e``
a seeded permutation: numpy's, stored, for rows in memory; for rows read where
the corpus lies, the block-and-window bijection of ``raysc.data.order`` (computed,
never stored: O(1) memory at any corpus size). Global batch ``b`` covers samples
``[cursor_b, cursor_b + global_batch)`` and data-parallel rank ``r`` of ``dp``
takes the ``r``-th contiguous slice of it. Resuming needs only the cursor, and
the sequence of global batches does not depend on the number of ranks.

``rows`` is an array of packed rows in memory or a ``RowSource`` (``raysc.data.row_source``)
that reads this rank's rows from the token files where they lie; a batch is one gather.
``build_loader`` wraps a loader over a ``RowSource`` (and every mixture) in a ``Prefetcher``
thread (``data.prefetch`` batches ahead), so reads from disk or an object store overlap the step.
"""

from __future__ import annotations

import numpy as np
import torch

from raysc.config.schema import Config
from raysc.config.syntax import parse_schedule
from raysc.data.order import SampleOrder, StoredPermutation, block_rows, keeps_stored_order

ORDERS_KEPT = 4  # epochs' orders kept per loader: the epochs a batch can straddle, with room for a resume


class BatchLoader:
    def __init__(
        self,
        rows,
        seed: int,
        global_batch: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        block: int = 1,
    ):
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
        self.block = block  # rows per shuffle block (raysc.data.order)
        self.cursor = 0  # global samples consumed so far
        self._orders: dict[int, SampleOrder] = {}  # epoch -> its order, oldest first

    def _order(self, epoch: int):
        """The order of ``epoch``: rows in memory (and a plain-text corpus's, ``keeps_stored_order``) keep the
        seeded numpy permutation of before (the data order every run and test before issue 57 used); a
        ``RowSource`` read where the corpus lies gets the block-and-window bijection (``raysc.data.order``),
        which needs no O(rows) array."""
        order = self._orders.get(epoch)
        if order is None:
            if keeps_stored_order(self.rows):
                order = StoredPermutation(np.random.default_rng([self.seed, epoch]).permutation(len(self.rows)))
            else:
                order = SampleOrder(len(self.rows), self.global_batch, self.block, (self.seed, epoch))
            self._orders[epoch] = order
            while len(self._orders) > ORDERS_KEPT:
                del self._orders[next(iter(self._orders))]
        return order

    def sample_indices(self, start: int, count: int) -> np.ndarray:
        """Row indices of global samples ``start .. start+count-1``."""
        n = len(self.rows)
        j = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(j // n):
            sel = (j // n) == epoch
            out[sel] = self._order(int(epoch)).rows(j[sel] % n)
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
        return {"cursor": self.cursor, "seed": self.seed, "global_batch": self.global_batch, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"loader seed {self.seed} differs from the checkpoint's {state['seed']}")
        self.cursor = int(state["cursor"])


def build_loader(cfg: Config, rows: np.ndarray | dict[str, np.ndarray], dp_rank: int, dp_size: int):
    """The run's loader, prefetching in a thread: ``BatchLoader`` over one source of rows, or, for
    per-domain rows (a ``raysc pack`` source), ``MixtureLoader`` following ``data.schedule`` (empty =
    the domains' natural proportions)."""
    from raysc.data.mixture import MixtureLoader, Prefetcher
    from raysc.data.prepare import natural_schedule

    gb = cfg.train.global_batch_sequences
    block = block_rows(cfg.train.seq_len, cfg.data.shuffle_block_kib)
    for source in rows.values() if isinstance(rows, dict) else [rows]:
        if hasattr(source, "read_unit"):  # a RowSource: a miss on an object store fetches the whole block
            source.read_unit = block
    if not isinstance(rows, dict):
        loader = BatchLoader(rows, cfg.train.seed, gb, dp_rank, dp_size, block)
        # rows in memory, and a plain-text corpus's rows in its local cache (single rows at random, from
        # the page cache: keeps_stored_order), are gathered in the training thread, a batch at a time;
        # rows read from token files where they lie, in a thread ahead
        return loader if keeps_stored_order(rows) else Prefetcher(loader, cfg.data.prefetch)
    schedule = cfg.data.schedule or natural_schedule({k: len(v) for k, v in rows.items()})
    mixture = MixtureLoader(
        rows, parse_schedule(schedule, list(rows)), cfg.train.seed, gb, cfg.train.seq_len, dp_rank, dp_size, block
    )
    return Prefetcher(mixture, cfg.data.prefetch)
