"""The fault-injection spec (``supervisor.inject``): ``KIND@STEP[:RANK]``, comma-separated.

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
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")


@dataclass(frozen=True)
class Fault:
    """One drill: ``kind`` fires on rank ``rank`` before optimizer step ``step``; ``spec`` is its text."""

    kind: str
    step: int
    rank: int
    spec: str


def parse_faults(text: str) -> list[Fault]:
    """'kill@50:0,nan@80' -> the faults in order; ValueError naming a malformed item."""
    faults = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"{item!r} is not KIND@STEP[:RANK] (e.g. 'kill@50:0')")
        if m["kind"] not in KINDS:
            raise ValueError(f"unknown fault kind {m['kind']!r} in {item!r}; kinds are {', '.join(KINDS)}")
        if int(m["step"]) < 1:
            raise ValueError(f"step in {item!r} must be >= 1")
        faults.append(Fault(m["kind"], int(m["step"]), int(m["rank"] or 0), item))
    return faults


def consume_faults(text: str, fired: set[str]) -> str:
    """The injection spec without the faults that have fired, so a replacement worker does not
    fail the same way again."""
    return ",".join(f.spec for f in parse_faults(text) if f.spec not in fired)
