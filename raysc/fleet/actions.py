"""What the supervisor does about a failure: ``classify(failure) -> Action``, a pure table lookup.

- a loss spike (``SpikeRollback`` raised by every rank) rolls back to the checkpoint before it;
- replicas that disagree (``SilentCorruption``) are repaired from the majority (or rolled back);
- checkpoint storage that keeps refusing saves ends the run (a restart would meet the same store);
- anything else (a dead, hung, slow or raising worker) restarts the fleet from the newest checkpoint.

Restarts and rollbacks are bounded by ``supervisor.max_restarts`` without progress (``Healer``).
"""

from __future__ import annotations

from enum import Enum

from raysc.fleet.errors import Failure, FailureKind
from raysc.train.signals import SilentCorruption
from raysc.train.stability import SpikeRollback


class Action(str, Enum):
    RESTART = "restart"  # replace the whole fleet, restore the newest checkpoint
    ROLLBACK = "rollback"  # restore the checkpoint before a spike in place, skip data
    REPAIR = "repair"  # restore corrupted replicas from healthy ones (or roll back)
    FATAL = "fatal"  # stop the run


BY_KIND: dict[FailureKind, Action] = {FailureKind.STORAGE: Action.FATAL}
BY_CAUSE: tuple[tuple[type[BaseException], Action], ...] = (
    (SpikeRollback, Action.ROLLBACK),
    (SilentCorruption, Action.REPAIR),
)


def classify(failure: Failure | None) -> Action:
    """The action for ``failure`` (None: a failure with no account, e.g. from the driver side)."""
    if failure is None:
        return Action.RESTART
    if failure.kind in BY_KIND:
        return BY_KIND[failure.kind]
    for cause, action in BY_CAUSE:
        if isinstance(failure.cause, cause):
            return action
    return Action.RESTART
