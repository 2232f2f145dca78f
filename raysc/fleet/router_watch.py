"""``RouterWatch``: the supervisor's check on a mixture of experts' routing (issue 58).

A router collapses when it sends a layer's tokens to a few experts and starves the rest (torchtitan
#1246: every token of a layer on one expert; routers that balanced at first and drifted), which a loss
curve shows late or never. From each step's ``moe_tokens`` (tokens per expert per layer, summed over
the ranks: ``raysc.train.moe_routing``) the watch keeps the last ``supervisor.router_window`` steps of
each layer, and names a layer as collapsed when, over that whole window,

- some experts got no token at all (``dead``), or
- the busiest expert's load stayed at or above ``supervisor.router_collapse_load`` of the most it can
  be (a layer whose T·k assignments all go to k experts has a max/mean of E/k: the bound is a fraction
  of it, so one value means the same for 8 experts top-2 and 64 top-8).

It says so once per layer (a ``router_collapse`` event naming the layer, the dead and the busiest
experts, their share of the tokens), again only after the layer was healthy for a window, and does what
``supervisor.router_collapse`` asks: ``warn`` (the event alone) or ``stop`` (save and stop, as
``raysc stop`` does). Only full windows count: a run's first steps, when a router has not learned
anything yet, are no verdict. A restart or a peer heal going on from step ``s`` keeps the window's
steps up to ``s`` (``rewind``): the healed run is the same computation, and is judged the same.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np


class RouterWatch:
    def __init__(self, window: int, collapse_load: float, top_k: int) -> None:
        self.window = window
        self.collapse_load = collapse_load
        self.top_k = top_k
        self._seen: dict[str, deque] = {}
        self._flagged: set[str] = set()
        self._lock = threading.Lock()  # steps arrive on the supervisor's report thread, restarts on its run thread

    def rewind(self, step: int) -> None:
        """A fleet that goes on from ``step`` (a restart from its checkpoint, a peer heal): forget the
        steps after it, which will run again; keep those up to it, which were the same steps. So a healed
        run judges the same windows and acts at the same step as the uninterrupted run (a restart that
        forgot the whole window stopped a collapsing run at step 6 instead of 4)."""
        with self._lock:
            for seen in self._seen.values():
                while seen and seen[-1][0] > step:
                    seen.pop()

    def observe(self, step: int, tokens: dict[str, list[int]]) -> list[dict]:
        """One step's tokens per expert per layer; the collapses found (event fields), each once."""
        with self._lock:
            return self._observe(step, tokens)

    def _observe(self, step: int, tokens: dict[str, list[int]]) -> list[dict]:
        found = []
        for layer, counts in tokens.items():
            seen = self._seen.setdefault(layer, deque(maxlen=self.window))
            seen.append((step, np.asarray(counts, dtype=np.float64)))
            if len(seen) < self.window:
                continue
            verdict = self._verdict(np.stack([c for _, c in seen]))
            if verdict is None:
                self._flagged.discard(layer)  # healthy for a whole window: a new collapse is news again
            elif layer not in self._flagged:
                self._flagged.add(layer)
                found.append({"step": step, "layer": int(layer), "window_steps": self.window, **verdict})
        return found

    def _verdict(self, counts: np.ndarray) -> dict | None:
        """What is wrong with a layer over the window (steps × experts), or None."""
        experts = counts.shape[1]
        worst = experts / self.top_k  # max/mean when every assignment goes to k experts
        dead = [int(e) for e in np.flatnonzero(counts.sum(axis=0) == 0)]
        load = counts.max(axis=1) / np.maximum(counts.mean(axis=1), 1e-9)
        if not dead and load.min() < self.collapse_load * worst:
            return None
        total = counts.sum(axis=0)
        busiest = [int(e) for e in np.argsort(-total, kind="stable")[: self.top_k]]
        return {
            "dead_experts": dead,
            "busiest_experts": busiest,
            "busiest_share": round(float(total[busiest].sum() / max(total.sum(), 1.0)), 4),
            "load_max_min": round(float(load.min()), 3),
            "load_max_worst": round(worst, 3),
        }
