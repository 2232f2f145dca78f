"""The small languages some config values are written in, parsed: the mixture schedule
(``data.schedule``) and the Gopher n-gram limits (``quality.top_ngram_max``, ``dup_ngram_max``).

They live in config, the bottom layer, because the loader checks them before anything runs;
the data loader and the quality rules import them from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """From ``start_tokens`` consumed tokens on, sample the domains in these (normalised) weights."""

    start_tokens: int
    weights: dict[str, float]


def parse_schedule(text: str, domains: list[str] | None = None) -> list[Phase]:
    """'0:prose=0.7,code=0.3; 2e6:prose=0.3,code=0.7' -> phases sorted by start (the first at 0)."""
    phases = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        start, _, body = part.partition(":")
        try:
            start_tokens = int(float(start))
            weights = {k.strip(): float(v) for k, v in (w.split("=") for w in body.split(",") if w.strip())}
        except ValueError:
            raise ValueError(f"{part!r} is not TOKENS:domain=weight,... (e.g. '0:prose=0.7,code=0.3')") from None
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"{part!r}: weights must be >= 0 and not all 0")
        if domains is not None:
            unknown = sorted(set(weights) - set(domains))
            if unknown:
                raise ValueError(f"{part!r}: unknown domain(s) {unknown}; the data has {sorted(domains)}")
        total = sum(weights.values())
        phases.append(Phase(start_tokens, {k: v / total for k, v in sorted(weights.items()) if v > 0}))
    phases.sort(key=lambda p: p.start_tokens)
    if not phases or phases[0].start_tokens != 0:
        raise ValueError("the schedule must have a phase starting at 0 tokens")
    return phases


def parse_ngram_limits(text: str) -> dict[int, float]:
    """'2:0.20,3:0.18' -> {2: 0.2, 3: 0.18}."""
    out = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        n, _, limit = item.partition(":")
        try:
            out[int(n)] = float(limit)
        except ValueError:
            raise ValueError(f"{item!r} is not N:LIMIT (e.g. '2:0.20,3:0.18')") from None
        if int(n) < 1:
            raise ValueError(f"{item!r}: n must be >= 1")
    return out
