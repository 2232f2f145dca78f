"""The failed-save policy: clean up after a failed save, record it, and decide whether the run stops.

A failed save deletes what it uploaded (never a committed checkpoint), is recorded with how much it
freed and whether retrying could have helped (``checkpoint_save_failed``), and raises a
``checkpoint_lagging`` event with the newest durable step; ``checkpoint.on_save_failure`` /
``max_failed_saves`` decide when the run stops (``RunFailed``, a storage failure no restart heals)
instead of training on with its work unsaved.
"""

from __future__ import annotations

from collections.abc import Callable

from raysc.checkpoint.store import CheckpointStore
from raysc.config.schema import Config
from raysc.fleet.errors import Failure, FailureKind, RunFailed
from raysc.fleet.events import EventKind


class FailedSaves:
    """Counts failed saves (in a row since the last commit, and in all) and applies the policy."""

    def __init__(self, cfg: Config, store: CheckpointStore, event: Callable[..., dict]) -> None:
        self.cfg, self.store, self.event = cfg, store, event
        self.in_row = 0  # failed saves since the last commit (checkpoint.max_failed_saves)
        self.total = 0

    def committed(self) -> None:
        """A save committed: the count of failures in a row starts over."""
        self.in_row = 0

    def discard(self, step: int) -> int | None:
        """Delete what a failed save of ``step`` uploaded (never a committed checkpoint); bytes freed."""
        try:
            return self.store.discard_failed(step)
        except Exception as e:  # the store may refuse even deletes; the next save of this step retries it
            self.event(EventKind.CHECKPOINT_CLEANUP_FAILED, step=step, error=f"{type(e).__name__}: {e}")
            return None

    def record(
        self,
        step: int,
        error: str,
        ranks: list[int],
        permanent: str | None,
        freed_local: int,
        durable_step: int | None,
    ) -> None:
        """Record a failed save, clean up after it and apply ``checkpoint.on_save_failure``."""
        ck = self.cfg.checkpoint
        self.in_row, self.total = self.in_row + 1, self.total + 1
        self.event(
            EventKind.CHECKPOINT_SAVE_FAILED,
            step=step,
            ranks=ranks,
            error=error,
            failure=f"permanent: {permanent}" if permanent else "transient (retried)",
            freed_bytes=self.discard(step),
            freed_local_bytes=freed_local,
            note="no manifest written; the previous checkpoint stands",
        )
        stop = ck.on_save_failure == "stop" or self.in_row >= ck.max_failed_saves
        at_risk = step - (durable_step or 0)
        self.event(
            EventKind.CHECKPOINT_LAGGING,
            step=step,
            durable_step=durable_step,
            steps_at_risk=at_risk,
            failed_in_row=self.in_row,
            max_failed_saves=ck.max_failed_saves,
            action="stop the run" if stop else "keep training; the next checkpoint step tries again",
        )
        if stop:
            why = (
                f"{self.in_row} checkpoint save(s) in a row failed"
                if ck.on_save_failure == "continue"
                else "a checkpoint save failed and checkpoint.on_save_failure = 'stop'"
            )
            raise RunFailed(
                f"{why} (last: step {step}: {error}). The newest durable checkpoint is "
                f"{'step ' + str(durable_step) if durable_step is not None else 'none'} "
                f"({at_risk} steps of work unsaved). Free space or raise the quota/permissions of "
                f"{self.cfg.checkpoint_uri} (see docs/checkpointing.md), then continue with --resume.",
                Failure(FailureKind.STORAGE),
            )  # a restart would hit the same store
