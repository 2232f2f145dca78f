"""Calibrated timeouts: measured step and collective times set the hang and process-group timeouts,
a collective stress loop under them fires no timeout, a hang is caught by the calibrated
process-group timeout of the surviving rank's collective (not by the supervisor's hang timeout,
not by the 600 s default), in the first fleet and in a healed one, a straggler is reported without a restart,
the rendezvous starts once every worker is up, and a healed fleet's start is bounded by the measured first start."""

from __future__ import annotations

from pathlib import Path

from raysc.fleet.records import read_jsonl


def test_calibrated_timeouts_stress_and_fast_hang_detection(ray_session, make_cfg):
    from raysc.fleet.driver import train

    cfg = make_cfg(
        "parallel.dp_replicate=2",
        "train.steps=14",
        "checkpoint.every_steps=5",
        "checkpoint.async=false",
        "supervisor.calibrate_steps=3",
        "supervisor.timeout_floor_s=1",
        "supervisor.stress_s=2",
        "supervisor.hang_timeout_s=600",
        "supervisor.restart_backoff_s=0.1",
        "supervisor.timeout_factor=5",
        'supervisor.inject="hang@9:1,hang@12:1"',
    )
    summary = train(cfg, progress=False)
    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    cal = [e for e in events if e["kind"] == "timeouts_calibrated"][0]
    assert cal["steps"] == "2..4" and cal["factor"] == 5.0
    assert cal["hang_timeout_s"] == max(1.0, 5.0 * max(cal["step_time_s"], 1.0))  # reports come >= 1/s
    assert cal["pg_timeout_s"] >= 5.0 * max(cal["step_time_s"], cal["allreduce_s"]) - 1e-3
    assert cal["pg_timeout_s"] < 60  # calibrated, not the 30 min default
    stress = [e for e in events if e["kind"] == "collective_stress"][0]
    assert stress["ops"] > 10 and stress["timeouts"] == 0 and stress["slowest_op_s"] < stress["pg_timeout_s"]
    # the supervisor's hang timeout (5 x the 1 s report interval) is far above the process-group
    # timeout of these millisecond steps: rank 0's collective must time out first, after about pg_s
    pg_s, hang_s = cal["pg_timeout_s"], cal["hang_timeout_s"]
    assert hang_s >= 5.0 and pg_s + 2.0 < hang_s, cal  # (2 s for the error to cross Ray, as below)
    # the second hang is in the healed fleet, which gets the calibrated timeout after its warm-up step
    fired = [e for e in events if e["kind"] == "fault_injected"]
    caught = [e for e in events if e["kind"] in ("worker_error", "worker_hang", "worker_timeout", "worker_died")]
    assert [(e["kind"], e.get("rank")) for e in caught] == [("worker_error", 0)] * 2, caught
    for f, c in zip(fired, caught):
        assert "timed out" in c["error"].lower(), c["error"]  # gloo's collective timeout
        delay = c["time"] - f["time"]
        # the clock starts when rank 0 enters the collective (at most a step before rank 1 announces
        # its fault, a few ms here); the error then crosses Ray to the supervisor
        assert 0.8 * pg_s <= delay <= pg_s + 2.0 < hang_s, (f["fault"], delay, pg_s, hang_s)
    assert summary["steps"] == 14 and summary["restarts"] == 2
    # each healed fleet (cold: no warm spares) is started under the bound its predecessors' measured starts
    # set: 5 x the longest of them, or supervisor.start_timeout_s (60 s) when that is more
    ready = [e for e in events if e["kind"] == "workers_ready"]
    measured = 0.0
    for e in ready:
        assert abs(e["start_bound_s"] - max(60.0, 5.0 * measured)) < 0.1, (e, measured)
        assert e["started_s"] > 0
        measured = max(measured, e["started_s"])
    assert len(ready) == 3


def test_straggler_is_reported_not_restarted(ray_session, make_cfg):
    from raysc.fleet.driver import train

    cfg = make_cfg(
        "parallel.dp_replicate=2", "train.steps=12", "supervisor.calibrate_steps=3", 'supervisor.inject="slow@8:1"'
    )  # (no warm spares: their start-up slows steps too)
    summary = train(cfg, progress=False)
    slow = [e for e in read_jsonl(Path(cfg.run_dir) / "events.jsonl") if e["kind"] == "slow_step"]
    assert [e["step"] for e in slow] == [8] and slow[0]["step_time_s"] >= 3.0
    assert summary["restarts"] == 0 and summary["steps"] == 12


def test_the_rendezvous_starts_once_every_worker_is_up():
    """Rank 0's ``setup`` waits supervisor.start_timeout_s for its peers: the fleet calls it only when every
    worker's process is up (each start bounded by that timeout in turn), and asks rank 0 for its free port
    last. (With fakes: starting real processes slowly on purpose would be a timing test.)"""
    from types import SimpleNamespace

    from raysc.fleet.fleet import Fleet

    asked: list[str] = []

    class Worker:
        def __init__(self, rank: int) -> None:
            self.address = SimpleNamespace(remote=lambda: f"address of rank {rank}")

    def wait(refs: list, what: str, timeout: float, hang_s: float, ranks: list[int], hang_why: str) -> list:
        asked.append(what)
        assert what == f"start of rank {ranks[0]}"  # a failure names the rank, not its place in the call
        assert timeout == 60 and hang_s > timeout  # a start is bounded by the start-up timeout, not the hang one
        return [("10.0.0.1", 29500, "node")] if refs == ["address of rank 0"] else [("10.0.0.2", 1, "other")]

    fleet = SimpleNamespace(workers=[Worker(r) for r in range(4)])
    touched = []
    assert Fleet._started(fleet, wait, lambda: touched.append(1), 60.0) == ("10.0.0.1", 29500)
    assert asked == ["start of rank 1", "start of rank 2", "start of rank 3", "start of rank 0"]
    assert len(touched) == 4  # each rank up restarts the hang clock


def test_a_wait_counts_silence_from_its_own_start(monkeypatch):
    """After a fault, rank 0's last report is from before the hang's detection, the salvage and the new
    fleet's reservation: the new fleet's start must not inherit that silence (a CI run's restart read 71 s
    of it into its first new rank's start and failed), and a failure names the rank it waited on."""
    from types import SimpleNamespace

    import pytest

    from raysc.fleet import watch as watch_mod
    from raysc.fleet.errors import RunFailed

    ticks = {"n": 0}

    def fake_wait(pending, num_returns, timeout):
        ticks["n"] += 1
        return (list(pending), []) if ticks["n"] >= 3 else ([], list(pending))

    monkeypatch.setattr(
        watch_mod,
        "ray",
        SimpleNamespace(wait=fake_wait, get=lambda r, timeout=None: r, exceptions=watch_mod.ray.exceptions),
    )
    events = []
    w = watch_mod.Watch(
        lambda kind, **kw: events.append((kind, kw)),
        silent_s=lambda: 1000.0,
        node=lambda r: f"node-{r}",
        default_hang_s=5.0,
    )
    assert w.wait(["address"], "start of rank 3", timeout=60, hang_s=61, ranks=[3]) == ["address"]
    # a wait that is silent past its hang bound still fails, naming the rank (not its position in the call)
    t0 = watch_mod.time.monotonic()
    monkeypatch.setattr(watch_mod, "time", SimpleNamespace(monotonic=lambda: t0 + 100.0 * ticks["n"]))
    ticks["n"] = -10
    with pytest.raises(RunFailed, match=r"during start of rank 3; waiting on ranks \[3\]") as e:
        w.wait(["address"], "start of rank 3", hang_s=61, ranks=[3], hang_why="supervisor.start_timeout_s")
    assert "(hang timeout 61.0s: supervisor.start_timeout_s)" in str(e.value)
    assert e.value.failure.rank == 3 and events[-1][1]["nodes"] == ["node-3"]


def test_a_later_fleet_start_is_bounded_by_the_measured_first_start():
    """A restart starts as many processes on the same machine as the first start did: its bound is
    supervisor.timeout_factor x the run's measured fleet start when that is more than
    supervisor.start_timeout_s (a fixed 60 s failed three restarts in a row on a busy 2-core machine).
    The calibrated-timeouts test above checks the bound each healed fleet of a real run reports."""
    from types import SimpleNamespace

    from raysc.config import load_config
    from raysc.fleet.fleet import Fleet

    cfg = load_config(None, ["supervisor.start_timeout_s=60", "supervisor.timeout_factor=4"])
    fleet = SimpleNamespace(cfg=cfg, start_measured_s=0.0)
    assert Fleet.start_bound_s(fleet) == 60.0  # the first fleet
    fleet.start_measured_s = 10.0  # a quick first start: the configured bound stays
    assert Fleet.start_bound_s(fleet) == 60.0
    fleet.start_measured_s = 38.0  # a slow one: 4 x 38 s
    assert Fleet.start_bound_s(fleet) == 152.0
