"""``TrainWorker``: the Ray actor that owns one model shard and runs training steps.

Each method is a call the supervisor (or the checkpoint coordinator) makes to one rank; the work
is ``raysc.fleet.rank.RankWorker``'s, imported inside the actor's own process. This module imports
neither torch nor the model, so that the supervisor, which must hold this class to create workers,
starts without them (on a 2-core machine that is ~4 s of every run's start, and a core's worth of
imports while the workers start).

An exception whose class only the worker's imports know (torch's) reaches the supervisor as a
``RankError`` with its class name and message (``raysc.fleet.errors.portable``).

Two concurrency groups. Every call that runs torch (setup, train, checkpoint staging and loading,
calibration) is in Ray's default group, one thread, so it always runs on the same thread: on the
threaded actor this was before (``max_concurrency=2``) each call went to whichever of two threads was
free, and a run whose steps came on a thread other than the one before trained the tiny config at
12.4k tokens/s against 17.3k on one thread (the plain ``Trainer`` loop in an actor, 2 torch threads,
2 cores). A living thread that has run a parallel torch op keeps an OpenMP team, and libgomp waits less
eagerly once it manages more threads than there are CPUs; ``RankWorker.setup`` therefore gives every
thread but the training one a single intra-op thread (``raysc.train.cpu_threads``). ``side`` (two threads)
serves what must answer while ``train`` runs: ``save_wait``, ``save_pending``, ``request``,
``read_file`` (the hot copy of a save still uploading) and ``address``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from raysc.fleet.errors import portable

if TYPE_CHECKING:
    from raysc.fleet.messages import WorkerInfo


def _portably(method: Callable[..., Any], *args: Any) -> Any:
    """``method(*args)``, re-raising what it raises as the supervisor can unpickle it."""
    try:
        return method(*args)
    except Exception as e:
        raise portable(e) from None


@ray.remote(concurrency_groups={"side": 2})
class TrainWorker:
    def __init__(
        self,
        cfg_dict: dict | None = None,
        rank: int = 0,
        world_size: int = 1,
        supervisor: ray.actor.ActorHandle | None = None,
    ) -> None:
        """A run's rank; without a config, a pooled process (``raysc.fleet.pool``) that has done its
        imports and takes a rank in ``setup``."""
        from raysc.fleet.rank import RankWorker

        self._rank = RankWorker(cfg_dict, rank, world_size, supervisor) if cfg_dict is not None else None

    @ray.method(concurrency_group="side")
    def address(self) -> tuple[str, int, str]:
        from raysc.fleet.rank import rendezvous_address

        return _portably(rendezvous_address)

    def setup(
        self,
        master: tuple[str, int],
        data: dict,
        cfg_dict: dict | None = None,
        gpu_ids: list | None = None,
        attach: tuple[int, int, ray.actor.ActorHandle] | None = None,
        *peers_up: Any,
        init_weights: bool = True,
    ) -> WorkerInfo:
        """Join the run's process group and build the shard; ``attach`` = (rank, world size,
        supervisor) gives a pooled process its rank first. ``peers_up``: unused; passed as object refs
        (the peers' ``address`` calls), which Ray resolves before this call runs, they hold it back until
        every peer's process is up. ``init_weights=False``: a peer heal's replacement, whose state comes
        from a replica (``heal_transfer``)."""
        if attach is not None:
            from raysc.fleet.rank import RankWorker

            self._rank = _portably(RankWorker, cfg_dict, *attach)
            cfg_dict = None  # (configured just now)
        return _portably(self._rank.setup, master, data, cfg_dict, gpu_ids, init_weights)

    def activate(self, cfg_dict: dict) -> None:
        """A prepared warm spare takes over a failed fleet's rank (``RankWorker.activate``)."""
        _portably(self._rank.activate, cfg_dict)

    def detach(self, collect: bool = True) -> bool:
        """Leave the run (process groups, model, threads) so that the pool can lend this process again;
        ``collect=False`` skips the garbage collection (a spare taking over a rank at once)."""
        rank, self._rank = self._rank, None
        if rank is not None:
            _portably(rank.detach, collect)
        return True

    # ---- checkpoints ----
    def fetch(self, uri: str, step: int, hot: dict | None) -> dict:
        return _portably(self._rank.fetch, uri, step, hot)

    def load(self, uri: str, step: int) -> int:
        return _portably(self._rank.load, uri, step)

    def save_start(self, step: int) -> dict:
        return _portably(self._rank.save_start, step)

    @ray.method(concurrency_group="side")
    def read_file(self, step: int, name: str) -> bytes:
        return _portably(self._rank.read_file, step, name)

    @ray.method(concurrency_group="side")
    def save_wait(self) -> dict:
        return _portably(self._rank.save_wait)

    @ray.method(concurrency_group="side")
    def save_pending(self) -> bool:
        return _portably(self._rank.save_pending)

    # ---- training ----
    @ray.method(concurrency_group="side")
    def request(self, kind: str) -> None:
        _portably(self._rank.request, kind)

    def train(self, until_step: int) -> dict | None:
        return _portably(self._rank.train, until_step)

    def skip_batches(self, n: int) -> int:
        return _portably(self._rank.skip_batches, n)

    def val_loss(self) -> float | None:
        return _portably(self._rank.val_loss)

    # ---- peer healing (raysc.fleet.rank_heal) ----
    def heal_prepare(self) -> dict:
        return _portably(self._rank.heal.prepare)

    def heal_small_state(self) -> Any:
        return _portably(self._rank.heal.small_state)

    def heal_regroup(self, master: tuple[str, int]) -> WorkerInfo:
        return _portably(self._rank.heal.regroup, master)

    def heal_transfer(self, sources: dict[int, int], small: Any = None) -> dict:
        return _portably(self._rank.heal.transfer, sources, small)

    # ---- silent data corruption ----
    def sdc_verdict(self) -> dict:
        return _portably(self._rank.sdc_verdict)

    def sdc_repair(self) -> bool:
        return _portably(self._rank.sdc_repair)

    def sdc_check(self) -> dict:
        return _portably(self._rank.sdc_check)

    # ---- timeouts, pre-flight ----
    def measure_collectives(self, iters: int = 5) -> dict:
        return _portably(self._rank.measure_collectives, iters)

    def probe(self, nbytes: int) -> dict:
        return _portably(self._rank.probe, nbytes)

    def set_timeout(self, seconds: float) -> None:
        _portably(self._rank.set_timeout, seconds)

    def stress(self, seconds: float) -> dict:
        return _portably(self._rank.stress, seconds)

    def shutdown(self) -> None:
        _portably(self._rank.shutdown)
