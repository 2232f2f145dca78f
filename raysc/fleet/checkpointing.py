"""The supervisor's side of checkpointing: ``CheckpointCoordinator``, the one object the supervisor holds.

It wires together and delegates to the parts, each in its own module: the store probe and interval
advice (``checkpoint_probe``), the run id claim and which checkpoints are this run's
(``checkpoint_runs``), the save in flight, its commit and retention (``checkpoint_saving``), the
failed-save policy (``checkpoint_failed_saves``), the hot copy in Ray's object store
(``checkpoint_hot``) and restore with fallback (``checkpoint_restore``). ``young_interval_s`` and
``parse_resume_from`` stay importable from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from raysc.checkpoint.store import CheckpointStore
from raysc.config.schema import Config
from raysc.fleet.checkpoint_failed_saves import FailedSaves
from raysc.fleet.checkpoint_hot import HotCopy
from raysc.fleet.checkpoint_probe import probe_store, young_interval_s
from raysc.fleet.checkpoint_restore import Restorer
from raysc.fleet.checkpoint_runs import RunOwnership, parse_resume_from
from raysc.fleet.checkpoint_saving import SaveInFlight

__all__ = ["CheckpointCoordinator", "parse_resume_from", "young_interval_s"]


class CheckpointCoordinator:
    """Probe, claim, save, commit, retain, hot copy and restore, for the supervisor (see the module docstring)."""

    def __init__(self, cfg: Config, event: Callable[..., dict], wait: Callable[..., list]) -> None:
        self.cfg, self.event, self.wait = cfg, event, wait
        self.store = CheckpointStore.for_config(cfg)
        self.runs = RunOwnership(cfg, self.store, event)
        self.failures = FailedSaves(cfg, self.store, event)
        self.hot = HotCopy(self.store)
        self.saving = SaveInFlight(cfg, event, wait, self.store, self.runs, self.failures, self.hot)
        self.restorer = Restorer(cfg, event, wait, self.store, self.runs, self.hot, self.saving)

    # ---- state the supervisor, the healer and tests read or set ----
    @property
    def workers(self) -> list:
        return self.saving.workers

    @workers.setter
    def workers(self, workers: list) -> None:
        self.saving.workers = workers

    @property
    def inflight(self) -> dict | None:
        return self.saving.inflight

    @inflight.setter
    def inflight(self, job: dict | None) -> None:
        self.saving.inflight = job

    @property
    def durable_step(self) -> int | None:
        """The newest checkpoint this run committed or restored."""
        return self.saving.durable_step

    @durable_step.setter
    def durable_step(self, step: int | None) -> None:
        self.saving.durable_step = step

    @property
    def saves(self) -> list[dict]:
        return self.saving.saves

    @property
    def failed_saves(self) -> int:
        return self.failures.total

    @property
    def failed_in_row(self) -> int:
        """Failed saves since the last commit (checkpoint.max_failed_saves)."""
        return self.failures.in_row

    @property
    def run_id(self) -> str:
        return self.runs.run_id

    @run_id.setter
    def run_id(self, run_id: str) -> None:
        self.runs.run_id = run_id

    @property
    def trackers(self) -> dict[str, str]:
        return self.runs.trackers

    @trackers.setter
    def trackers(self, ids: dict[str, str]) -> None:
        self.runs.trackers = ids

    @property
    def load_store(self) -> CheckpointStore:
        """Where a restore reads from (--resume-from may point elsewhere)."""
        return self.restorer.load_store

    # ---- whose checkpoints these are ----
    def claim(self, resume: bool | str, overwrite: bool, run_dir: Path) -> str:
        return self.runs.claim(resume, overwrite, run_dir)

    def tracker_ids(self, resume: bool | str) -> dict[str, str]:
        return self.runs.tracker_ids(resume)

    def own_steps(self) -> list[int]:
        return self.runs.own_steps()

    def latest(self) -> int | None:
        """This run's newest committed checkpoint that verifies (sizes), or None."""
        return next((s for s in reversed(self.own_steps()) if self.store.verify(s) is None), None)

    # ---- before step 1 ----
    def probe(self) -> None:
        """Write-read-delete probe of checkpoint.uri, and Young's interval advice when every_steps is unset."""
        probe_store(self.cfg, self.store, self.event)

    # ---- saving ----
    def save(self, step: int, tokens: int) -> None:
        self.saving.save(step, tokens)

    def poll(self) -> None:
        self.saving.poll()

    def salvage(self, timeout_s: float = 30.0, gone: set[int] = frozenset()) -> None:
        self.saving.salvage(timeout_s, gone)

    def finish(self) -> None:
        self.saving.finish()

    # ---- restoring ----
    def rollback_to_before(self, first_bad_step: int) -> int:
        return self.restorer.rollback_to_before(first_bad_step)

    def candidates(self, resume: bool | str) -> Iterator[int]:
        return self.restorer.candidates(resume)

    def restore(self, resume: bool | str, fresh_ok: bool = False) -> int:
        return self.restorer.restore(resume, fresh_ok)
