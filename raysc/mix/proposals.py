"""Candidate domain mixtures, and the ``data.schedule`` text that carries one into a run.

RegMix (Liu et al. 2024) trains its proxies on mixtures drawn from a Dirichlet distribution
centred on the natural token proportions, and searches for the best mixture among many more
draws from the same distribution. ``dirichlet_mixtures`` is that distribution: mean = the
natural proportions, total concentration ``concentration`` (smaller = wider). Every weight is
kept >= ``floor`` (then renormalised) so that no proxy starves a domain to a handful of rows.
Mixtures are rows of an (n, D) array over the domains in name order.
"""

from __future__ import annotations

import numpy as np


def natural_weights(tokens: dict[str, int]) -> dict[str, float]:
    """Each domain's share of the tokens (what an untuned run trains on)."""
    total = sum(tokens.values())
    if total <= 0:
        raise ValueError("the domains hold no tokens")
    return {k: tokens[k] / total for k in sorted(tokens)}


def dirichlet_mixtures(
    natural: dict[str, float], n: int, concentration: float, seed: int, floor: float = 0.01
) -> np.ndarray:
    """``n`` mixtures around ``natural`` (domains in name order), each row summing to one."""
    if concentration <= 0:
        raise ValueError(f"concentration must be > 0, not {concentration}")
    names = sorted(natural)
    if floor * len(names) >= 1:
        raise ValueError(f"floor {floor} leaves no room for {len(names)} domains")
    alpha = np.maximum(np.array([natural[k] for k in names]) * concentration, 1e-3)
    w = np.random.default_rng(seed).dirichlet(alpha, size=n)
    return clip_floor(w, floor)


def clip_floor(w: np.ndarray, floor: float) -> np.ndarray:
    """Raise weights below ``floor`` to it, taking the excess from the others in proportion."""
    w = np.atleast_2d(np.asarray(w, dtype=np.float64))
    low = w < floor
    spare = np.where(low, 0.0, w)
    need = 1.0 - floor * low.sum(axis=1, keepdims=True)
    return np.where(low, floor, spare / spare.sum(axis=1, keepdims=True) * need)


def weights_text(names: list[str], w: np.ndarray) -> str:
    """'code=0.3000,prose=0.7000' (four decimals; the loader renormalises)."""
    return ",".join(f"{k}={float(x):.4f}" for k, x in zip(names, w))


def schedule(names: list[str], w: np.ndarray) -> str:
    """A one-phase ``data.schedule``."""
    return f"0:{weights_text(names, w)}"


def two_phase_schedule(names: list[str], early: np.ndarray, late: np.ndarray, switch_tokens: int) -> str:
    """General early, tuned late (the article's curriculum): ``early`` until ``switch_tokens``
    consumed tokens, ``late`` after."""
    if switch_tokens <= 0:
        return schedule(names, late)
    return f"0:{weights_text(names, early)}; {int(switch_tokens)}:{weights_text(names, late)}"
