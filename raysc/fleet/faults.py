"""Fault injection (``supervisor.inject``): make a worker fail on purpose, for drills and tests.

``KIND@STEP[:RANK]`` makes worker ``RANK`` (default 0) fail just before it runs
optimizer step ``STEP``:
- ``raise``: an exception inside the step;
- ``kill``: the worker process gets SIGKILL (as when the OOM killer or a node dies);
- ``hang``: the worker process stops itself with SIGSTOP (a stuck collective or driver);
- ``nan``: that step's loss (and so its gradients) becomes NaN on that rank;
- ``spike``: that step's loss is multiplied by 1000 on that rank (a loss and grad-norm spike);
- ``bitflip``: one bit of that rank's first parameter shard is flipped (silent data corruption;
  found by the next ``supervisor.sdc_every_steps`` check);
- ``slow``: that rank sleeps ``SLOW_S`` seconds before the step (a straggler);
- ``kill_save``: SIGKILL halfway through uploading the checkpoint of step ``STEP`` (after its
  first file), to prove a half-written checkpoint is never loaded.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

KINDS = ("raise", "kill", "hang", "kill_save", "nan", "spike", "bitflip", "slow")
SLOW_S = 3.0
LOSS_FAULTS = {"nan": float("nan"), "spike": 1000.0}  # factor applied to that step's loss (and so its grads)
_SPEC = re.compile(r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")


class InjectedFault(RuntimeError):
    """The exception the ``raise`` fault throws inside a training step."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    spec: str


def parse_faults(text: str) -> list[Fault]:
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


def fire(fault: Fault) -> None:
    """Carry out ``fault`` in the calling process."""
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault {fault.spec}")
    if fault.kind in ("kill", "kill_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault.kind == "slow":
        time.sleep(SLOW_S)


def consume_faults(text: str, fired: set[str]) -> str:
    """The injection spec without the faults that have fired, so a replacement worker does not
    fail the same way again."""
    return ",".join(f.spec for f in parse_faults(text) if f.spec not in fired)
