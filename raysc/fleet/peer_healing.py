"""``PeerHealer``: heal a lost rank from a surviving data-parallel replica (``supervisor.peer_heal``).

When a rank dies or raises during a chunk of training steps and a surviving rank holds a replica of
its shard (the ranks that differ only in ``dp_replicate``), only the lost rank is replaced. In order:

0. **culprit** of a hang (or of a collective that timed out): the ranks whose process does not answer
   (stopped, or stuck outside Python);
1. **drain**: the lost rank is killed (a raising one is alive: its sockets must close); every other
   rank's step then fails in its next collective and the rank leaves its process groups
   (``raysc.fleet.rank_heal``). A rank whose collective waits on a survivor that has left (HSDP: a
   shard peer of the lost rank) does not fail, because gloo cannot abort: after ``STUCK_S`` it is
   replaced too, when a rank that left holds its shard (plain DP: always), else the heal is refused;
2. **cover**: each lost rank needs a survivor with the same coordinates but ``dp_replicate``;
3. **decide**: each survivor undoes the step it had under way; all must stand at the same step T
   (a survivor that applied an update another lost is the mixed case: the checkpoint restart runs);
4. **salvage**: a save in flight finishes on the survivors and is committed or abandoned as usual;
5. **replace** (before 3, so that a spare leaves its own group meanwhile): a warm spare of the lost rank's bundle (``WarmSpares.take_one``), else a new worker;
6. **regroup**: survivors re-join a new process group in their processes and rebuild their trainer
   around the state they held; replacements set up without drawing weights;
7. **transfer**: the survivor's state goes to the replacement, tensors by broadcast over the replica
   group, the rest through Ray.

Training then goes on from T: the interrupted step runs again, so the run stays bit-equal to an
uninterrupted one and no step is lost. Anything that does not fit (no peer for a shard, a layout
with tp/pp/cp, a node loss, a failure outside a training step, a heal step that fails) raises
``PeerHealRefused`` with the reason, and ``Healer`` restarts from the newest checkpoint instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from raysc.config.faults import consume_faults
from raysc.config.schema import Config
from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.errors import FailureKind, RunFailed
from raysc.fleet.events import EventKind
from raysc.fleet.fleet import Fleet
from raysc.fleet.nodes import raylet_answers
from raysc.fleet.start_bound import START_BOUND
from raysc.fleet.stats import RunStats
from raysc.fleet.watch import call_outcome, is_peer_failure

STUCK_S = 2.0  # how long survivors get to leave the step a lost peer broke
PROBE_S = 1.0  # how long a rank's process gets to answer after a hang (a stopped one never does)
UPLOAD_WAIT_S = 60.0  # how long survivors' uploads of a save in flight get to finish


class PeerHealRefused(RuntimeError):
    """A peer heal does not apply, or failed part-way: the message says why (the checkpoint restart runs)."""


class PeerHealer:
    def __init__(
        self,
        cfg: Config,
        fleet: Fleet,
        ckpt: CheckpointCoordinator,
        stats: RunStats,
        event: Callable[..., dict],
        wait: Callable[..., list],
        report: Callable[[list[dict]], None],
        fired: Callable[[], set[str]],
    ) -> None:
        self.cfg, self.fleet, self.ckpt, self.stats = cfg, fleet, ckpt, stats
        self.event, self.wait, self.report, self.fired = event, wait, report, fired

    def why_not(self, err: RunFailed) -> str | None:
        """Why ``err`` cannot be healed from a peer (None: it can be tried)."""
        dims, f = self.cfg.parallel.dims, err.failure
        if dims.dp_replicate < 2:
            return "parallel.dp_replicate=1: no rank holds a replica of another's state"
        if dims.tp > 1 or dims.pp > 1 or dims.cp > 1:
            return "peer healing covers plain data parallelism and HSDP so far (this run has tp/pp/cp > 1)"
        if self.fleet.train_calls is None:
            return "the failure was outside a chunk of training steps"
        if f is None or f.rank is None or f.kind not in (FailureKind.DIED, FailureKind.RAISED, FailureKind.HUNG):
            return f"a {f.kind.value if f else 'untyped'} failure (peer healing covers dead, raising and hung ranks)"
        return None

    def heal(self, err: RunFailed, data: dict, attempt: int) -> int:
        """Replace the lost rank of ``err`` from its peer; the step training goes on from."""
        t0 = time.monotonic()
        phases: dict[str, float] = {}
        failed_at = self.stats.failed_step()
        workers, calls = list(self.fleet.workers), self.fleet.train_calls
        self.fleet.train_calls = None
        f = err.failure
        # a hang, or a collective that timed out (the symptom): the culprit is a rank whose process does not answer
        unnamed = f.kind is FailureKind.HUNG or (f.kind is FailureKind.RAISED and is_peer_failure(f.cause))
        lost = self._unresponsive(workers) if unnamed else {f.rank}
        self.event(
            EventKind.RECOVERY_START,
            attempt=attempt,
            failed_step=failed_at,
            error=str(err),
            healed_by="peer",
            ranks=sorted(lost),
        )
        self._nodes_alive(lost)
        lost |= self._drain(workers, calls, lost)
        phases["drain"] = time.monotonic() - t0
        survivors = [r for r in range(len(workers)) if r not in lost]
        sources = self._cover(lost, survivors)
        mark = time.monotonic()  # the replacements first: a spare leaves its own group while the survivors decide
        self.cfg.supervisor.inject = consume_faults(self.cfg.supervisor.inject, self.fired())
        new = list(workers)
        replacing, spares_used = self.fleet.replacements(sorted(lost))
        for r, w in replacing.items():
            new[r] = w
        phases["replace"] = time.monotonic() - mark
        mark = time.monotonic()
        self._finish_uploads(workers, survivors)
        self.ckpt.salvage(timeout_s=5.0, gone=lost)
        phases["salvage"] = time.monotonic() - mark
        mark = time.monotonic()
        accounts = self.wait(
            [workers[r].heal_prepare.remote() for r in survivors],
            "peer heal: survivors leave their process groups",
            timeout=30,
            ranks=survivors,
        )
        steps = {a["step"] for a in accounts}
        if len(steps) != 1:
            raise PeerHealRefused(f"the survivors stopped at different steps {sorted(steps)}")
        step = steps.pop()
        self._recover_reports(accounts, step, lost)
        phases["decide"] = time.monotonic() - mark
        mark = time.monotonic()
        infos = self._regroup(new, lost, data)
        phases["regroup"] = time.monotonic() - mark
        mark = time.monotonic()
        small = {r: new[sources[r]].heal_small_state.remote() for r in lost}
        sent = self.wait(
            [w.heal_transfer.remote(sources, small.get(r)) for r, w in enumerate(new)],
            "peer heal: state from the replicas",
            timeout=self.cfg.supervisor.start_timeout_s,
        )
        phases["transfer"] = time.monotonic() - mark
        self.fleet.workers, self.fleet.infos = new, infos
        self.ckpt.workers = new
        self.stats.peer_heals += 1
        seconds = round(time.monotonic() - t0, 3)
        self.event(
            EventKind.RECOVERED,
            attempt=attempt,
            healed_by="peer",
            resumed_step=step,
            steps_lost=max(0, failed_at - 1 - step),
            seconds=seconds,
            ranks_replaced=sorted(lost),
            sources={str(r): q for r, q in sources.items()},
            discarded=[a["rank"] for a in accounts if a["discarded"]],
            warm_spares=spares_used,
            bytes_moved=sum(s["sent"] for s in sent),
            phases_s={k: round(v, 3) for k, v in phases.items()},
            leave_s=max(a["leave_s"] for a in accounts),
            setup_s=[i.setup_s for i in infos],
            pids=[i.pid for i in infos],
        )
        return step

    def _drain(self, workers: list, calls: list, lost: set[int]) -> set[int]:
        """Kill the lost ranks, then wait for every other rank's training call to end; returns the ranks
        lost besides ``lost``. A rank found dead meanwhile is lost too; one that raised anything but a
        peer's failure refuses the heal. A rank still in its step after STUCK_S is waiting on a survivor
        that left the step (gloo cannot abort its collective, and torch keeps the left groups' sockets
        open once FSDP is imported): it is killed and replaced too when a rank that left holds its shard,
        else the heal is refused."""
        for r in lost:
            ray.kill(workers[r], no_restart=True)
        others = {calls[r]: r for r in range(len(workers)) if r not in lost}
        done, pending = ray.wait(list(others), num_returns=len(others), timeout=STUCK_S)
        more = self._outcomes(done, others)
        drained = {others[ref] for ref in done} - more
        stuck = {others[ref] for ref in pending}
        shard_of = self.cfg.parallel.dims.shard_of
        bare = sorted(r for r in stuck if not any(shard_of(q) == shard_of(r) for q in drained))
        if bare:
            raise PeerHealRefused(
                f"ranks {bare} were still in their step {STUCK_S:g}s after the loss, waiting in a collective "
                "on a rank that had left it (gloo cannot abort one), and no other replica of their shard left "
                "its step to replace them from"
            )
        for r in stuck:
            ray.kill(workers[r], no_restart=True)
        return more | stuck

    def _nodes_alive(self, lost: set[int]) -> None:
        """Refuse when a lost rank's node is gone (its raylet does not answer): its bundle must be placed
        again, which the checkpoint restart does (``Healer._lost_nodes``)."""
        for r in sorted(lost):
            if r < len(self.fleet.infos) and not raylet_answers(self.fleet.infos[r].node_id):
                raise PeerHealRefused(f"rank {r}'s node is lost: its bundle must be placed again")

    @staticmethod
    def _unresponsive(workers: list) -> set[int]:
        """After a hang: the ranks whose process does not answer within PROBE_S (stopped, or stuck outside
        Python); the others wait in a collective on them. None refuses the heal (a deadlock among
        responsive ranks has no culprit to replace)."""
        probes = {w.address.remote(): r for r, w in enumerate(workers)}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=PROBE_S)
        silent = {r for ref, r in probes.items() if ref not in ready}
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                silent.add(probes[ref])
        if not silent:
            raise PeerHealRefused("every rank's process answers: the hang has no culprit to replace")
        return silent

    @staticmethod
    def _outcomes(done: list, rank_of: dict) -> set[int]:
        """The ranks of ``done`` calls whose worker died; a call that failed otherwise than on a peer's
        failure refuses the heal."""
        dead = set()
        for ref in done:
            out = call_outcome(ref)
            if out == "dead":
                dead.add(rank_of[ref])
            elif out == "error" or (isinstance(out, BaseException) and not is_peer_failure(out)):
                raise PeerHealRefused(f"rank {rank_of[ref]} failed too: {out}")
        return dead

    def _cover(self, lost: set[int], survivors: list[int]) -> dict[int, int]:
        """The survivor that sends each lost rank its state: the lowest with the same shard."""
        sources, shard_of = {}, self.cfg.parallel.dims.shard_of
        for r in sorted(lost):
            peers = [q for q in survivors if shard_of(q) == shard_of(r)]
            if not peers:
                raise PeerHealRefused(f"no surviving replica holds rank {r}'s shard")
            sources[r] = peers[0]
        return sources

    def _finish_uploads(self, workers: list, survivors: list[int]) -> None:
        """Let the survivors' uploads of a save in flight end (committed or abandoned by ``salvage``
        next), so that no upload thread writes into an abandoned step or runs through a regroup."""
        if self.ckpt.inflight is None:
            return
        deadline = time.monotonic() + UPLOAD_WAIT_S
        while any(ray.get([workers[r].save_pending.remote() for r in survivors])):
            if time.monotonic() > deadline:
                raise PeerHealRefused(f"a survivor's checkpoint upload did not end within {UPLOAD_WAIT_S:g}s")
            time.sleep(0.05)

    def _recover_reports(self, accounts: list[dict], step: int, lost: set[int]) -> None:
        """The metrics of steps up to ``step`` a lost rank 0 had not sent, from a survivor's recent ones.
        A surviving rank 0's own reports are on their way (Ray delivers a live actor's calls, in order):
        recovering one still in flight wrote its step twice (a CI run of the phase drill). A lost rank 0's
        last report may still arrive after its recovered copy: ``stats.recovered`` drops it then."""
        if 0 not in lost:
            return
        recent = max((a["recent"] for a in accounts), key=len)
        missing = [m for m in recent if m["step"] <= step and not self.stats.has_step(m["step"])]
        if missing:
            self.report(missing)
            self.stats.recovered.update(m["step"] for m in missing)

    def _regroup(self, new: list, lost: set[int], data: dict) -> list:
        """Survivors re-form the process group in their processes; the replacements join it. The new
        rank 0 hosts the rendezvous."""
        start_s = self.fleet.start_bound_s()
        ip, port, _ = self.wait([new[0].address.remote()], "peer heal: rendezvous address", timeout=start_s)[0]
        cfg_dict, world = self.fleet.cfg_dict(), len(new)
        gpu_ids = [i.gpu_ids for i in self.fleet.infos]
        calls = [
            w.setup.remote(
                (ip, port), data, cfg_dict, gpu_ids[r], (r, world, self.fleet.supervisor), init_weights=False
            )
            if r in lost
            else w.heal_regroup.remote((ip, port))
            for r, w in enumerate(new)
        ]
        return self.wait(
            calls,
            "peer heal: regroup (rendezvous, rebuild)",
            timeout=start_s + 60,
            hang_s=start_s + 61,
            hang_why=f"{START_BOUND} + 60 s",
        )
