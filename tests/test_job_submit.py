"""`ray job submit` against a separate local `ray start --head` cluster (the ``ray_head`` fixture):
a worker killed from outside by `kill -9` heals itself and the job finishes with the expected
summary; `ray job stop` stops a job gracefully, with a checkpoint and the job command that resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import TINY, live_actors, pool_actor_ids
from raysc.checkpoint.store import CheckpointStore
from raysc.fleet.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _submit(ray_head: dict, sets: list[str], *options: str) -> list[str]:
    cmd = [
        ray_head["ray"],
        "job",
        "submit",
        "--address",
        ray_head["address"],
        "--working-dir",
        str(ROOT),
        *options,
        "--",
        "python",
        "jobs/pretrain.py",
        "--config",
        "jobs/configs/tiny.toml",
    ]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def test_job_submit_survives_kill_9_of_a_worker(ray_head, cache_dir, tmp_path):
    run_dir = tmp_path / "job-run"
    # the spares start after the first chunk and, beside the suite's other lane, took longer than 150
    # steps (~20 s) to come up (CI at 32213b9): 400 steps leave them ~3x that
    sets = [
        *TINY,
        f'data.cache_dir="{cache_dir}"',
        f'run.dir="{run_dir}"',
        "train.steps=400",
        "checkpoint.every_steps=50",
        "parallel.dp_replicate=2",
        "train.log_every=100",
        "supervisor.warm_spares=true",
    ]
    job = subprocess.Popen(
        _submit(ray_head, sets),
        env=ray_head["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    events = run_dir / "events.jsonl"
    try:

        def worker_pids():  # past a committed checkpoint, with the spares warm: the events say when
            kinds = {e["kind"]: e for e in read_jsonl(events)}
            ready = all(k in kinds for k in ("workers_ready", "checkpoint_saved", "spares_ready"))
            return kinds["workers_ready"]["pids"] if ready else None

        pids = _wait_for(worker_pids, 240, "a committed checkpoint and warm spares", job)
        os.kill(pids[1], signal.SIGKILL)  # from outside, like the OOM killer
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out
        summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        assert summary["steps"] == 400 and summary["restarts"] == 1
        kinds = [e["kind"] for e in read_jsonl(events)]
        died = [e for e in read_jsonl(events) if e["kind"] == "worker_died"]
        assert died and died[0]["rank"] == 1 and "recovered" in kinds and kinds[-1] == "run_end"
    finally:
        if job.poll() is None:
            job.kill()


def test_ray_job_stop_saves_shuts_down_and_prints_the_resume_job(ray_head, cache_dir, tmp_path):
    """`ray job stop` sends SIGTERM to the job's driver: it stops at a step boundary, commits that
    step, leaves no actor alive and its log ends with the job command that resumes it."""
    run_dir = tmp_path / "job-stop"
    # far more steps than the stop lets it run, and no periodic checkpoint before the stop: a tiny step
    # takes ~10 ms, and on a loaded machine `ray job stop` landed 1,222 steps after the 20th (CI)
    sets = [
        *TINY,
        f'data.cache_dir="{cache_dir}"',
        f'run.dir="{run_dir}"',
        "train.steps=100000",
        "checkpoint.every_steps=50000",
        "train.log_every=1000",
    ]
    env, ray_bin, address = ray_head["env"], ray_head["ray"], ray_head["address"]
    job_id = f"raysc-stop-{os.getpid()}"
    # Ray's job server sends SIGKILL RAY_JOB_STOP_WAIT_TIME_S (default 3) after SIGTERM: give it time
    runtime_env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})
    subprocess.run(
        _submit(ray_head, sets, "--no-wait", "--submission-id", job_id, "--runtime-env-json", runtime_env),
        env=env,
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    try:
        _wait_for(lambda: len(read_jsonl(run_dir / "metrics.jsonl")) >= 20, 240, "20 steps")
        subprocess.run(
            [ray_bin, "job", "stop", "--address", address, job_id],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        logs = subprocess.run(
            [ray_bin, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True, timeout=60
        ).stdout
        stopped = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "run_stopped"]
        assert stopped and stopped[0]["reason"] == "SIGTERM" and not stopped[0].get("aborted"), logs
        step = stopped[0]["step"]
        assert 20 <= step < 50000 and stopped[0]["checkpoint_step"] == step
        assert CheckpointStore(str(run_dir / "checkpoints")).verify(step) is None
        resume = [line for line in logs.splitlines() if line.startswith("resume with: ")]
        assert resume and resume[0].startswith(
            "resume with: ray job submit --working-dir . -- python "
            "jobs/pretrain.py --config jobs/configs/tiny.toml --set "
        )
        assert resume[0].endswith(" --resume")
        assert "SIGTERM received" not in logs  # Ray's native stack dump: the driver's handler took over
        idle = pool_actor_ids(ray_head)  # kept for the next run (raysc.fleet.pool); nothing else of the job is
        _wait_for(
            lambda: not live_actors(address, idle), 30, "every actor of the job but the pool's idle ones to be dead"
        )
    finally:
        subprocess.run(
            [ray_bin, "job", "stop", "--address", address, job_id], env=env, capture_output=True, timeout=120
        )


def test_a_job_whose_head_side_driver_dies_is_resubmitted_with_resume(ray_head, cache_dir, tmp_path):
    """What a head-node loss does to a job: its driver (the entrypoint on the head) is SIGKILLed, the
    job fails and its actors go with it; the same job resubmitted with --resume continues from the
    newest committed checkpoint and finishes (docs/operations.md, 'When the head node dies')."""
    run_dir = tmp_path / "job-head"
    sets = [
        *TINY,
        f'data.cache_dir="{cache_dir}"',
        f'run.dir="{run_dir}"',
        "train.steps=200",
        "checkpoint.every_steps=50",
        "checkpoint.async=false",
        "train.log_every=100",
    ]
    env, address = ray_head["env"], ray_head["address"]
    job = subprocess.Popen(
        _submit(ray_head, sets), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    try:

        def saved() -> list[int]:
            return [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "checkpoint_saved"]

        _wait_for(saved, 240, "a committed checkpoint", job)
        listed = subprocess.run(
            ["pgrep", "-af", f"jobs/pretrain.py .*{run_dir}"], capture_output=True, text=True
        ).stdout.splitlines()
        drivers = [int(line.split()[0]) for line in listed if " job submit " not in line]  # not our client
        assert drivers, listed
        for pid in drivers:
            os.kill(pid, signal.SIGKILL)
        committed = saved()
        out, _ = job.communicate(timeout=120)
        assert job.returncode != 0, out[-2000:]  # `ray job submit` reports the job failed
        # its workers too: the pool kills what it lent to a supervisor that is gone
        idle = pool_actor_ids(ray_head)
        _wait_for(lambda: not live_actors(address, idle), 60, "the job's actors to go with its driver")
        assert CheckpointStore(str(run_dir / "checkpoints")).latest() >= committed[-1]
        again = subprocess.run(
            [*_submit(ray_head, sets), "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert again.returncode == 0, again.stdout[-3000:]
        summary = json.loads([line for line in again.stdout.splitlines() if line.startswith("{")][-1])
        resumed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resumed"]
        assert summary["steps"] == 200 and len(resumed) == 1 and resumed[0]["step"] >= committed[-1]
        assert summary["steps_run"] == 200 - resumed[0]["step"]
    finally:
        if job.poll() is None:
            job.kill()
