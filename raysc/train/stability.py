"""Loss and gradient-norm spike detection, evaluated identically on every rank.

Each step's global loss and global gradient norm (the same numbers on every rank,
since both are all-reduced) are compared with a rolling window of recent accepted
steps: a value with |z| > ``sigma`` (z against the window's mean and standard
deviation) or any NaN/Inf flags the step. Because every rank sees the same inputs
and keeps the same state, every rank takes the same decision without talking to
the others. The state is part of the checkpoint.

The gradient norm is judged in log space: norms fluctuate multiplicatively (a
healthy tiny run swings 0.6 → 3.5 within a few steps, z = 9 on the raw values but
4.9 on their logs), and a real spike is a multiplicative jump. Flagged steps are
not added to the window, so a spike does not widen the band that judges the next.
"""

from __future__ import annotations

import math
from collections import deque


class SpikeDetector:
    def __init__(self, window: int = 128, sigma: float = 6.0, min_history: int = 16) -> None:
        self.window, self.sigma, self.min_history = window, sigma, min_history
        self.loss: deque[float] = deque(maxlen=window)
        self.grad_norm: deque[float] = deque(maxlen=window)
        self.consecutive = 0

    @staticmethod
    def _z(history: deque[float], x: float) -> float:
        n = len(history)
        mean = sum(history) / n
        var = sum((h - mean) ** 2 for h in history) / max(1, n - 1)
        return (x - mean) / max(math.sqrt(var), 1e-12)

    def check(self, loss: float, grad_norm: float) -> dict | None:
        """None for a healthy step (and remember it); else the evidence that flagged it."""
        evidence = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            evidence = {"reason": "nonfinite", "loss": loss, "grad_norm": grad_norm}
        elif len(self.loss) >= self.min_history:
            z_loss = self._z(self.loss, loss)
            z_grad = self._z(self.grad_norm, math.log(max(grad_norm, 1e-12)))
            if abs(z_loss) > self.sigma or abs(z_grad) > self.sigma:
                evidence = {"reason": "spike", "loss": loss, "grad_norm": grad_norm,
                            "z_loss": round(z_loss, 2), "z_grad_norm": round(z_grad, 2), "sigma": self.sigma,
                            "window": len(self.loss)}
        if evidence is None:
            self.loss.append(loss)
            self.grad_norm.append(math.log(max(grad_norm, 1e-12)))
            self.consecutive = 0
        else:
            self.consecutive += 1
            evidence["consecutive"] = self.consecutive
        return evidence

    def state_dict(self) -> dict:
        return {"loss": list(self.loss), "grad_norm": list(self.grad_norm), "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.loss = deque(state["loss"], maxlen=self.window)
        self.grad_norm = deque(state["grad_norm"], maxlen=self.window)
        self.consecutive = int(state["consecutive"])


class SpikeRollback(RuntimeError):
    """Raised by every rank when ``spike_patience`` consecutive steps were flagged (rollback policy)."""

    def __init__(self, step: int, first_step: int, evidence: dict) -> None:
        super().__init__(f"{step - first_step + 1} consecutive flagged steps ({first_step}..{step}): {evidence}")
        self.step, self.first_step, self.evidence = step, first_step, evidence

    def __reduce__(self):
        return (SpikeRollback, (self.step, self.first_step, self.evidence))
