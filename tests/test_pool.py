"""The worker pool (``raysc.fleet.pool``): a run takes the processes a cleanly ended run gave back, for the
same ranks, and trains exactly as fresh processes do; a failed run gives nothing back; idle processes
and the pool itself go after ``supervisor.worker_pool_idle_s``. (A supervisor that dies without giving
its workers back: tests/test_job_submit.py and tests/test_stop.py, on a cluster of their own.)"""

import time
from pathlib import Path

import pytest
import ray

from raysc.checkpoint.store import CheckpointStore
from raysc.fleet.errors import RunFailed
from raysc.fleet.pool import POOL_NAMESPACE, pool_name
from raysc.fleet.records import read_jsonl


def _ready(run_dir: Path) -> dict:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "workers_ready"][0]


def _losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(pid)
    return alive


def test_a_run_takes_the_processes_a_finished_run_gave_back_and_trains_exactly_as_fresh_ones(ray_session, make_cfg):
    from raysc.fleet.driver import train

    # dp_shard=2: every rank saves its own shard (a process serving another rank than before broke DCP's
    # save plan in torch 2.13, so the pool keeps each process on one rank)
    sets = ["train.steps=6", "parallel.dp_shard=2", "checkpoint.every_steps=3"]
    first = Path(train(make_cfg(*sets, run="first"), progress=False)["run_dir"])
    second = Path(train(make_cfg(*sets, run="second"), progress=False)["run_dir"])
    a, b = _ready(first), _ready(second)
    assert b["pooled"] == 2 and b["reused"] == 2, b
    assert b["pids"] == a["pids"]  # the same process for the same rank
    assert _losses(second) == _losses(first)  # bit-exact: nothing of the first run stayed in the processes
    assert CheckpointStore(str(second / "checkpoints")).verify(6) is None
    stats = ray.get(ray.get_actor(pool_name(), namespace=POOL_NAMESPACE).stats.remote())
    assert stats["lent"] == 0 and sum(stats["idle"].values()) >= 2, stats

    # a run that fails gives its processes back to no one: they are killed
    with pytest.raises(RunFailed):
        train(make_cfg(*sets, 'supervisor.inject="raise@2"', "supervisor.max_restarts=0", run="failed"), progress=False)
    failed = _ready(Path(make_cfg(run="failed").run.dir))
    assert failed["pids"] == a["pids"]
    deadline = time.monotonic() + 30
    while _alive(failed["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(failed["pids"])
    third = Path(train(make_cfg(*sets, run="third"), progress=False)["run_dir"])
    assert not set(_ready(third)["pids"]) & set(a["pids"]) and _losses(third) == _losses(first)


def test_idle_processes_and_then_the_pool_go_after_the_idle_time(ray_session, make_cfg):
    from raysc.fleet.driver import train

    run_dir = Path(
        train(make_cfg("train.steps=3", "supervisor.worker_pool_idle_s=600", run="a"), progress=False)["run_dir"]
    )
    # a later run's idle time is the pool's from then on
    run_dir = Path(
        train(make_cfg("train.steps=3", "supervisor.worker_pool_idle_s=2", run="b"), progress=False)["run_dir"]
    )
    pids = _ready(run_dir)["pids"]
    assert _ready(run_dir)["reused"] == 1 and _alive(pids) == pids
    deadline = time.monotonic() + 30
    while (
        _alive(pids) or pool_name() in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pids)
    assert pool_name() not in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
