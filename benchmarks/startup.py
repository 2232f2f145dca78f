"""How long does a short `raysc train` take against the floor, with and without a running cluster?

The floor is what any Ray program pays for the same work: a fresh Python process that connects to
Ray (or starts a local Ray), starts one actor that imports torch, builds the same tiny model
(``jobs/configs/tiny.toml``: raysc's own ``build_model``) and runs the same five AdamW steps on
batches of the same shape. Against it: `raysc train jobs/configs/tiny.toml --set train.steps=5` as a
user runs it (its own process; data prepared and cached before timing, so both start warm). Each
is timed from process start to exit, in two settings: no cluster (each run starts and stops its
own local Ray) and a running 2-CPU head (``ray start --head --num-cpus 2``, RAY_ADDRESS set). The
runs alternate floor, raysc, floor, raysc... (``--reps``, default 3) and the median of each counts.

raysc's own share of a run is (raysc - floor); the issue 31 target is raysc <= 1.3 x floor. The run's
``events.jsonl`` says where raysc's time goes (supervisor up, data, workers ready, calibration,
first step, checkpoints, end): the medians of those phases are printed too.

Prints JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 5

FLOOR = r"""
import sys, time
import ray
ray.init(address=sys.argv[1] or None, configure_logging=False, log_to_driver=False)

@ray.remote(num_cpus=2)
class Steps:
    def run(self, steps):
        import torch
        from raysc.config import load_config
        from raysc.model.llama import build_model
        cfg = load_config("jobs/configs/tiny.toml", [])
        torch.manual_seed(0)
        model = build_model(cfg.model, cfg.rope_len, cfg.train.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        b, t = cfg.train.global_batch, cfg.train.seq_len
        for _ in range(steps):
            x = torch.randint(0, cfg.model.vocab_size, (b, t + 1))
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm)
            opt.step()
            opt.zero_grad()
        return float(loss)

print(ray.get(Steps.remote().run.remote(int(sys.argv[2]))))
"""

PHASES = ("checkpoint_store_ok", "data_ready", "workers_ready", "timeouts_calibrated", "checkpoint_saved", "run_end")


def _env(address: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_ADDRESS"] = address or "local"
    env["RAY_DEDUP_LOGS"] = "0"
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def floor(address: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", FLOOR, address, str(STEPS)], env=_env(address), cwd=ROOT, check=True, capture_output=True
    )
    return time.perf_counter() - t0


def raysc_train(address: str, work: Path, cache: Path, i: int) -> tuple[float, dict]:
    run_dir = work / f"run-{'head' if address else 'local'}-{i}"
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            str(BIN / "raysc"),
            "train",
            "jobs/configs/tiny.toml",
            "--no-progress",
            "--set",
            f"train.steps={STEPS}",
            "--set",
            f'run.dir="{run_dir}"',
            "--set",
            f'data.cache_dir="{cache}"',
        ],
        env=_env(address),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"raysc train failed:\n{out.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = events[0]["time"]
    phases = {}
    for e in events:
        if e["kind"] in PHASES and e["kind"] not in phases:
            phases[e["kind"]] = round(e["time"] - start, 3)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    phases["first_step"] = round(first["time"] - start, 3) if "time" in first else None
    phases["before_supervisor"] = round(start - (time.time() - wall), 3)  # driver: imports, Ray, supervisor up
    return wall, phases


def start_head(temp: Path) -> tuple[subprocess.Popen, str]:
    from raysc.cluster.ports import free_ports

    port, agent_port = free_ports(2)
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--num-cpus=2",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            f"--dashboard-agent-listen-port={agent_port}",
        ],
        env={**_env(""), "RAY_AUTH_MODE": "disabled"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{address}')"],
        env={**_env(address), "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
    ).returncode:
        if time.monotonic() > deadline:
            raise SystemExit("the Ray head did not start")
        time.sleep(1)
    return head, address


def stop_head(head: subprocess.Popen, temp: Path) -> None:
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-9", "-f", str(temp)], check=False)


def measure(address: str, reps: int, work: Path, cache: Path) -> dict:
    floors, trains, phases = [], [], []
    for i in range(reps):
        floors.append(floor(address))
        wall, ph = raysc_train(address, work, cache, i)
        trains.append(wall)
        phases.append(ph)
        print(
            f"{'head' if address else 'local'} rep {i}: floor {floors[-1]:.2f} s, raysc train {wall:.2f} s, {ph}",
            file=sys.stderr,
            flush=True,
        )
    f, t = statistics.median(floors), statistics.median(trains)
    keys = sorted({k for p in phases for k in p if p[k] is not None})
    return {
        "floor_s": round(f, 2),
        "raysc_train_s": round(t, 2),
        "ratio": round(t / f, 3),
        "raysc_share_s": round(t - f, 2),
        "floors": [round(x, 2) for x in floors],
        "trains": [round(x, 2) for x in trains],
        "phases_median_s": {k: round(statistics.median(p[k] for p in phases if p.get(k) is not None), 3) for k in keys},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-head", action="store_true", help="only the no-cluster setting")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="startup-"))
    cache = work / "cache"
    # the data and tokenizer are prepared once, untimed: both paths then start from a warm cache
    raysc_train("", work, cache, -1)
    result = {"steps": STEPS, "cpus": os.cpu_count(), "no_cluster": measure("", args.reps, work, cache)}
    if not args.no_head:
        temp = Path(tempfile.mkdtemp(prefix="sh-", dir="/tmp"))
        head, address = start_head(temp)
        try:
            result["running_head"] = measure(address, args.reps, work, cache)
        finally:
            stop_head(head, temp)
            shutil.rmtree(temp, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
