"""How long a fleet's start may take: ``supervisor.start_timeout_s``, or ``supervisor.timeout_factor`` x the
longest start of this run's fleets so far when that is more.

Calibrated as the step timeouts are: a restart starts as many processes on the same machine as the first
start did, and a busy 2-core machine (a CI run) took 38 s for eight of them with one other core's worth of
work beside it and over 60 s with two, so a fixed 60 s failed restart after restart of a fleet that was
starting, not stuck.
"""

from __future__ import annotations

from raysc.config.schema import SupervisorConfig

# where a fleet's start bound comes from, as errors name it
START_BOUND = "the start bound: supervisor.start_timeout_s, or timeout_factor x this run's measured fleet start"


def start_bound_s(sup: SupervisorConfig, measured_s: float) -> float:
    """The bound for a cold fleet's start (each rank's process up, then the rendezvous and model build),
    given the longest measured start of this run's fleets (0 before the first)."""
    return max(sup.start_timeout_s, sup.timeout_factor * measured_s)
