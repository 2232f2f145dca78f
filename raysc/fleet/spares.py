"""``WarmSpares``: the replacement workers a fleet keeps warm (``supervisor.warm_spares``).

A set of spares starts in the background, one in the bundle of each rank, holding no resources of
its own; on CPU (``supervisor.prepare_spares``) the spares also set up at once, in a process group of
their own. A restart takes them over when every one of them answers; else they are killed and a cold
fleet starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

from raysc.config.schema import Config
from raysc.fleet.events import EventKind
from raysc.fleet.messages import WorkerInfo


class WarmSpares:
    """The current set of spares (``workers``) and their setup calls (``setup``) when prepared;
    ``new_worker(rank)`` creates a spare in the bundle of ``rank``."""

    def __init__(self, cfg: Config, event: Callable[..., dict], new_worker: Callable[[int], object]) -> None:
        self.cfg = cfg
        self.event = event
        self.new_worker = new_worker
        self.workers: list = []  # warm replacement workers
        self.setup: list = []  # their setup calls (ObjectRefs of WorkerInfo) when prepared

    @property
    def world(self) -> int:
        return self.cfg.parallel.world_size

    def _all_answer(self, refs: list, extra_s: float = 0.0) -> bool:
        """Whether every call of ``refs`` returns within supervisor.start_timeout_s (+ ``extra_s``); the
        first error (a spare died: its node was lost) ends the wait."""
        pending, deadline = list(refs), time.monotonic() + self.cfg.supervisor.start_timeout_s + extra_s
        try:
            while pending:
                ready, pending = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    return False
                ray.get(ready)
        except ray.exceptions.RayError:
            return False
        return True

    def take(self, cfg_dict: dict) -> tuple[list, list[WorkerInfo] | None] | None:
        """The warm spares, if every one of them is alive and ready, with their ``WorkerInfo``s when
        they were prepared (``ensure``: then they take the run's current config, whose injected
        faults that fired are gone, here); else None (they are discarded and a cold fleet starts)."""
        spares, prepared, self.workers, self.setup = self.workers, self.setup, [], []
        if len(spares) == self.world and self._all_answer(
            prepared or [s.address.remote() for s in spares], extra_s=60 if prepared else 0.0
        ):
            if not prepared:
                return spares, None
            if self._all_answer([s.activate.remote(cfg_dict) for s in spares]):
                return spares, ray.get(prepared)
        for s in spares:
            ray.kill(s, no_restart=True)
        return None

    def take_some(self, ranks: list[int]) -> dict[int, object]:
        """The spares in the bundles of ``ranks``, for a peer heal that replaces those ranks alone, that
        answer (prepared: their set-up is done); each leaves its spares' process group. The rest of the
        set is killed (its process group lost members): ``ensure`` starts a new set after the next
        chunk of training."""
        spares, prepared, self.workers, self.setup = self.workers, self.setup, [], []
        taken: dict[int, object] = {}
        if len(spares) == self.world:
            probes = {r: prepared[r] if prepared else spares[r].address.remote() for r in ranks}
            ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=0.5)
            for r, probe in probes.items():
                try:
                    if probe in ready and ray.get(probe) is not None:
                        taken[r] = spares[r]
                except ray.exceptions.RayError:
                    pass
        kept = {id(s) for s in taken.values()}
        for s in spares:
            if id(s) not in kept:
                ray.kill(s, no_restart=True)
        if prepared:
            for spare in taken.values():
                spare.detach.remote(False)  # leaves its own group before the run's set-up (calls run in order)
        return taken

    def ensure(self, data: dict | None, cfg_dict: Callable[[], dict]) -> None:
        """Start the next set of warm spares in the background, unless a set is up. On CPU
        (``supervisor.prepare_spares``, once the run's ``data`` is known) they are also prepared: they
        join a process group of their own and build their shards now (``setup``, with ``cfg_dict()``),
        so that a restart only restores the checkpoint into them. (A GPU spare gets its device, the
        failed worker's, only when it takes over: it stops at its imports.)"""
        if self.cfg.supervisor.warm_spares and not self.workers:
            self.workers = [self.new_worker(rank) for rank in range(self.world)]
            self.setup = []
            if data is not None and self.cfg.supervisor.prepare_spares and self.cfg.parallel.device == "cpu":
                # every spare's address, resolved by Ray before each setup runs: the rendezvous (spare rank 0
                # waits supervisor.start_timeout_s for its peers) starts once every spare is up, as in ``start``
                up = [s.address.remote() for s in self.workers]
                self.setup = [s.setup.remote(up[0], data, cfg_dict(), None, None, *up[1:]) for s in self.workers]
            refs = self.setup or [s.address.remote() for s in self.workers]
            threading.Thread(
                target=self._announce, args=(refs, time.monotonic()), daemon=True, name="spares-ready"
            ).start()

    def _announce(self, refs: list, t0: float) -> None:
        """``spares_ready`` once every spare of this set answers (``refs``: their addresses, or their
        setups when prepared), whether or not a restart has taken them meanwhile (benchmarks measure
        the steady state from there; nothing waits on it)."""
        if not self._all_answer(refs, extra_s=60):
            return  # not up in time, or a spare died: ``take`` discards them (a cold fleet starts)
        try:
            self.event(
                EventKind.SPARES_READY,
                spares=len(refs),
                seconds=round(time.monotonic() - t0, 2),
                prepared=isinstance(ray.get(refs[0]), WorkerInfo),
            )
        except ValueError:
            pass  # the run's records were closed meanwhile

    def kill(self) -> None:
        """Kill the current set of spares."""
        for s in self.workers:
            ray.kill(s, no_restart=True)
        self.workers, self.setup = [], []
