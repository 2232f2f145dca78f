"""`ray job submit` against a separate local `ray start --head` cluster, with a worker killed from
outside by `kill -9`: the job heals itself and finishes with the expected summary."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import TINY
from raysc.fleet.records import read_jsonl
from raysc.fleet.worker import free_port

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


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


def test_job_submit_survives_kill_9_of_a_worker(cache_dir, tmp_path):
    temp = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_DEDUP_LOGS"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a loopback-only test cluster: no token to distribute
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # an activated venv
    ports = {"port": free_port(), "dashboard-port": free_port(), "ray-client-server-port": free_port(),
             "dashboard-agent-listen-port": free_port(), "dashboard-agent-grpc-port": free_port(),
             "runtime-env-agent-port": free_port(), "metrics-export-port": free_port(),
             "node-manager-port": free_port(), "object-manager-port": free_port()}
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--num-cpus=4", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--temp-dir={temp}",
                             *[f"--{k}={v}" for k, v in ports.items()]],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    job = None
    try:
        _wait_for(lambda: subprocess.run([RAY, "job", "list", "--address", address], env=env,
                                         capture_output=True).returncode == 0, 90, "the head's job server")
        run_dir = tmp_path / "job-run"
        sets = [*TINY, f'data.cache_dir="{cache_dir}"', f'run.dir="{run_dir}"', "train.steps=300",
                "checkpoint.every_steps=50", "parallel.dp_replicate=2", "train.log_every=100",
                "supervisor.warm_spares=true"]
        cmd = [RAY, "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
               "python", "jobs/pretrain.py", "--config", "jobs/configs/tiny.toml"]
        for s in sets:
            cmd += ["--set", s]
        job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=ROOT)
        events = run_dir / "events.jsonl"

        def worker_pids():
            ready = [e for e in read_jsonl(events) if e["kind"] == "workers_ready"]
            steps = read_jsonl(run_dir / "metrics.jsonl")
            return ready[0]["pids"] if ready and len(steps) >= 120 else None  # past a checkpoint, spares warm

        pids = _wait_for(worker_pids, 240, "the fleet to train 120 steps", job)
        os.kill(pids[1], signal.SIGKILL)  # from outside, like the OOM killer
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out
        summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        assert summary["steps"] == 300 and summary["restarts"] == 1
        kinds = [e["kind"] for e in read_jsonl(events)]
        died = [e for e in read_jsonl(events) if e["kind"] == "worker_died"]
        assert died and died[0]["rank"] == 1 and "recovered" in kinds and kinds[-1] == "run_end"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        # anything of that cluster still alive (never `ray stop`: it would stop the test session's Ray)
        subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)
        shutil.rmtree(temp, ignore_errors=True)
