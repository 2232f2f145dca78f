"""Calibrated timeouts: the hang timeout and the process-group timeout, from measured times.

After ``supervisor.calibrate_steps`` steps, the median step time (the first step of a fleet,
which warms up, left out) and an all-reduce of gradient size, each times
``supervisor.timeout_factor`` and at least ``supervisor.timeout_floor_s``, replace the
configured defaults; an optional stress test (``supervisor.stress_s``) runs collectives
under the new timeout while a core is kept busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raysc.config.schema import SupervisorConfig
from raysc.fleet.events import EventKind
from raysc.fleet.messages import REPORT_EVERY_S
from raysc.fleet.stats import RunStats

SLOW_FACTOR = 3.0  # a step this many times the calibrated median is reported as slow
# ... and at least this much slower: a shared host's scheduling jitters by tenths of a second (a
# clean-clone CI run on 2 cores saw a 0.10 s step take 0.72 s with no fault), no straggler's doing
SLOW_SLACK_S = 1.0


class Timeouts:
    def __init__(self, sup: SupervisorConfig, event: Callable[..., dict], wait: Callable[..., list]) -> None:
        self.sup = sup
        self.event = event
        self.wait = wait
        self.values: dict | None = None  # step_s, collective_s, collective_bytes, hang_s, pg_s

    @property
    def pending(self) -> bool:
        """Whether calibration is still to run (it is on and has not run yet)."""
        return self.values is None and bool(self.sup.calibrate_steps)

    def reset(self) -> None:
        """Measure again (a resized fleet's steps take another time); the configured timeouts meanwhile."""
        self.values = None

    @property
    def hang_s(self) -> float | None:
        return self.values["hang_s"] if self.values else None

    def is_slow(self, step_time: float) -> float | None:
        """The calibrated median when ``step_time`` is a straggler's, else None."""
        normal = self.values["step_s"] if self.values else None
        return normal if normal and step_time > max(SLOW_FACTOR * normal, normal + SLOW_SLACK_S) else None

    def calibrate(self, stats: RunStats, first: int, last: int, workers: list) -> None:
        """Measure steps ``first..last`` and a gradient-sized all-reduce; set and apply the timeouts."""
        deadline = time.monotonic() + 5.0
        while not stats.has_step(last) and time.monotonic() < deadline:  # rank 0's last report in flight
            time.sleep(0.05)
        times = stats.step_times(first, last)
        if not times:
            return
        step_s = times[len(times) // 2]
        coll = self.wait([w.measure_collectives.remote() for w in workers], "collective calibration")
        coll_s = max(c["allreduce_s"] for c in coll)
        silence_s = max(step_s, REPORT_EVERY_S)  # rank 0 reports once a step, at most once a second
        sup = self.sup
        self.values = {
            "step_s": step_s,
            "collective_s": coll_s,
            "collective_bytes": coll[0]["bytes"],
            "hang_s": max(sup.timeout_floor_s, sup.timeout_factor * silence_s),
            "pg_s": max(sup.timeout_floor_s, sup.timeout_factor * max(step_s, coll_s)),
        }
        self.apply(workers)
        self.event(
            EventKind.TIMEOUTS_CALIBRATED,
            steps=f"{first}..{last}",
            step_time_s=round(step_s, 4),
            allreduce_s=round(coll_s, 5),
            allreduce_bytes=coll[0]["bytes"],
            factor=sup.timeout_factor,
            floor_s=sup.timeout_floor_s,
            hang_timeout_s=round(self.values["hang_s"], 3),
            pg_timeout_s=round(self.values["pg_s"], 3),
        )
        if sup.stress_s:
            self._stress(workers)

    def _stress(self, workers: list) -> None:
        pg_s = self.values["pg_s"]
        res = self.wait(
            [w.stress.remote(self.sup.stress_s) for w in workers],
            "collective stress test",
            hang_s=self.sup.stress_s + pg_s + 30,
        )
        self.event(
            EventKind.COLLECTIVE_STRESS,
            seconds=self.sup.stress_s,
            ops=sum(r["ops"] for r in res),
            slowest_op_s=round(max(r["slowest_s"] for r in res), 4),
            timeouts=sum(r["timeouts"] for r in res),
            pg_timeout_s=round(pg_s, 3),
            errors=[r["error"] for r in res if r["error"]][:2],
        )

    def apply(self, workers: list) -> None:
        """Set the calibrated process-group timeout on ``workers`` (a new fleet gets it too)."""
        if self.values is not None:
            self.wait([w.set_timeout.remote(self.values["pg_s"]) for w in workers], "set timeouts")
