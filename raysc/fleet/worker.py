"""``TrainWorker``: the Ray actor that owns one model shard and runs training steps.

Each method is a call the supervisor (or the checkpoint coordinator) makes to one rank; the work
is ``raysc.fleet.rank.RankWorker``'s, imported inside the actor's own process. This module imports
neither torch nor the model, so that the supervisor, which must hold this class to create workers,
starts without them (on a 2-core machine that is ~4 s of every run's start, and a core's worth of
imports while the workers start).

An exception whose class only the worker's imports know (torch's) reaches the supervisor as a
``RankError`` with its class name and message (``raysc.fleet.errors.portable``).

``max_concurrency=2``: a second thread serves ``save_wait``, ``save_pending`` and ``request`` while
``train`` runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from raysc.fleet.errors import portable

if TYPE_CHECKING:
    from raysc.fleet.messages import WorkerInfo


@ray.remote(max_concurrency=2)
class TrainWorker:
    def __init__(self, cfg_dict: dict, rank: int, world_size: int, supervisor: ray.actor.ActorHandle) -> None:
        from raysc.fleet.rank import RankWorker

        self._rank = RankWorker(cfg_dict, rank, world_size, supervisor)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._rank, method)(*args)
        except Exception as e:
            raise portable(e) from None

    def address(self) -> tuple[str, int, str]:
        return self._call("address")

    def setup(self, master: tuple[str, int], data: dict, cfg_dict: dict | None = None,
              gpu_ids: list | None = None) -> WorkerInfo:
        return self._call("setup", master, data, cfg_dict, gpu_ids)

    # ---- checkpoints ----
    def fetch(self, uri: str, step: int, hot: dict | None) -> dict:
        return self._call("fetch", uri, step, hot)

    def load(self, uri: str, step: int) -> int:
        return self._call("load", uri, step)

    def save_start(self, step: int) -> dict:
        return self._call("save_start", step)

    def read_file(self, step: int, name: str) -> bytes:
        return self._call("read_file", step, name)

    def save_wait(self) -> dict:
        return self._call("save_wait")

    def save_pending(self) -> bool:
        return self._call("save_pending")

    # ---- training ----
    def request(self, kind: str) -> None:
        self._call("request", kind)

    def train(self, until_step: int) -> dict | None:
        return self._call("train", until_step)

    def skip_batches(self, n: int) -> int:
        return self._call("skip_batches", n)

    def val_loss(self) -> float | None:
        return self._call("val_loss")

    # ---- silent data corruption ----
    def sdc_verdict(self) -> dict:
        return self._call("sdc_verdict")

    def sdc_repair(self) -> bool:
        return self._call("sdc_repair")

    def sdc_check(self) -> dict:
        return self._call("sdc_check")

    # ---- timeouts, pre-flight ----
    def measure_collectives(self, iters: int = 5) -> dict:
        return self._call("measure_collectives", iters)

    def probe(self, nbytes: int) -> dict:
        return self._call("probe", nbytes)

    def set_timeout(self, seconds: float) -> None:
        self._call("set_timeout", seconds)

    def stress(self, seconds: float) -> dict:
        return self._call("stress", seconds)

    def shutdown(self) -> None:
        self._call("shutdown")
