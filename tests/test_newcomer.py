"""The README's commands as a newcomer runs them on this machine, with no cluster running: `raysc train
jobs/configs/tiny.toml`, then `raysc serve RUN`, each starting its own local Ray with the machine's real
CPU count. (The rest of the suite shares one Ray started with an inflated ``num_cpus`` so that 8-rank
layouts fit on 2 cores; that is how `raysc serve` never becoming ready on a 2-core laptop went unseen:
Serve's defaults need 3 CPUs for one 1-CPU engine.) The served greedy text equals raysc's own model's."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

from greedy_check import greedy_mismatches
from raysc.cluster.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")
PROMPTS = ["def ", "import ", "class ", "return self."]


def _newcomer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # a new local Ray sized by Ray from this machine, as `ray.init()` with no cluster running starts (not a
    # test cluster that `ray start` on this machine may have recorded as the one to join)
    env["RAY_ADDRESS"] = "local"
    # its workers at the suite's niceness (tests/conftest.py): at Ray's 15 they would queue behind the
    # other lane's processes, a contention a newcomer's own machine does not have
    env["RAY_worker_niceness"] = os.environ["RAY_worker_niceness"]
    return env


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_raysc_train_then_raysc_serve_on_the_machines_own_cpus(tmp_path, cache_dir):
    env, run_dir = _newcomer_env(), tmp_path / "tiny"
    train = subprocess.run(
        [
            RAYSC,
            "train",
            "jobs/configs/tiny.toml",
            "--no-progress",
            "--set",
            "train.steps=20",
            "--set",
            f'run.dir="{run_dir}"',
            "--set",
            f'data.cache_dir="{cache_dir}"',
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert json.loads(train.stdout.strip().splitlines()[-1])["steps"] == 20

    port = free_port()
    serve = subprocess.Popen(
        [RAYSC, "serve", str(run_dir), "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(serve.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 420
        info = None
        while info is None:
            assert time.monotonic() < deadline and serve.poll() is None, "".join(seen)[-4000:]
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            seen.append(line)
            if line.startswith('{"serving"'):
                info = json.loads(line)
        if (os.cpu_count() or 1) < 3:  # Serve's defaults do not fit: the relays were given a share
            assert any("fitted:" in line for line in seen), "".join(seen)[-4000:]
        client = openai.OpenAI(base_url=info["serving"], api_key="unused")
        served = [
            client.completions.create(
                model=info["model"], prompt=p, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
            )
            .choices[0]
            .token_ids
            for p in PROMPTS
        ]
        assert all(len(ids) == 24 for ids in served), served
        assert not greedy_mismatches(run_dir, info["step"], PROMPTS, served)
    finally:
        serve.send_signal(signal.SIGINT)  # Ctrl-C: undeploys, and the local Ray it started goes with it
        try:
            serve.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert serve.returncode == 0, "".join(seen)[-4000:]
