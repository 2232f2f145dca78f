"""The PNG of a tuning: each proxy's measured target loss against the loss the regression predicts
for it without having seen it (leave-one-out), with the validation runs beside them."""

from __future__ import annotations

from pathlib import Path


def predicted_vs_measured(
    path: Path,
    measured: list[float],
    predicted: list[float],
    fit: str,
    target: str,
    validation: list[tuple[str, float, float]],
) -> Path:
    """``validation``: (label, predicted, measured mean) per validated mixture. Its runs may be longer
    than the proxies, so its points sit off the diagonal: their order is what they check."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=120)
    ax.scatter(predicted, measured, s=22, color="#4c72b0", label="proxies (predicted leave-one-out)")
    for label, pred, meas in validation:
        ax.scatter([pred], [meas], s=60, marker="*", label=f"validation: {label}")
    values = [*measured, *predicted, *[v for _, p, m in validation for v in (p, m)]]
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or 0.01
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"predicted {target} held-out loss ({fit} fit)")
    ax.set_ylabel(f"measured {target} held-out loss")
    ax.set_title("raysc mix tune: predicted vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
