"""Fault injection (``supervisor.inject``): make a worker fail on purpose, for drills and tests.

``KIND@STEP[:RANK]`` makes worker ``RANK`` (default 0) fail just before it runs
optimizer step ``STEP`` (``STEP`` = ``train.steps + 1``: at the start of the final validation,
after the last step and its checkpoint); ``/PHASE`` moves a raise, kill, hang, slow or node_loss
inside the step (``raysc.config.faults.PHASES``, fired from the trainer's ``phase_hook``):
- ``raise``: an exception inside the step;
- ``kill``: the worker process gets SIGKILL (as when the OOM killer or a node dies);
- ``hang``: the worker process stops itself with SIGSTOP (a stuck collective or driver);
- ``nan``: that step's loss (and so its gradients) becomes NaN on that rank;
- ``spike``: that step's loss is multiplied by 1000 on that rank (a loss and grad-norm spike);
- ``bitflip``: one bit of that rank's first parameter shard is flipped (silent data corruption;
  found by the next ``supervisor.sdc_every_steps`` check);
- ``slow``: that rank sleeps ``SLOW_S`` seconds before the step (a straggler);
- ``kill_save``: SIGKILL halfway through uploading the checkpoint of step ``STEP`` (after its
  first file), to prove a half-written checkpoint is never loaded;
- ``slow_upload``: that rank's upload of the checkpoint of step ``STEP`` is held ``SLOW_UPLOAD_S``
  seconds before it starts (a slow link, a multi-GB shard), so that the save is still in flight
  when a later fault fires: the drill for a failure during an asynchronous save;
- ``node_loss``: the whole Ray node hosting that rank dies: its raylet gets SIGKILL, and with it
  every worker and object on that node (a spot reclaim, a kernel panic). Real on a multi-node
  cluster (``raysc cluster local up``); on a single-node cluster it kills the only node.
- ``disk_loss``: that rank's node loses every node-local checkpoint copy (a replaced disk, a
  re-imaged VM); nothing fails, but the next restore must come from the hot copy in Ray's object
  store or from the store. A save being staged on that node at that moment fails (and is retried
  at the next checkpoint step).

The spec's syntax and the list of kinds are parsed in config (``raysc.config.faults``), which
checks them when the config loads.

``FaultInjector`` holds one rank's faults and fires them from three hooks (the worker hangs the
first two on its ``Trainer``, so they run inside the step and its timing):
``before_step`` (raise, kill, hang, slow, bitflip, node_loss, disk_loss; arms nan/spike),
``after_loss`` (the armed loss factor, applied by the ``Trainer``'s loss hook) and
``before_upload`` (slow_upload) and ``on_file_written`` (kill_save), from the upload path. Nothing else in the training code knows
about faults.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from raysc.config.faults import Fault, parse_faults
from raysc.train.sdc import flip_bit

SLOW_S = 3.0
SLOW_UPLOAD_S = 30.0  # far longer than the few steps a drill needs to fire its next fault
LOSS_FAULTS = {"nan": float("nan"), "spike": 1000.0}  # factor applied to that step's loss (and so its grads)


class InjectedFault(RuntimeError):
    """The exception the ``raise`` fault throws inside a training step."""


def fire(fault: Fault, local_copies: Path | None = None) -> None:
    """Carry out ``fault`` in the calling process (``local_copies``: this node's checkpoint copies,
    which ``disk_loss`` deletes)."""
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault {fault.spec}")
    if fault.kind in ("kill", "kill_save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault.kind == "slow":
        time.sleep(SLOW_S)
    if fault.kind == "disk_loss" and local_copies is not None:
        shutil.rmtree(local_copies, ignore_errors=True)
    if fault.kind == "node_loss":
        os.kill(raylet_pid(), signal.SIGKILL)
        time.sleep(60)  # this process goes down with its node


def raylet_pid(pid: int | None = None) -> int:
    """The raylet this process descends from (Ray's node manager starts its workers)."""
    pid = pid or os.getpid()
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if name == "raylet":
            return pid
        pid = int(rest[1])  # the parent
    raise RuntimeError("node_loss: this process does not run under a Ray raylet")


class FaultInjector:
    """The faults of ``spec`` for ``rank``, fired at the worker's hooks. ``announce(fault)`` is
    called (and returns) before a fault fires, so the supervisor records it first."""

    def __init__(
        self, spec: str, rank: int, announce: Callable[[Fault], None], local_copies: Path | None = None
    ) -> None:
        mine = [f for f in parse_faults(spec) if f.rank == rank]
        self._step_faults = {
            f.step: f for f in mine if f.kind not in ("kill_save", "slow_upload") and f.phase == "start"
        }
        self._phase_faults = {(f.step, f.phase): f for f in mine if f.phase != "start"}
        self._save_faults = {f.step: f for f in mine if f.kind == "kill_save"}
        self._upload_holds = {f.step: f for f in mine if f.kind == "slow_upload"}
        self._announce = announce
        self._local_copies = local_copies
        self._loss_factor: float | None = None  # armed by a nan/spike fault for one step

    def before_step(self, step: int, params: Sequence[torch.Tensor]) -> None:
        """Before optimizer step ``step``: fire this step's fault, or arm its loss factor."""
        self._loss_factor = None
        fault = self._step_faults.pop(step, None)
        if fault is None:
            return
        self._announce(fault)
        if fault.kind in LOSS_FAULTS:
            self._loss_factor = LOSS_FAULTS[fault.kind]
        elif fault.kind == "bitflip":
            flip_bit(params[0])
        else:
            fire(fault, self._local_copies)

    def at_phase(self, step: int, phase: str) -> None:
        """Inside optimizer step ``step``, at ``phase`` (``raysc.config.faults.PHASES``): fire its fault."""
        fault = self._phase_faults.pop((step, phase), None)
        if fault is not None:
            self._announce(fault)
            fire(fault, self._local_copies)

    def after_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A training loss of the current step, times the armed factor (unchanged when none is)."""
        return loss if self._loss_factor is None else loss * self._loss_factor

    def after_step(self) -> None:
        """The step is over: a loss factor applies to one step only (not to validation)."""
        self._loss_factor = None

    def before_upload(self, step: int) -> None:
        """In the upload thread of checkpoint ``step``, before its first file: a slow_upload fault
        holds the upload SLOW_UPLOAD_S seconds (announced first, so a restart does not repeat it)."""
        fault = self._upload_holds.pop(step, None)
        if fault is not None:
            self._announce(fault)
            time.sleep(SLOW_UPLOAD_S)

    def on_file_written(self, step: int) -> Callable[[str], None] | None:
        """The upload path's per-file callback for checkpoint ``step``: a kill_save fault fires after
        the first file (None when there is none)."""
        fault = self._save_faults.pop(step, None)
        if fault is None:
            return None
        return lambda name: (self._announce(fault), fire(fault))
