"""Loss spike detection, evaluated identically on every rank.

Each step's global loss and global gradient norm (the same numbers on every rank, since both are
all-reduced) go to a ``SpikeDetector``; every rank keeps the same state and so takes the same
decision without talking to the others. The state (plain lists and numbers) is part of the
checkpoint.

A step is flagged when its loss or gradient norm is NaN/Inf, or, once the window holds
``min_history`` accepted losses, when its loss is more than ``sigma`` standard deviations *above*
the mean of that rolling window (one-sided: a falling loss is progress, never a spike). Flagged
losses stay out of the window, so a spike does not widen the band that judges the next one.

The gradient norm alone never flags a finite step; its z-score (in log space: norms move
multiplicatively) is reported as evidence. Measured on clean runs of the shipped configs
(benchmarks/spike_false_alarms.py, docs/resilience.md): healthy training has single-step norm
jumps of 20x while the loss falls, and skipping such a step freezes the weights where the norm is
high, so the next batches are flagged too (the old rule skipped 9 updates in a row in the demo);
clipping already bounds the update.

At most ``patience`` spike-flagged updates in a row are skipped. The weights do not change while
updates are skipped, so a loss that stays high on ``patience`` different batches is not a bad
batch but the run's new level: the next such step is accepted and the window is moved (translated,
keeping its spread) to the level of that run of steps. NaN/Inf are never accepted.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class SpikeDetector:
    def __init__(self, window: int = 128, sigma: float = 6.0, min_history: int = 16, patience: int = 3) -> None:
        self.window, self.sigma, self.min_history, self.patience = window, sigma, min_history, patience
        self.loss: deque[float] = deque(maxlen=window)  # accepted losses
        self.grad_norm: deque[float] = deque(maxlen=window)  # their log gradient norms (evidence only)
        self.run: list[float] = []  # losses of the current run of spike-flagged steps
        self.consecutive = 0  # flagged steps in a row (spikes and NaN/Inf)
        self.last_z = {"loss": 0.0, "grad_norm": 0.0}
        self.shift: dict | None = None  # set when the last check accepted a new level

    @staticmethod
    def _z(history: deque[float], x: float) -> float:
        n = len(history)
        if n < 2:
            return 0.0
        mean = sum(history) / n
        sd = math.sqrt(sum((h - mean) ** 2 for h in history) / (n - 1))
        return (x - mean) / max(sd, 1e-12)

    def check(self, loss: float, grad_norm: float) -> dict | None:
        """None for an accepted step (and remember it); else the evidence that flagged it."""
        self.shift, evidence = None, None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.last_z = {"loss": 0.0, "grad_norm": 0.0}
            evidence = {"reason": "nonfinite", "loss": loss, "grad_norm": grad_norm}
        else:
            log_g = math.log(max(grad_norm, 1e-12))
            self.last_z = {"loss": self._z(self.loss, loss), "grad_norm": self._z(self.grad_norm, log_g)}
            if len(self.loss) >= self.min_history and self.last_z["loss"] > self.sigma:
                if len(self.run) < self.patience:
                    self.run.append(loss)
                    evidence = {
                        "reason": "spike",
                        "loss": loss,
                        "grad_norm": grad_norm,
                        "z_loss": round(self.last_z["loss"], 2),
                        "z_grad_norm": round(self.last_z["grad_norm"], 2),
                        "sigma": self.sigma,
                        "window": len(self.loss),
                    }
                else:  # `patience` batches in a row on unchanged weights: a new level, not a bad batch
                    delta = statistics.median(self.run + [loss]) - sum(self.loss) / len(self.loss)
                    self.loss = deque((v + delta for v in self.loss), maxlen=self.window)
                    self.shift = {"loss": loss, "level_shift": round(delta, 6), "after_skips": len(self.run)}
        if evidence is None:
            self.loss.append(loss)
            self.grad_norm.append(math.log(max(grad_norm, 1e-12)))
            self.consecutive, self.run = 0, []
        else:
            self.consecutive += 1
            evidence["consecutive"] = self.consecutive
        return evidence

    def state_dict(self) -> dict:
        return {
            "loss": list(self.loss),
            "grad_norm": list(self.grad_norm),
            "run": list(self.run),
            "consecutive": self.consecutive,
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss = deque((float(v) for v in state["loss"]), maxlen=self.window)
        self.grad_norm = deque((float(v) for v in state["grad_norm"]), maxlen=self.window)
        self.run = [float(v) for v in state.get("run", [])]
        self.consecutive = int(state["consecutive"])


class SpikeRollback(RuntimeError):
    """Raised by every rank when ``spike_patience`` consecutive steps were flagged (rollback policy)."""

    def __init__(self, step: int, first_step: int, evidence: dict) -> None:
        super().__init__(f"{step - first_step + 1} consecutive flagged steps ({first_step}..{step}): {evidence}")
        self.step, self.first_step, self.evidence = step, first_step, evidence

    def __reduce__(self):
        return (SpikeRollback, (self.step, self.first_step, self.evidence))
