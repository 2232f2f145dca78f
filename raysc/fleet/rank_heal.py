"""``RankHeal``: one rank's part of a peer heal (``raysc.fleet.peer_healing`` drives it).

A survivor whose step failed because a peer was lost keeps its process and its state: it undoes the
interrupted step (``Trainer.discard_partial_step``), takes its state out of the trainer as plain
tensors (``raysc.train.peer_state.hold``), and leaves its broken process groups. (That does not close
its gloo sockets while torch still holds the groups: a rank waiting on it keeps waiting, and the
supervisor replaces that rank too, ``raysc.fleet.peer_healing``.) On ``regroup`` it
joins the new process group, rebuilds its trainer without drawing weights and puts its state back.
A replacement rank sets up like any worker (``init_weights=False``) and then receives the state of
a surviving replica of its shard in ``transfer``: the small state through Ray, the tensors by
broadcast over the replica group.

gloo cannot abort a communicator, so leaving a group is ``destroy_process_group`` after the error,
and re-forming it is a new rendezvous; with NCCL torch's ``abort`` path would apply (not verified
here: this machine has no GPU).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from raysc.fleet.messages import WorkerInfo
from raysc.fleet.watch import is_peer_failure
from raysc.train.peer_state import HeldState, broadcast_state, hold, install

if TYPE_CHECKING:
    from raysc.fleet.rank import RankWorker


def peer_failed(exc: BaseException) -> bool:
    """Whether a step failed in a collective because a peer went away (torch's error, in this process)."""
    return isinstance(exc, dist.DistError) or is_peer_failure(exc)


class RankHeal:
    def __init__(self, worker: RankWorker) -> None:
        self.worker = worker
        self.held: HeldState | None = None  # this survivor's state between its failure and ``regroup``
        self.kept: HeldState | None = None  # its state without tensors after ``regroup``, for ``small_state``
        self.discarded = False  # the failed step was under way and was undone
        self._flags: list[int] = []  # the stop / checkpoint requests its vote carried
        self.leave_s = 0.0

    def leave(self) -> None:
        """After a peer failure: undo the step under way, hold the state, drop the trainer and leave
        every process group (its sockets close, so its peers' collectives fail now too)."""
        w = self.worker
        if w.trainer is None or self.held is not None:
            return
        t0 = time.perf_counter()
        w._flush_reports()
        self.discarded = w.trainer.discard_partial_step()
        self.held = hold(w.trainer)
        self._flags = list(w.vote.flags) if w.vote is not None else []
        if w.memory is not None:
            w.memory.close()
        halt = getattr(w.trainer.loader, "_halt", None)
        if halt is not None:
            halt()
        w.trainer = w.memory = w.vote = None
        w.checkpoints.group = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self.leave_s = time.perf_counter() - t0

    def prepare(self) -> dict:
        """The survivor's account: the step its state is at (every survivor must agree), whether it undid
        a step, its newest metrics. Leaves its groups first if its step had not failed (a chunk that
        ended before the peer was lost)."""
        self.leave()
        w = self.worker
        return {
            "rank": w.rank,
            "step": int(self.held.extra["step"]),
            "discarded": self.discarded,
            "recent": list(w.recent),
            "bytes": self.held.nbytes,
            "leave_s": round(self.leave_s, 4),
        }

    def small_state(self) -> HeldState:
        """This survivor's state without its tensors, for the rank that replaces its lost replica."""
        return (self.held or self.kept).small()

    def regroup(self, master: tuple[str, int]) -> WorkerInfo:
        """Join the new process group and rebuild the trainer around the held state."""
        w, held = self.worker, self.held
        t = [time.perf_counter()]
        w.join(master)
        t.append(time.perf_counter())
        w.build(init_weights=False)
        install(w.trainer, held)
        t.append(time.perf_counter())
        w.side_groups(self._flags)
        self.held, self.kept = None, held.small()
        self.discarded = False
        return w.info(master, ("process_group", "model", "side_groups"), t)

    def transfer(self, sources: dict[int, int], small: HeldState | None) -> dict:
        """Inside each replica group that lost a rank, the surviving source broadcasts its state to the
        replacement (``sources``: lost global rank -> the survivor sending its state); ``small``, for a
        replacement, is that survivor's state without tensors. Returns the bytes this rank sent."""
        w = self.worker
        replicas = w.trainer.replicas
        lost = [r for r in replicas.ranks if r in sources]
        if not lost:
            return {"rank": w.rank, "sent": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        if small is not None:
            install(w.trainer, small)
        src = sources[lost[0]]
        n = broadcast_state(w.trainer, src, replicas.group)
        return {"rank": w.rank, "sent": n if w.rank == src else 0, "seconds": round(time.perf_counter() - t0, 4)}
