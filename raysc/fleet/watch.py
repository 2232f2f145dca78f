"""``Watch``: wait on every worker's call with hang detection, and name the rank that failed first.

``ray.get`` alone would wait forever on a hung rank and report whichever failure it happens to
see first. ``Watch.wait`` wakes when any call finishes, and at least once a second: a dead actor
or a raised exception becomes ``RunFailed`` with a typed ``Failure`` (died / raised, with the
cause), no report and no result
for the hang timeout becomes ``hung``, and a bounded operation past its deadline ``timed_out``.
When a rank fails inside a collective because a peer vanished, the peer's death is reported as
the root cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from raysc.fleet.errors import Failure, FailureKind, RankError, RunFailed
from raysc.fleet.events import EventKind


def is_peer_failure(exc: BaseException | None) -> bool:
    """Whether a rank's exception is a collective failing because of a peer (closed connection,
    timeout): the symptom, not the cause. (By class name: the supervisor does not import torch.)"""
    if isinstance(exc, RankError) and exc.is_a("torch.distributed.DistError"):
        return True
    return isinstance(exc, RuntimeError) and any(
        k in str(exc) for k in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out")
    )


def call_outcome(ref) -> object:
    """'ok', 'dead', 'error', or the exception a finished call raised."""
    try:
        ray.get(ref, timeout=0)
        return "ok"
    except ray.exceptions.RayActorError:
        return "dead"
    except ray.exceptions.RayTaskError as e:
        return e.cause
    except ray.exceptions.RayError:
        return "error"


def typed_failure(err: BaseException, event: Callable[..., dict]) -> RunFailed:
    """``err`` as a ``RunFailed`` the supervisor can heal: itself when it is one; a Ray error from a
    worker call made outside ``Watch.wait`` becomes a typed ``Failure`` (died / raised), recorded
    as an event, so that no raw Ray exception ends a run the supervisor could still heal."""
    if isinstance(err, RunFailed):
        return err
    first = str(err).splitlines()[0] if str(err) else type(err).__name__
    if isinstance(err, ray.exceptions.RayActorError):
        event(EventKind.WORKER_DIED, rank=None, node=None, during="a call outside the watch", error=first)
        return RunFailed(f"a worker died: {first}", Failure(FailureKind.DIED))
    cause = getattr(err, "cause", None)
    event(EventKind.WORKER_ERROR, rank=None, node=None, during="a call outside the watch", error=first)
    return RunFailed(f"a worker call failed: {first}", Failure(FailureKind.RAISED, None, cause))


def root_cause_first(done: list, pending: list) -> list:
    """``done`` with dead actors first. When a rank failed inside a collective (its peer
    vanished), the others get a moment to report: a dead peer is the root cause."""
    results = {ref: call_outcome(ref) for ref in done}
    dead = [ref for ref in done if results[ref] == "dead"]
    if not dead and pending and any(is_peer_failure(r) for r in results.values() if not isinstance(r, str)):
        late, _ = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        dead = [ref for ref in late if call_outcome(ref) == "dead"]
    return dead + [ref for ref in done if ref not in dead]


class Watch:
    """Waits on per-rank calls. ``silent_s()`` is the time since rank 0 last reported (a wait counts
    silence from its own start at the earliest: after a fault the last report is from before the
    fault's detection, the salvage and the new fleet's reservation, and a CI run's restart once read
    71 s of that into its first new rank's start and failed the run),
    ``node(rank)`` names a rank's node, ``poll()`` runs while waiting (checkpoint commits),
    ``default_hang_s`` is supervisor.hang_timeout_s."""

    def __init__(
        self,
        event: Callable[..., dict],
        silent_s: Callable[[], float],
        node: Callable[[int], str | None],
        default_hang_s: float,
    ) -> None:
        self.event = event
        self.silent_s = silent_s
        self.node = node
        self.default_hang_s = default_hang_s
        self.poll: Callable[[], None] = lambda: None

    def wait(
        self,
        refs: list,
        what: str,
        timeout: float | None = None,
        hang_s: float | None = None,
        ranks: list[int] | None = None,
        hang_why: str = "",
    ) -> list:
        """Every result of ``refs`` (one per rank: ``ranks`` names them, else their positions), or
        RunFailed naming the rank(s) and how; ``hang_why`` says where ``hang_s`` comes from when it is
        neither calibrated nor supervisor.hang_timeout_s."""
        hang_s = hang_s or self.default_hang_s
        rank_of = dict(zip(refs, ranks or range(len(refs))))
        pending = list(refs)
        t0 = time.monotonic()
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)  # a failure is seen when it lands
            if pending:
                self.poll()
            for ref in root_cause_first(done, pending):
                self._raise_if_failed(ref, rank_of[ref], what)
            silent = min(self.silent_s(), time.monotonic() - t0)
            if pending and timeout is not None and time.monotonic() - t0 > timeout:
                late = sorted(rank_of[r] for r in pending)
                self.event(EventKind.WORKER_TIMEOUT, during=what, ranks=late, seconds=round(timeout, 1))
                raise RunFailed(
                    f"ranks {late} did not finish {what} within {timeout:.0f}s.",
                    Failure(FailureKind.TIMED_OUT, late[0]),
                )
            if pending and silent > hang_s:
                late = sorted(rank_of[r] for r in pending)
                self.event(
                    EventKind.WORKER_HANG,
                    during=what,
                    silent_s=round(silent, 1),
                    ranks=late,
                    nodes=sorted({self.node(r) for r in late}),
                    timeout_s=round(hang_s, 2),
                )
                raise RunFailed(
                    f"no progress for {silent:.0f}s during {what}; waiting on ranks {late} "
                    f"(hang timeout {hang_s:.1f}s: "
                    + (hang_why or ("calibrated" if hang_s != self.default_hang_s else "supervisor.hang_timeout_s"))
                    + ").",
                    Failure(FailureKind.HUNG, late[0]),
                )
        return ray.get(refs)

    def _raise_if_failed(self, ref, rank: int, what: str) -> None:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            first = str(e).splitlines()[0]
            self.event(EventKind.WORKER_DIED, rank=rank, node=self.node(rank), during=what, error=first)
            raise RunFailed(
                f"worker rank {rank} died during {what}: {first}", Failure(FailureKind.DIED, rank)
            ) from None
        except ray.exceptions.RayTaskError as e:
            cause = str(e.cause) if e.cause is not None else str(e)
            self.event(EventKind.WORKER_ERROR, rank=rank, node=self.node(rank), during=what, error=cause)
            raise RunFailed(
                f"worker rank {rank} raised during {what}: {cause}", Failure(FailureKind.RAISED, rank, e.cause)
            ) from None
