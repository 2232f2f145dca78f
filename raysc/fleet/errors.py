"""Errors the fleet raises to the driver (kept free of Ray imports so the CLI can catch them cheaply),
and ``Failure``, the typed account of what went wrong that the supervisor classifies
(``raysc.fleet.actions``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FailureKind(str, Enum):
    DIED = "died"  # a worker process is gone (killed, OOM, node lost)
    RAISED = "raised"  # a worker raised; ``Failure.cause`` is its exception
    HUNG = "hung"  # no progress for longer than the hang timeout
    TIMED_OUT = "timed_out"  # a bounded operation (setup, save) did not finish in time
    STORAGE = "storage"  # checkpoint saves keep failing: a restart would meet the same store


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    rank: int | None = None
    cause: BaseException | None = None


class RunFailed(RuntimeError):
    """The run stopped; the message says which rank failed, how, and how to resume. ``failure``
    says what happened, for the supervisor to choose restart, rollback, repair or stop."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class RankError(RuntimeError):
    """An exception a rank raised whose class is not raysc's or Python's (torch's, gloo's, NCCL's):
    its message, and its class and base classes by name (``kinds``, most derived first). Unpickling
    the original in the supervisor would import torch there, seconds added to the detection of the
    run's first failure (``portable``)."""

    def __init__(self, kinds: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.kinds = tuple(kinds)

    def is_a(self, qualified_name: str) -> bool:
        """Whether the original exception was an instance of the class named ``qualified_name``."""
        return qualified_name in self.kinds

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (RankError, (self.kinds, str(self)))


def portable(e: Exception) -> Exception:
    """``e`` itself when the supervisor can unpickle it without torch, else a ``RankError``."""
    if type(e).__module__.split(".")[0] in ("raysc", "builtins"):
        return e
    return RankError(tuple(f"{c.__module__}.{c.__qualname__}" for c in type(e).__mro__), str(e))


class RunStopped(Exception):
    """The run was stopped on request (SIGINT / SIGTERM to the driver) before its last step.

    ``step`` is the step reached (None if unknown), ``checkpoint`` the newest committed checkpoint
    (None if there is none), ``aborted`` whether the graceful stop was cut short (a second signal,
    or ``train.stop_timeout_s``), ``summary`` the supervisor's stop summary when it finished."""

    def __init__(
        self, reason: str, step: int | None, checkpoint: str | None, aborted: bool = False, summary: dict | None = None
    ) -> None:
        how = "aborted" if aborted else "stopped"
        super().__init__(f"{how} by {reason} at step {step}; newest committed checkpoint: {checkpoint or 'none'}")
        self.reason, self.step, self.checkpoint, self.aborted, self.summary = reason, step, checkpoint, aborted, summary

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process killed by it (130 SIGINT, 143 SIGTERM)."""
        return {"SIGINT": 130, "SIGTERM": 143}.get(self.reason, 1)
