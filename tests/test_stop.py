"""Stopping a run the way people do: Ctrl-C (SIGINT) and SIGTERM to `raysc train` commit the step
reached and exit 130 / 143 with the command that resumes it, and the resumed runs reproduce an
uninterrupted run bit for bit; a second Ctrl-C aborts at once; `raysc ckpt now` commits a checkpoint
and training goes on; no actor is left alive on the cluster (`ray job stop`: test_job_submit.py)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, live_actors, pool_actor_ids
from raysc.checkpoint.store import CheckpointStore
from raysc.fleet.records import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")
STEPS = 240
# two ranks, so that the stop is agreed by a vote over a process group
SETS = [
    *TINY,
    f"train.steps={STEPS}",
    "checkpoint.every_steps=200",
    "parallel.dp_replicate=2",
    "parallel.cpus_per_worker=0.5",
    "train.log_every=100",
]


def _start(ray_head: dict, cache_dir: str, run_dir: Path, *args: str) -> subprocess.Popen:
    """`raysc train` in its own session (a terminal's Ctrl-C reaches its whole process group)."""
    cmd = [RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress"]
    for s in [*SETS, f'data.cache_dir="{cache_dir}"', f'run.dir="{run_dir}"']:
        cmd += ["--set", s]
    return _popen(ray_head, [*cmd, *args])


_STARTED: list[subprocess.Popen] = []  # this test's `raysc train` processes (``_no_run_left_behind``)


@pytest.fixture(autouse=True)
def _no_run_left_behind():
    """A test that fails mid-run leaves no run training on the shared head: its actors would fail the next
    test's "every actor but the pool's idle ones is dead" check (a CI run's second failure was that)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _popen(ray_head: dict, cmd: list[str]) -> subprocess.Popen:
    env = {**ray_head["env"], "RAY_ADDRESS": ray_head["gcs"]}
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    _STARTED.append(proc)
    return proc


def _wait(predicate, what: str, proc: subprocess.Popen | None = None, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _step(run_dir: Path) -> int:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return metrics[-1]["step"] if metrics else 0


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == kind]


def _stop(proc: subprocess.Popen, sig: int, run_dir: Path, timeout: float = 60) -> tuple[int, str, int]:
    """Send ``sig`` as a terminal does (to the whole foreground process group); (exit code, output,
    the newest step recorded when the signal was sent)."""
    seen = _step(run_dir)
    os.killpg(proc.pid, sig)
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out, seen


def _assert_stopped(
    ray_head: dict, run_dir: Path, rc: int, out: str, seen: int, reason: str, code: int
) -> tuple[int, list]:
    """Exit code, the run_stopped event, the committed checkpoint of the stop step, the metrics ending
    at that step, no live actor; returns (stop step, resume command)."""
    assert rc == code, out
    stopped = _events(run_dir, "run_stopped")[-1]
    step = stopped["step"]
    assert stopped["reason"] == reason and stopped["step_in_flight"] == "finished", stopped
    assert stopped["checkpoint_step"] == step and 0 < step < STEPS, stopped
    # within about two seconds of steps (reports lag up to 1 s, the driver polls every second), not
    # at the end of the chunk (the next multiple of checkpoint.every_steps)
    assert seen <= step < seen + 50, (seen, step)
    assert _step(run_dir) == step  # every rank stopped after the same, finished step
    listed = subprocess.run(
        [RAYSC, "ckpt", "list", "--json", str(run_dir / "checkpoints")], capture_output=True, text=True, check=True
    ).stdout
    assert {"step": step, "verified": "yes"}.items() <= {r["step"]: r for r in json.loads(listed)}[step].items()
    last = out.strip().splitlines()[-1]
    assert last.startswith("resume with: raysc train jobs/configs/tiny.toml --set ") and last.endswith(" --resume")
    assert "Traceback" not in out and "SIGTERM received" not in out, out
    # the pool's idle processes stay for the next run (raysc.fleet.pool); nothing else of the run does
    idle = pool_actor_ids(ray_head)
    _wait(
        lambda: not live_actors(ray_head["address"], idle),
        "every actor but the pool's idle ones to be dead",
        timeout=30,
    )
    cmd = shlex.split(last.removeprefix("resume with: "))
    return step, [RAYSC, *cmd[1:]]


def test_sigint_and_sigterm_stop_save_and_resume_bit_exact(ray_head, cache_dir, tmp_path):
    run_dir = tmp_path / "stopped"
    # 1. a preemption notice: a checkpoint off the every_steps grid, and training goes on
    proc = _start(ray_head, cache_dir, run_dir)
    _wait(lambda: _step(run_dir) >= 10, "10 steps", proc)
    subprocess.run([RAYSC, "ckpt", "now", str(run_dir)], check=True, capture_output=True)
    asked = _wait(
        lambda: [e["step"] for e in _events(run_dir, "checkpoint_saved") if e["step"] % 200], "ckpt now", proc
    )
    _wait(lambda: _step(run_dir) >= asked[0] + 5, "training to go on after the requested checkpoint", proc)
    assert CheckpointStore(str(run_dir / "checkpoints")).verify(asked[0]) is None
    # 2. Ctrl-C
    first, resume = _assert_stopped(ray_head, run_dir, *_stop(proc, signal.SIGINT, run_dir), "SIGINT", 130)
    # 3. resumed, then SIGTERM (what `ray job stop`, Kubernetes and most schedulers send)
    proc = _popen(ray_head, resume)
    _wait(lambda: _step(run_dir) >= first + 15, "15 steps after the resume", proc)
    second, resume = _assert_stopped(ray_head, run_dir, *_stop(proc, signal.SIGTERM, run_dir), "SIGTERM", 143)
    assert second > first and _events(run_dir, "resumed")[-1]["step"] == first
    # 4. resumed to the end, while the uninterrupted reference runs beside it (the cluster holds both
    # fleets; nothing after this point looks at timing or at which actors are alive)
    proc = _popen(ray_head, resume)
    ref_dir = tmp_path / "uninterrupted"
    ref_proc = _start(ray_head, cache_dir, ref_dir)
    out, _ = proc.communicate(timeout=240)
    ref_out, _ = ref_proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1])["steps"] == STEPS
    assert _events(run_dir, "resumed")[-1]["step"] == second
    assert ref_proc.returncode == 0, ref_out
    ref = {m["step"]: m for m in read_jsonl(ref_dir / "metrics.jsonl")}
    got = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}  # a re-run step: the last line counts
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert got[step][key] == ref[step][key], (step, key)


def test_second_ctrl_c_aborts_at_once_and_commits_nothing_partial(ray_head, cache_dir, tmp_path):
    run_dir = tmp_path / "aborted"
    # from step 26 every step waits 3 s on rank 0 (a straggler): the graceful stop takes that long
    slow = ",".join(f"slow@{s}" for s in range(26, 60))
    proc = _start(
        ray_head, cache_dir, run_dir, "--set", "checkpoint.every_steps=10", "--set", f'supervisor.inject="{slow}"'
    )
    _wait(lambda: _step(run_dir) >= 25, "25 steps", proc)
    os.killpg(proc.pid, signal.SIGINT)
    _wait(lambda: _events(run_dir, "stop_requested"), "the stop request", proc)
    t0 = time.monotonic()
    rc, out, _ = _stop(proc, signal.SIGINT, run_dir, timeout=30)
    assert rc == 130 and time.monotonic() - t0 < 10, out
    stopped = _events(run_dir, "run_stopped")[-1]
    assert stopped["reason"] == "SIGINT" and stopped["aborted"] is True, stopped
    store = CheckpointStore(str(run_dir / "checkpoints"))
    assert store.steps() and all(store.verify(s, checksums=True) is None for s in store.steps())
    assert out.strip().splitlines()[-1].endswith(" --resume")
    # an aborted run gives nothing back: the pool kills what it lent once the supervisor is gone
    idle = pool_actor_ids(ray_head)
    _wait(
        lambda: not live_actors(ray_head["address"], idle),
        "every actor but the pool's idle ones to be dead",
        timeout=30,
    )


def _vote_rank(rank: int, port: int, out: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from raysc.fleet.stopping import StepVote

    timeout = timedelta(seconds=20)  # ranks that disagree fail here rather than hang
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timeout)
    vote = StepVote(dist.new_group(backend="gloo", timeout=timeout))
    decided = []
    for step in range(1, 40):
        if rank == 0 and step == 5:
            vote.request("checkpoint")  # seen by rank 0 alone, as an actor call would be
        if rank == 1 and step == 9 + rank:
            vote.request("stop")
        if rank == 1:
            time.sleep(0.01)  # the ranks do not run in lockstep
        kind = vote.poll()
        if kind:
            decided.append((step, kind))
            if kind == "stop":
                break
    vote.finish()
    out[rank] = decided
    dist.destroy_process_group()


def test_ranks_agree_on_the_step_a_request_takes_effect():
    """A request seen by one rank only takes effect on every rank after the same step."""
    import torch.multiprocessing as mp

    from raysc.cluster.ports import free_port

    out = mp.Manager().dict()
    mp.spawn(_vote_rank, args=(free_port(), out), nprocs=2)
    assert out[0] == out[1] and [k for _, k in out[0]] == ["checkpoint", "stop"], dict(out)
    assert out[0][0][0] in (6, 7) and out[0][1][0] in (11, 12)  # one or two steps after the request
