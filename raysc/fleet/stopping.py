"""Stopping a run, or asking it for a checkpoint, at a step boundary every rank agrees on.

A request (``stop``, or ``checkpoint`` now) reaches each worker as an actor call
served by its second thread while ``train`` runs, so ranks see it at different
steps; acting on it at once would leave some ranks waiting in a collective for
the others. Instead every rank votes once per step: ``StepVote.poll`` starts an
asynchronous all-reduce (MAX) of the rank's request flags over a process group
of its own and reads it at the next boundary, so the vote overlaps a step and
all ranks read the same result after the same step. The step in flight is
always finished, never abandoned. A single rank needs no vote.

``raysc ckpt now RUN_DIR`` asks through a file (``REQUEST_FILE``) in the run
directory, which the driver polls; the driver's SIGUSR1 handler does the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the vote runs, not by `raysc ckpt now` (request_checkpoint)
    import torch
    import torch.distributed as dist

KINDS = ("stop", "checkpoint")  # in priority order: a stop writes a checkpoint anyway
REQUEST_FILE = "ckpt_now.request"


class StepVote:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        """``group``: a process group used for nothing else (None on a single rank)."""
        self.group = group
        self.flags = [0] * len(KINDS)  # set by ``request`` from the worker's other thread
        self._ballot: torch.Tensor | None = None
        self._work = None

    def request(self, kind: str) -> None:
        self.flags[KINDS.index(kind)] = 1

    def poll(self) -> str | None:
        """Call at every step boundary on every rank: the request all ranks act on now, or None.
        A decided request is cleared (on every rank, since every rank decided it)."""
        if self.group is None:
            decided = list(self.flags)
        else:
            decided = self._drain()
        for i, kind in enumerate(KINDS):
            if decided[i]:
                for j in range(i, len(KINDS)):  # a stop also answers a checkpoint request
                    self.flags[j] = 0
                return kind
        if self.group is not None:
            import torch
            import torch.distributed as dist

            self._ballot = torch.tensor(self.flags, dtype=torch.int64)
            self._work = dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return None

    def _drain(self) -> list[int]:
        """Wait for the vote in flight; its result (no request when none was in flight)."""
        if self._work is None:
            return [0] * len(KINDS)
        self._work.wait()
        result, self._ballot, self._work = self._ballot.tolist(), None, None
        return result

    def finish(self) -> None:
        """At the end of a chunk of steps: complete the vote in flight (every rank started it). Its
        result is dropped; the requests stay set and the next chunk's first vote carries them."""
        self._drain()


def request_checkpoint(run_dir: str | Path) -> Path:
    """Ask the run in ``run_dir`` (its driver polls the file every second) for a checkpoint at the
    next step boundary. Returns the request file."""
    from raysc.fleet.status import run_status

    rd = Path(run_dir)
    state = run_status(rd)["state"]  # FileNotFoundError when it is not a run directory
    if state != "running":
        raise ValueError(f"the run in {rd} is {state}: there is nothing to checkpoint")
    path = rd / REQUEST_FILE
    path.write_text("checkpoint\n")
    return path


def take_request(run_dir: str | Path) -> bool:
    """Whether a checkpoint was asked for through the request file (which is removed)."""
    path = Path(run_dir) / REQUEST_FILE
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
