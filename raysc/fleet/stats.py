"""``RunStats``: the counters of a run and the summaries built from them.

Rank 0's per-step reports arrive on another thread of the supervisor actor while the
run waits on its workers, so every counter is read and written under one lock.
The run summary (``run_end``), the stop summary (``run_stopped``) and the dashboard's
health gauges are all built here, from the same counts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from raysc.fleet.status import goodput


@dataclass
class SdcCounts:
    """Replica checks (``supervisor.sdc_every_steps``) and what they led to."""

    checks: int = 0
    mismatches: int = 0
    repairs: int = 0
    rollbacks: int = 0
    check_s: float = 0.0  # time in passing checks
    step_s: float = 0.0  # time of the steps those checks followed
    clean_step: int = 0  # the newest step whose check passed

    def summary(self) -> dict:
        return {
            "checks": self.checks,
            "mismatches": self.mismatches,
            "repairs": self.repairs,
            "rollbacks": self.rollbacks,
            "overhead": round(self.check_s / self.step_s, 4) if self.step_s else None,
        }


@dataclass
class RunStats:
    total_steps: int
    t_start: float = field(default_factory=time.time)
    last: dict | None = None  # rank 0's newest step metrics
    tps: list[float] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)  # step -> metrics; a re-run step replaces its first try
    sdc: SdcCounts = field(default_factory=SdcCounts)
    restarts: int = 0  # every restart and rollback of the run
    rollbacks: int = 0
    peer_heals: int = 0  # restarts healed from a surviving replica (no rollback)
    strikes: int = 0  # restarts and rollbacks since training last made progress
    memory: list[dict] | None = None  # per-rank peak memory (CUDA, or train.measure_memory)
    fault_step: int = 0  # the latest step an injected fault fired before
    # steps whose metrics a peer heal recovered from a survivor for a lost rank 0: that rank's own report of
    # them, if it was already on its way, is dropped (until a restart from a checkpoint runs them again)
    recovered: set[int] = field(default_factory=set)
    _last_report: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def unrecovered(self, batch: list[dict]) -> list[dict]:
        """``batch`` without the steps a peer heal already recovered (each dropped once)."""
        with self._lock:
            kept = [m for m in batch if m["step"] not in self.recovered]
            self.recovered.difference_update(m["step"] for m in batch)
            return kept

    def ingest(self, batch: list[dict]) -> None:
        """Rank 0's metrics of some steps (see ``TrainWorker.train``)."""
        with self._lock:
            self.last = batch[-1]
            self._last_report = time.monotonic()
            self.tps.extend(m["tokens_per_s"] for m in batch)
            self.steps.update((m["step"], m) for m in batch)
            for m in batch:
                if "sdc_s" in m:  # a passing replica check at this step
                    self.sdc.checks += 1
                    self.sdc.check_s += m["sdc_s"]
                    self.sdc.step_s += m["step_time"]
                    self.sdc.clean_step = max(self.sdc.clean_step, m["step"])

    def touch(self) -> None:
        """Restart the hang clock (before waiting on work that reports nothing at first)."""
        with self._lock:
            self._last_report = time.monotonic()

    def silent_s(self) -> float:
        with self._lock:
            return time.monotonic() - self._last_report

    def fault_fired(self, step: int) -> None:
        with self._lock:
            self.fault_step = max(self.fault_step, step)

    def failed_step(self) -> int:
        """The step a failure interrupted: after the newest reported one, or the faulted one."""
        with self._lock:
            return max((self.last or {}).get("step", 0) + 1, self.fault_step)

    def step_times(self, first: int, last: int) -> list[float]:
        with self._lock:
            return sorted(m["step_time"] for s, m in self.steps.items() if first <= s <= last)

    def has_step(self, step: int) -> bool:
        with self._lock:
            return step in self.steps

    def skipped(self) -> int:
        with self._lock:
            return sum(1 for m in self.steps.values() if m.get("skipped"))

    def goodput(self) -> float | None:
        """Goodput of this supervisor's run, from the steps reported to it (last attempt wins)."""
        with self._lock:
            g = goodput(list(self.steps.values()), time.time() - self.t_start)
        return round(g, 4) if g is not None else None

    def health(self) -> dict:
        """The dashboard's run-health gauges (``raysc.fleet.records.HEALTH_METRICS``)."""
        return {
            "restarts": self.restarts - self.rollbacks,
            "rollbacks": self.rollbacks,
            "skipped_steps": self.skipped(),
            "sdc_checks": self.sdc.checks,
            "sdc_mismatches": self.sdc.mismatches,
            "goodput": self.goodput(),
        }

    def median_tps(self) -> float:
        with self._lock:
            tps = self.tps[len(self.tps) // 10 :] or [0.0]  # skip warm-up steps
        return sorted(tps)[len(tps) // 2]

    def run_summary(
        self, last: dict | None, *, steps_run: int, tokens_per_step: int, train_time: float, params: int
    ) -> dict:
        """The training part of the ``run_end`` summary, ``last`` being rank 0's final step metrics
        (the caller adds checkpoints, quarantine, probe)."""
        return {
            "final_loss": last["loss"] if last else None,
            "tokens": last["tokens"] if last else None,
            "tokens_per_s": self.median_tps(),
            "tokens_per_s_wall": steps_run * tokens_per_step / train_time if steps_run else 0.0,
            "mfu": last["mfu"] if last else None,
            "params": params,
            "restarts": self.restarts - self.rollbacks,
            "rollbacks": self.rollbacks,
            "peer_heals": self.peer_heals,
            "sdc": self.sdc.summary(),
            "goodput": self.goodput(),
            "skipped_updates": self.skipped(),
            "wall_s": round(time.time() - self.t_start, 2),
            "peak_memory_gb": [round(m["peak_bytes"] / 1e9, 4) for m in self.memory] if self.memory else None,
        }
