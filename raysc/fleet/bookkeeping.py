"""``Bookkeeping``: what the supervisor's threads share about a run, under one lock.

The run's phase, its events (each written to ``events.jsonl`` and the trackers, and kept for the
driver's polls), the injected faults that fired (a restart skips them), and the driver's stop and
checkpoint requests. ``Supervisor`` holds one and hands its ``event`` to the parts it conducts;
its remote methods (``progress``, ``fault_fired``, ``request_stop``, ``request_checkpoint``) are
served here while ``run`` waits on the workers on another thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from raysc.fleet.events import EventKind
from raysc.fleet.records import RunRecords
from raysc.fleet.stats import RunStats

if TYPE_CHECKING:
    from raysc.fleet.fleet import Fleet
    from raysc.track.run_tracker import RunTracker


class Bookkeeping:
    def __init__(self, records: RunRecords, stats: RunStats) -> None:
        self.records = records
        self.stats = stats
        self._lock = threading.Lock()
        self.phase = "starting"
        self._events: list[dict] = []
        self._fired: set[str] = set()  # specs of injected faults that fired (a restart skips them)
        self.stop: str | None = None  # why the driver asked the run to stop (SIGINT, SIGTERM)
        self._ckpt_asked: str | None = None  # who asked for a checkpoint now (raysc ckpt now, SIGUSR1)
        self.tracker: RunTracker | None = None  # the [track] trackers, once the run has its id

    def event(self, kind: EventKind, **fields) -> dict:
        rec = self.records.event(kind, **fields)
        with self._lock:
            self._events.append(rec)  # the driver prints them, in order with its own output
        if self.tracker is not None:
            self.tracker.event(rec)
        return rec

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def fault_fired(self, spec: str, rank: int, step: int) -> None:
        """An injected fault is about to fire on ``rank`` before ``step`` (recorded so a restart
        skips it)."""
        with self._lock:
            self._fired.add(spec)
        self.stats.fault_fired(step)
        self.event(EventKind.FAULT_INJECTED, fault=spec, rank=rank)

    def fired_faults(self) -> set[str]:
        with self._lock:
            return set(self._fired)

    def progress(self, events_seen: int = 0) -> dict:
        """Phase, newest step metrics, and the events after the first ``events_seen``."""
        with self._lock:
            return {
                "phase": self.phase,
                "last": self.stats.last,
                "total_steps": self.stats.total_steps,
                "events": self._events[events_seen:],
            }

    def request_stop(self, reason: str, fleet: Fleet) -> None:
        """Record the first stop request and ask ``fleet``'s workers to stop at the next step boundary."""
        with self._lock:
            first, self.stop = self.stop is None, self.stop or reason
            workers = list(fleet.workers)
        if first:
            self.event(EventKind.STOP_REQUESTED, reason=reason, note="stopping at the next step boundary")
            for w in workers:
                w.request.remote("stop")

    def request_checkpoint(self, source: str, fleet: Fleet) -> None:
        """Record a checkpoint request and ask ``fleet``'s workers to save at the next step boundary."""
        with self._lock:
            self._ckpt_asked = source
            workers = list(fleet.workers)
        self.event(EventKind.CHECKPOINT_REQUESTED, source=source)
        for w in workers:
            w.request.remote("checkpoint")

    def checkpoint_asked(self) -> bool:
        """Whether a checkpoint was asked for since the last one (and forget the request)."""
        with self._lock:
            asked, self._ckpt_asked = self._ckpt_asked is not None, None
        return asked
