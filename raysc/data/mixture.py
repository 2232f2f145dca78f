"""A domain mixture that follows a schedule exactly and resumes exactly at any data-parallel size.

``data.schedule`` is piecewise constant in consumed tokens, e.g.
``"0:prose=0.7,code=0.3; 2000000:prose=0.3,code=0.7"`` (weights are normalised per phase;
``raysc.config.syntax.parse_schedule`` reads it).

The stream is a sequence of global samples. Sample ``g`` goes to the domain furthest below
its target within the current phase (target = weight × samples of the phase so far, ties by
domain name): no randomness, so every prefix of a phase meets the weights to within one
sample. Inside a domain rows come in a seeded order (seed, domain, epoch: the block-and-window
bijection of ``raysc.data.order``, computed, never stored); a domain that runs out starts its next
epoch in a new order (``epochs`` counts them). A batch's rows are read domain by domain, each one
gather (from memory, or from the token files where they lie: ``raysc.data.row_source``).

The position is one global cursor plus the per-domain counters (``state_dict``). Every
data-parallel rank computes the same assignments for a whole global batch and reads only its
slice, so the global sequence of batches is the same whatever the dp size, and resuming from a
state reproduces it (tested 2 → 4 → 1). ``Prefetcher`` prepares batches of either loader in a
thread, and measures how long the step waited for them (``wait_s``).
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import torch

from raysc.config.syntax import Phase
from raysc.data.order import SampleOrder, StoredPermutation


class MixtureLoader:
    def __init__(
        self,
        domains: dict[str, np.ndarray],
        schedule: list[Phase],
        seed: int,
        global_batch: int,
        tokens_per_sample: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        block: int = 1,
    ) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp size {dp_size}")
        empty = [d for d in domains if len(domains[d]) == 0]
        if empty:
            raise ValueError(f"domain(s) {empty} have no sequences")
        self.rows = domains
        self.names = sorted(domains)
        self.schedule = schedule
        for p in schedule:
            missing = sorted(set(p.weights) - set(self.names))
            if missing:
                raise ValueError(f"schedule names domain(s) {missing} the data does not have")
        self.seed = seed
        self.global_batch = global_batch
        self.tokens_per_sample = tokens_per_sample
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cursor = 0  # global samples consumed
        self.phase = 0
        self.phase_start = 0  # cursor where the current phase began
        self.phase_counts = {d: 0 for d in self.names}
        self.epochs = {d: 0 for d in self.names}
        self.positions = {d: 0 for d in self.names}
        self.block = block  # rows per shuffle block (raysc.data.order)
        self._orders: dict[tuple[str, int], SampleOrder] = {}

    # ---- the deterministic stream ----
    def _order(self, domain: str, epoch: int):
        key = (domain, epoch)
        if key not in self._orders:
            salt = self.names.index(domain)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != domain}  # one epoch per domain
            rows, n = self.rows[domain], len(self.rows[domain])
            if isinstance(rows, np.ndarray):  # rows in memory: numpy's stored permutation, as before issue 57
                self._orders[key] = StoredPermutation(np.random.default_rng([self.seed, salt, epoch]).permutation(n))
            else:
                self._orders[key] = SampleOrder(n, self.global_batch, self.block, (self.seed, salt, epoch))
        return self._orders[key]

    def _advance(self) -> tuple[str, int, int]:
        """Domain, epoch and position in that epoch's order of the next global sample; advances the state."""
        tokens = self.cursor * self.tokens_per_sample
        while self.phase + 1 < len(self.schedule) and tokens >= self.schedule[self.phase + 1].start_tokens:
            self.phase += 1
            self.phase_start = self.cursor
            self.phase_counts = {d: 0 for d in self.names}
        weights = self.schedule[self.phase].weights
        n = self.cursor - self.phase_start + 1
        domain = max(weights, key=lambda d: (weights[d] * n - self.phase_counts[d], -self.names.index(d)))
        self.phase_counts[domain] += 1
        pos, epoch = self.positions[domain], self.epochs[domain]
        if pos + 1 == len(self.rows[domain]):
            self.epochs[domain] += 1
            self.positions[domain] = 0
        else:
            self.positions[domain] = pos + 1
        self.cursor += 1
        return domain, epoch, pos

    def _next_sample(self) -> tuple[str, int]:
        """Domain and row of the next global sample; advances the state."""
        domain, epoch, pos = self._advance()
        return domain, int(self._order(domain, epoch).rows(np.asarray([pos]))[0])

    def next_assignments(self) -> list[tuple[str, int]]:
        """(domain, row) of every sample of the next global batch (the same on every rank): the domains
        chosen one by one, then each (domain, epoch)'s rows mapped in one call of its order."""
        picks = [self._advance() for _ in range(self.global_batch)]
        groups: dict[tuple[str, int], list[int]] = {}
        for i, (domain, epoch, _) in enumerate(picks):
            groups.setdefault((domain, epoch), []).append(i)
        out: list[tuple[str, int]] = [("", 0)] * len(picks)
        for (domain, epoch), at in sorted(groups.items(), key=lambda g: g[1][0]):
            rows = self._order(domain, epoch).rows(np.asarray([picks[i][2] for i in at]))
            for i, row in zip(at, rows.tolist()):
                out[i] = (domain, row)
        return out

    def next_batch(self) -> torch.Tensor:
        """This rank's slice of the next global batch, as int64 (batch/dp, tokens_per_sample + 1)."""
        picks = self.next_assignments()
        per = self.global_batch // self.dp_size
        mine = picks[self.dp_rank * per : (self.dp_rank + 1) * per]
        out = np.empty((len(mine), self.tokens_per_sample + 1), dtype=np.int64)
        for domain in sorted({d for d, _ in mine}):  # one gather per domain
            at = [i for i, (d, _) in enumerate(mine) if d == domain]
            out[at] = self.rows[domain][np.asarray([mine[i][1] for i in at])]
        return torch.from_numpy(out)

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            self.next_assignments()

    @property
    def epoch(self) -> int:
        """Completed passes over the most-repeated domain (per domain: ``epochs``)."""
        return max(self.epochs.values())

    # ---- state (goes into the checkpoint) ----
    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor,
            "phase": self.phase,
            "phase_start": self.phase_start,
            "phase_counts": dict(self.phase_counts),
            "epochs": dict(self.epochs),
            "positions": dict(self.positions),
            "seed": self.seed,
            "domains": self.names,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["domains"] != self.names or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for domains {state['domains']} / seed {state['seed']}; this run "
                f"has {self.names} / seed {self.seed}"
            )
        self.cursor, self.phase, self.phase_start = state["cursor"], state["phase"], state["phase_start"]
        self.phase_counts = dict(state["phase_counts"])
        self.epochs = dict(state["epochs"])
        self.positions = dict(state["positions"])


class Prefetcher:
    """Prepares the next ``depth`` batches of a loader in a thread. ``state_dict`` is the state
    after the last batch handed out (not the prefetched ones); ``skip`` and ``load_state_dict``
    drop what was prefetched."""

    def __init__(self, loader, depth: int = 4) -> None:
        self.loader = loader
        self.depth = depth
        self._consumed_state = loader.state_dict()
        self.wait_s = 0.0  # how long the last next_batch waited for its batch (the step's data wait)
        self._start()

    def _start(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self.loader.next_batch(), self.loader.state_dict())
            except Exception as e:  # noqa: BLE001 (a read that failed: raised in the training thread)
                item = (e, None)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is None:
                return  # the error waits in the queue for the training thread

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join()

    def next_batch(self) -> torch.Tensor:
        t0 = time.perf_counter()
        batch, state = self._queue.get()
        self.wait_s = time.perf_counter() - t0
        if isinstance(batch, Exception):
            raise batch
        self._consumed_state = state
        return batch

    def state_dict(self) -> dict:
        return dict(self._consumed_state)

    @property
    def cursor(self) -> int:
        """Global samples handed out (prefetched ones not counted)."""
        return int(self._consumed_state["cursor"])

    @property
    def epochs(self) -> dict[str, int] | None:
        """Per-domain passes (a mixture), None for a single source."""
        epochs = self._consumed_state.get("epochs")
        return None if epochs is None else dict(epochs)

    @property
    def epoch(self) -> int:
        epochs = self._consumed_state.get("epochs")
        return max(epochs.values()) if epochs is not None else int(self._consumed_state["epoch"])

    def load_state_dict(self, state: dict) -> None:
        self._halt()
        self.loader.load_state_dict(state)
        self._consumed_state = self.loader.state_dict()
        self._start()

    def skip(self, batches: int) -> None:
        self._halt()
        self.loader.load_state_dict(self._consumed_state)
        self.loader.skip(batches)
        self._consumed_state = self.loader.state_dict()
        self._start()

    def close(self) -> None:
        self._halt()
