"""The fault-injection spec (``supervisor.inject``): ``KIND@STEP[:RANK][/PHASE]``, comma-separated.

``PHASE`` places a fault inside its step (default ``start``, before the batch is read): ``data`` (the batch
read), ``forward`` (the first microbatch's loss computed, before its backward), ``backward`` (every
gradient reduced), ``clip`` (the gradient norm clipped), ``totals`` (the step's loss and data fingerprint
all-reduced), ``update`` (the optimizer step applied), ``end`` (the step counted). Only the kinds that
stop or stall a rank (``PHASED_KINDS``) take one: the others act where they act.

Parsed here, in the bottom layer, so that a bad spec is a config error before anything starts;
what each kind does is ``raysc.fleet.faults`` (which fires them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = (
    "raise",
    "kill",
    "hang",
    "kill_save",
    "slow_upload",
    "nan",
    "spike",
    "bitflip",
    "slow",
    "node_loss",
    "disk_loss",
)
PHASES = ("start", "data", "forward", "backward", "clip", "totals", "update", "end")
PHASED_KINDS = ("raise", "kill", "hang", "slow", "node_loss")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?(?:/(?P<phase>[a-z]+))?$")


@dataclass(frozen=True)
class Fault:
    """One drill: ``kind`` fires on rank ``rank`` in optimizer step ``step`` at ``phase`` (``start``: before
    it); ``spec`` is its text."""

    kind: str
    step: int
    rank: int
    spec: str
    phase: str = "start"


def parse_faults(text: str) -> list[Fault]:
    """'kill@50:0,nan@80' -> the faults in order; ValueError naming a malformed item."""
    faults = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"{item!r} is not KIND@STEP[:RANK][/PHASE] (e.g. 'kill@50:0' or 'kill@50:0/backward')")
        if m["kind"] not in KINDS:
            raise ValueError(f"unknown fault kind {m['kind']!r} in {item!r}; kinds are {', '.join(KINDS)}")
        if int(m["step"]) < 1:
            raise ValueError(f"step in {item!r} must be >= 1")
        phase = m["phase"] or "start"
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} in {item!r}; phases are {', '.join(PHASES)}")
        if phase != "start" and m["kind"] not in PHASED_KINDS:
            raise ValueError(
                f"{item!r}: a {m['kind']} fault acts where it acts; only {', '.join(PHASED_KINDS)} take a /PHASE"
            )
        faults.append(Fault(m["kind"], int(m["step"]), int(m["rank"] or 0), item, phase))
    return faults


def consume_faults(text: str, fired: set[str]) -> str:
    """The injection spec without the faults that have fired, so a replacement worker does not
    fail the same way again."""
    return ",".join(f.spec for f in parse_faults(text) if f.spec not in fired)
