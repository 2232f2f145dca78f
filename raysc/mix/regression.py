"""The regression at the heart of mixture tuning: a proxy's held-out loss on the target domain as a
function of its mixture, and the mixture that function predicts best (RegMix, Liu et al. 2024).

RegMix fits LightGBM to hundreds of proxies. A run here affords tens, so the models are ones with a
parameter per domain (or one more), which that many points can pin down:

- ``linear``: loss = Σ β_d w_d (RegMix's linear variant; the weights sum to one, so β_d is the loss
  the fit expects from an all-d mixture and no intercept is needed);
- ``loglinear``: loss = c + Σ β_d log w_d: diminishing returns in each domain's share, the shape
  data-mixing laws report, and the one that can put the optimum inside the simplex.

Each is scored by leave-one-out (every proxy predicted by a fit that never saw it) and the one with
the lower error is used; both scores are reported. The search follows RegMix: predict many
candidate mixtures drawn from the proxies' own distribution and average the ``top_k`` best. With
tens of proxies rather than RegMix's 512 the draws reach shares no proxy trained on, so candidates
are first kept ``within`` the per-domain range the proxies covered: the fit interpolates, it does
not extrapolate (a linear fit's optimum on the whole simplex is a corner no proxy saw).

DoReMi (Xie et al. 2023) reaches a mixture differently: a small proxy trained with Group DRO
up-weights, online, the domains where it trails a reference model by the most (excess loss). It
needs two special training runs and a change to the training loop, and optimises the worst domain
rather than a chosen target; RegMix needs only ordinary runs, which the cluster runs in parallel
and which this package can score on any target afterwards. That is why raysc implements RegMix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("linear", "loglinear")


def features(w: np.ndarray, kind: str) -> np.ndarray:
    w = np.atleast_2d(np.asarray(w, dtype=np.float64))
    if kind == "linear":
        return w
    if kind == "loglinear":
        return np.hstack([np.ones((len(w), 1)), np.log(np.clip(w, 1e-6, None))])
    raise ValueError(f"unknown regression {kind!r}; one of {KINDS}")


def solve(w: np.ndarray, y: np.ndarray, kind: str, ridge: float = 1e-6) -> np.ndarray:
    """Least squares with a small ridge (so that collinear proxies still give an answer)."""
    x = features(w, kind)
    return np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ np.asarray(y, dtype=np.float64))


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = (np.argsort(np.argsort(v)).astype(np.float64) for v in (a, b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


@dataclass
class Fit:
    kind: str
    coef: np.ndarray
    loo: np.ndarray  # each proxy's loss predicted without it
    loo_rmse: float
    loo_spearman: float
    r2: float  # of the leave-one-out predictions

    def predict(self, w: np.ndarray) -> np.ndarray:
        return features(w, self.kind) @ self.coef

    def summary(self) -> dict:
        return {
            "kind": self.kind,
            "coef": [round(float(c), 6) for c in self.coef],
            "loo_rmse": round(self.loo_rmse, 6),
            "loo_spearman": round(self.loo_spearman, 4),
            "loo_r2": round(self.r2, 4),
        }


def fit(w: np.ndarray, y: np.ndarray, kind: str) -> Fit:
    w, y = np.asarray(w, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n = len(y)
    loo = np.empty(n)
    for i in range(n):
        keep = np.arange(n) != i
        loo[i] = (features(w[i], kind) @ solve(w[keep], y[keep], kind))[0]
    rmse = float(np.sqrt(np.mean((loo - y) ** 2)))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((loo - y) ** 2)) / total if total > 0 else 0.0
    return Fit(kind, solve(w, y, kind), loo, rmse, spearman(loo, y), r2)


def min_proxies(n_domains: int) -> int:
    """Proxies needed for a leave-one-out score of the larger model (D + 1 parameters)."""
    return n_domains + 3


def choose(w: np.ndarray, y: np.ndarray) -> tuple[Fit, dict[str, Fit]]:
    """Both fits, and the one with the lower leave-one-out error."""
    if len(y) < min_proxies(np.asarray(w).shape[1]):
        raise ValueError(
            f"{len(y)} proxy results are too few to fit {np.asarray(w).shape[1]} domains; "
            f"run at least {min_proxies(np.asarray(w).shape[1])} proxies (--proxies)"
        )
    fits = {k: fit(w, y, k) for k in KINDS}
    return min(fits.values(), key=lambda f: (f.loo_rmse, KINDS.index(f.kind))), fits


def within(candidates: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """The candidates whose every weight lies in the range the proxies trained on (per domain, from
    the smallest to the largest share any proxy had), plus the proxies' own mixtures."""
    lo, hi = trained.min(axis=0), trained.max(axis=0)
    inside = candidates[np.all((candidates >= lo - 1e-12) & (candidates <= hi + 1e-12), axis=1)]
    return np.vstack([inside, trained])


def best_mixture(f: Fit, candidates: np.ndarray, top_k: int) -> tuple[np.ndarray, float]:
    """The mean of the ``top_k`` candidates with the lowest predicted loss, and its prediction."""
    pred = f.predict(candidates)
    top = candidates[np.argsort(pred)[: max(1, top_k)]].mean(axis=0)
    top = top / top.sum()
    return top, float(f.predict(top)[0])
