"""A rank that fails while an asynchronous checkpoint is uploading: the coordinator's calls to a
dead worker become a typed ``Failure`` the supervisor heals (never a raw Ray error), and the save in
flight is committed only when every rank had finished its upload. The whole run at the defaults is
``test_training``'s bit-exact recovery test (kill, raise, hang during a save) and ``test_multinode``'s
node loss; this is the coordinator alone, with stand-in workers."""

from __future__ import annotations

import pytest
import ray

from raysc.fleet.checkpointing import CheckpointCoordinator
from raysc.fleet.errors import FailureKind, RunFailed
from raysc.fleet.watch import Watch


@ray.remote(num_cpus=0)
class _Uploader:
    """A worker's checkpoint calls: an upload that is done (``files``) or still running."""

    def __init__(self, rank: int, done: bool, busy_answers: int = 0, wait_s: float = 0.0) -> None:
        self.rank, self.done = rank, done
        self.busy_answers = busy_answers  # the first calls answer "still uploading", then as ``done`` says
        self.wait_s = wait_s  # how long save_wait takes to answer

    def save_pending(self) -> bool:
        if self.busy_answers:
            self.busy_answers -= 1
            return True
        return not self.done

    def save_start(self, step: int) -> dict:
        return {"loader": {}, "detector": {}, "held_s": 0.0}

    def save_wait(self) -> dict:
        import time

        time.sleep(self.wait_s)
        return {"rank": self.rank, "ok": True, "files": [], "retries": []}

    def die(self) -> None:
        import os

        os._exit(1)


def _coordinator(cfg, workers: list) -> tuple[CheckpointCoordinator, list[dict]]:
    events: list[dict] = []

    def event(kind, **fields):
        events.append({"kind": kind.value, **fields})
        return events[-1]

    watch = Watch(event, silent_s=lambda: 0.0, node=lambda r: None, default_hang_s=60.0)
    ckpt = CheckpointCoordinator(cfg, event, watch.wait)
    watch.poll = ckpt.poll
    ckpt.workers = workers
    ray.get([w.save_pending.remote() for w in workers])  # started: a poll waits at most 0.5 s for answers
    ckpt.inflight = {"step": 4, "tokens": 0, "loader": {}, "detector": {}, "t0": 0.0, "stall_s": 0.0, "results": {}}
    return ckpt, events


def _kill(worker) -> None:
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(worker.die.remote())


def test_a_rank_dead_during_an_upload_is_a_typed_failure_and_its_save_is_abandoned(ray_session, make_cfg):
    """The watch polls the save in flight while training runs; rank 1 died meanwhile. The poll raises
    RunFailed(died, rank 1) with a worker_died event (it used to raise Ray's ActorDiedError, which no
    heal loop catches: the run ended); salvage then abandons the save (no manifest)."""
    workers = [_Uploader.remote(0, done=False), _Uploader.remote(1, done=False)]
    ckpt, events = _coordinator(make_cfg(), workers)
    _kill(workers[1])
    with pytest.raises(RunFailed) as err:
        ckpt.poll()
    assert err.value.failure.kind is FailureKind.DIED and err.value.failure.rank == 1
    assert [(e["kind"], e["rank"]) for e in events] == [("worker_died", 1)]
    ckpt.salvage(timeout_s=2.0)
    assert ckpt.inflight is None and events[-1]["kind"] == "checkpoint_save_abandoned"
    assert ckpt.store.steps() == []


def test_a_rank_dead_while_the_save_is_awaited_leaves_the_save_to_salvage(ray_session, make_cfg):
    """The supervisor waits for the save in flight (the next checkpoint step, a stop, a sync save) and
    rank 1 died during it. ``finish`` let go of the save before the wait: the RunFailed left nothing in
    flight, so salvage recorded neither a commit nor an abandon, and the restart went back a checkpoint
    with no event saying why (a CI quarantine drill, 2026-12-06). Now the save stays in flight and
    salvage abandons it."""
    workers = [_Uploader.remote(0, done=False), _Uploader.remote(1, done=False)]
    ckpt, events = _coordinator(make_cfg(), workers)
    _kill(workers[1])
    with pytest.raises(RunFailed) as err:
        ckpt.finish()
    assert err.value.failure.kind is FailureKind.DIED and err.value.failure.rank == 1
    assert ckpt.inflight is not None and ckpt.inflight["step"] == 4
    ckpt.salvage(timeout_s=2.0)
    assert ckpt.inflight is None and events[-1]["kind"] == "checkpoint_save_abandoned" and events[-1]["step"] == 4
    assert ckpt.store.steps() == []


def test_a_save_awaited_while_the_watch_polls_is_committed_once(ray_session, make_cfg):
    """``finish`` holds the save in flight while it waits, and the watch polls during every wait: the
    poll must not commit that save under it (two checkpoint_saved events, two retention passes)."""
    workers = [_Uploader.remote(r, done=True, wait_s=1.5) for r in range(2)]  # longer than the watch's 1 s tick
    ckpt, events = _coordinator(make_cfg(), workers)
    ckpt.finish()
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4] and ckpt.store.steps() == [4]
    assert ckpt.inflight is None


def test_a_save_every_rank_uploaded_is_committed_though_a_rank_died_after(ray_session, make_cfg):
    """Rank 1 finished its upload (a poll saw it) and then died before rank 0 finished: the save
    is whole, so salvage commits it rather than throwing the work away."""
    workers = [_Uploader.remote(0, done=False), _Uploader.remote(1, done=True)]
    ckpt, events = _coordinator(make_cfg(), workers)
    ckpt.poll()  # rank 0 still uploading: nothing committed, rank 1's result kept
    assert ckpt.inflight is not None and set(ckpt.inflight["results"]) == {1}
    _kill(workers[1])
    ckpt.salvage(timeout_s=2.0)  # rank 0's upload is done by now (save_wait answers)
    assert ckpt.inflight is None and [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4]
    assert ckpt.store.steps() == [4]


def test_a_rank_dead_after_its_upload_left_a_receipt_and_the_save_is_committed(ray_session, make_cfg):
    """No poll saw rank 1 finish before it died, but its upload receipt (written after its last file
    was durable) is in the store: salvage reads it and commits the whole save."""
    workers = [_Uploader.remote(0, done=True), _Uploader.remote(1, done=False)]
    ckpt, events = _coordinator(make_cfg(), workers)
    ckpt.store.write_receipt(4, 1, [])  # rank 1 holds no file of its own here: its receipt lists none
    _kill(workers[1])
    ckpt.salvage(timeout_s=2.0)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4] and ckpt.store.steps() == [4]


def test_a_save_that_commits_while_the_next_save_waits_for_it(ray_session, make_cfg):
    """The next checkpoint step comes while step 4 is uploading: ``save(8)`` asks every rank whether
    step 4 is still uploading (yes), and while it waits for the answers the watch's poll sees the upload
    done and commits step 4. The save then found no save in flight to name: it raised TypeError
    ('NoneType' object is not subscriptable) out of the supervisor and ended the run (a CI chaos drill,
    2026-12-04). Now step 4 is committed once and step 8 starts."""
    workers = [_Uploader.remote(r, done=True, busy_answers=2) for r in range(2)]  # 1: _coordinator's, 2: save's
    ckpt, events = _coordinator(make_cfg(), workers)
    ckpt.save(8, tokens=0)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4] and ckpt.store.steps() == [4]
    assert ckpt.inflight is not None and ckpt.inflight["step"] == 8


def test_retention_reads_each_manifest_once_and_never_takes_another_runs(ray_session, make_cfg, monkeypatch):
    """Retention runs after every commit and keeps only this run's steps (by the run id in each manifest).
    It read every committed manifest each time: with ``keep_every_steps`` a long run's store holds hundreds,
    one object-store GET each per save. Now each manifest is read once (this run's own, never: it wrote them),
    and another run's checkpoint in the store is still recognised and kept."""
    cfg = make_cfg("checkpoint.keep_every_steps=8")
    workers = [_Uploader.remote(r, done=True) for r in range(2)]
    ckpt, events = _coordinator(cfg, workers)
    ckpt.run_id = "this-run"
    ckpt.store.commit(2, [], {"run_id": "another-run"})
    reads: list[int] = []
    read = ckpt.store.read_manifest
    monkeypatch.setattr(ckpt.store, "read_manifest", lambda step: reads.append(step) or read(step))
    ckpt.salvage(timeout_s=2.0)  # commits step 4
    for step in (8, 12, 16, 20):
        ckpt.save(step, tokens=0)
        ckpt.salvage(timeout_s=2.0)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4, 8, 12, 16, 20]
    assert ckpt.store.steps() == [2, 8, 16, 20]  # keep_last 2, every 8th kept; the other run's step 2 kept
    # the other run's manifest once; each new step's once, as its save asks whether it is committed already;
    # none of the manifests this run wrote (each retention read them all: 2 + 3 + 3 + 3 + 3 more here)
    assert reads == [2, 8, 12, 16, 20]


@ray.remote(num_cpus=0)
def _supervisor_defect(failure: bool) -> None:
    if failure:
        raise RunFailed("no room for the fleet")
    inflight = None  # a defect of ours, as the one above was
    return inflight["step"]


def test_a_supervisor_defect_reaches_the_user_with_the_line_that_raised_it(ray_session):
    """The driver re-raises what the supervisor actor raised. That TypeError came with the driver's
    frames only, naming no line of the supervisor's; now a defect carries the actor's traceback (a
    RunFailed, whose message is the whole story, does not)."""
    from raysc.fleet.driver import _remote_cause

    def raised(failure: bool) -> BaseException:
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(_supervisor_defect.remote(failure))
        return _remote_cause(err.value)

    defect = raised(False)
    assert isinstance(defect, TypeError)
    assert 'test_save_in_flight.py", line' in "\n".join(defect.__notes__) and 'inflight["step"]' in defect.__notes__[0]
    expected = raised(True)
    assert isinstance(expected, RunFailed) and not getattr(expected, "__notes__", None)
