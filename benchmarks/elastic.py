"""Goodput under node losses: waiting for a replacement, an elastic raysc run, Ray Train's elastic trainer.

A fresh local multi-node cluster for each policy (``raysc cluster local up``: a head without CPUs and two
2-CPU worker nodes, each a real raylet), the same job on every side: a small Llama, two data-parallel
workers of 2 CPUs each (one per node), global batch 16, ``STEPS`` steps, a checkpoint every ``EVERY``
steps on local disk. One seeded schedule of losses and returns: before each step in ``schedule(SEED)``
the node of data-parallel rank 1 dies (its raylet SIGKILLed) if the run has a rank 1 at that step, and
``RETURN_S`` seconds after a node is gone a new one joins (``add_node``: a cloud's replacement delay).
The returns are scripted, not left to Ray's fake autoscaler, because its replacement of a killed node
is on no clock a benchmark can hold (measured here: once ~60 s, once nothing within 300 s);
tests/test_elastic.py shows the autoscaler's own node growing a run back. Policies, one at a time:

1. ``wait``: raysc as a fixed run (``parallel.elastic = false``): after a loss it waits (up to
   ``supervisor.node_wait_s``, 300 s) for room for both workers, then restores and continues;
2. ``elastic``: raysc with ``parallel.elastic = true, min_dp = 1, supervisor.node_wait_s = NODE_WAIT_S``:
   it continues on one worker (gradient accumulation keeps the global batch) and grows back at the
   first checkpoint boundary after the node has returned;
3. ``ray_train``: Ray Train's ``TorchTrainer`` with ``ScalingConfig(num_workers=(1, 2))`` (elastic),
   ``FailureConfig(max_failures=8)``, ``elastic_resize_monitor_interval_s=RESIZE_MONITOR_S``, its own
   loop (DDP, AdamW, the global batch split over the workers it has, a ``train.report`` checkpoint
   every ``EVERY`` steps, resumed from ``get_checkpoint()``).

Reported per policy: wall seconds from the command's start to its end, goodput (time in the steps that
count, each step's last attempt, over that wall time), steps lost (attempts re-run after a restore),
tokens trained (steps that count × tokens per step) and processed (every attempt), the resizes or
restarts, and trained tokens per wall second (goodput alone favours a loop with slower steps). Run
once (each side takes minutes; the schedule is seeded): ``BENCH_ELASTIC_SEED``,
``BENCH_ELASTIC_POLICIES`` (comma-separated), ``BENCH_ELASTIC_DIR`` (keep the records there).

Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RAYSC = str(Path(sys.executable).parent / "raysc")
STEPS, EVERY, LOSSES = 300, 20, 2
NODE_WAIT_S, RESIZE_MONITOR_S, RETURN_S = 2.0, 5.0, 45.0
SEED = int(os.environ.get("BENCH_ELASTIC_SEED", "7"))
MODEL = [
    "model.vocab_size=2048",
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=128",
    "train.global_batch=16",
    "schedule.warmup_steps=10",
]


def schedule(seed: int) -> list[int]:
    """The steps before which DP rank 1's node dies: LOSSES of them, at least 200 steps apart, so that
    an elastic run has grown back by the next one and every policy meets every loss (on this machine
    one worker trains about as fast as two: the fake nodes share its two cores, ~3 steps/s)."""
    rng = random.Random(seed)
    while True:
        steps = sorted(rng.sample(range(30, STEPS - 30), LOSSES))
        if all(b - a >= 200 for a, b in zip(steps, steps[1:])):
            return steps


def kept_goodput(attempts: list[dict], wall_s: float) -> dict:
    """Goodput, steps lost and steps kept from per-step records (``step``, ``step_time``)."""
    kept = {a["step"]: a for a in attempts}
    useful = sum(a["step_time"] for a in kept.values())
    return {
        "goodput": round(useful / wall_s, 4),
        "steps_lost": len(attempts) - len(kept),
        "steps_kept": len(kept),
        "attempts": len(attempts),
    }


def raysc_policy(st, tmp: Path, name: str, losses: list[int], *extra: str) -> dict:
    from raysc.fleet.records import read_jsonl

    run_dir = tmp / name
    inject = ",".join(f"node_loss@{s}:1" for s in losses)
    cmd = [RAYSC, "train", "jobs/configs/tiny.toml", "--no-progress"]
    for s in [
        *MODEL,
        f"train.steps={STEPS}",
        f"checkpoint.every_steps={EVERY}",
        "parallel.dp_replicate=2",
        "parallel.cpus_per_worker=2",
        f'data.cache_dir="{ROOT / ".cache/raysc"}"',
        f'run.dir="{run_dir}"',
        f'supervisor.inject="{inject}"',
        "supervisor.max_restarts=8",
        *extra,
    ]:
        cmd += ["--set", s]
    t0 = time.monotonic()
    run = subprocess.run(cmd, env=st.env(), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if run.returncode:
        raise RuntimeError(f"{name}: {run.stderr[-3000:]}")
    events = read_jsonl(run_dir / "events.jsonl")
    out = {
        "wall_s": round(wall, 1),
        **kept_goodput(read_jsonl(run_dir / "metrics.jsonl"), wall),
        # rank 0 reports in batches, so a failed chunk's last steps may be missing from metrics.jsonl: the
        # events count them (each restore's steps re-run, and a grow's, which loses none)
        "steps_lost": sum(
            e["steps_lost"]
            for e in events
            if e["kind"] == "recovered" or (e["kind"] == "resized" and e["from"] < e["to"])
        ),
        "losses_fired": sum(1 for e in events if e["kind"] == "fault_injected"),
        "restarts": sum(1 for e in events if e["kind"] == "recovered"),
        "resizes": [(e["from"], e["to"], e["seconds"]) for e in events if e["kind"] == "resized"],
    }
    return out


def ray_train_loop(config: dict) -> None:
    """The job as a Ray Train user writes it; DP rank 1's node dies before the scheduled steps."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from ray import train

    from raysc.config import load_config
    from raysc.fleet.faults import raylet_pid
    from raysc.model.llama import build_model
    from raysc.train.optim import build_optimizer, build_scheduler

    cfg = load_config(None, MODEL)
    torch.set_num_threads(2)
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = build_model(cfg.model, cfg.train.seq_len, seed=0)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    sched = build_scheduler(opt, STEPS, cfg.schedule)
    start, ckpt = 0, train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start = state["step"]
    model = train.torch.prepare_model(model)
    rows, gb = config["rows"], cfg.train.global_batch
    per_rank = gb // world
    marks = Path(config["marks"])
    for step in range(start + 1, STEPS + 1):
        mark = marks / f"loss-{step}"
        if step in config["losses"] and rank == 1 and not mark.exists():
            mark.write_text(str(time.time()))
            os.kill(raylet_pid(), signal.SIGKILL)
            time.sleep(60)
        t0 = time.perf_counter()
        idx = (np.arange(per_rank) + (step - 1) * gb + rank * per_rank) % len(rows)
        batch = torch.from_numpy(rows[idx].astype(np.int64))
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0:
            with open(marks / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "step_time": time.perf_counter() - t0, "world": world}) + "\n")
        if step % EVERY == 0 or step == STEPS:
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save(
                        {
                            "model": model.module.state_dict() if world > 1 else model.state_dict(),
                            "optim": opt.state_dict(),
                            "sched": sched.state_dict(),
                            "step": step,
                        },
                        Path(d) / "state.pt",
                    )
                    checkpoint = train.Checkpoint.from_directory(d)
                train.report({"step": step, "loss": loss.item()}, checkpoint=checkpoint)


def ray_train_policy(tmp: Path, losses: list[int]) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raysc.config import load_config
    from raysc.data.prepare import prepare_data

    packed, _, _ = prepare_data(load_config(None, [*MODEL, f'data.cache_dir="{ROOT / ".cache/raysc"}"']))
    marks = tmp / "ray-train-marks"
    marks.mkdir()
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"rows": packed.train, "marks": str(marks), "losses": losses},
        scaling_config=ScalingConfig(
            num_workers=(1, 2),
            use_gpu=False,
            resources_per_worker={"CPU": 2},
            elastic_resize_monitor_interval_s=RESIZE_MONITOR_S,
        ),
        run_config=RunConfig(
            name="ray-train-elastic", storage_path=str(tmp / "ray-train"), failure_config=FailureConfig(max_failures=8)
        ),
    )
    t0 = time.monotonic()
    trainer.fit()
    wall = time.monotonic() - t0
    attempts = [json.loads(line) for line in (marks / "steps.jsonl").read_text().splitlines()]
    worlds = [a["world"] for a in attempts]
    return {
        "wall_s": round(wall, 1),
        **kept_goodput(attempts, wall),
        "losses_fired": len(list(marks.glob("loss-*"))),
        "resizes": [(a, b) for a, b in zip(worlds, worlds[1:]) if a != b],
    }


def fresh_cluster(tmp: Path, name: str):
    """A new local cluster of two 2-CPU worker nodes (every policy starts from the same state)."""
    from raysc.cluster import local

    state = tmp / f"cluster-{name}.json"
    return state, local.up(2, 2, state=state, dashboard=False)


class Returns(threading.Thread):
    """Adds a worker node RETURN_S seconds after the cluster has fewer than two alive (the scripted
    return of a lost node); records when each loss was seen and each node joined."""

    def __init__(self, state: Path) -> None:
        super().__init__(daemon=True, name="node-returns")
        self.state, self.done, self.log = state, threading.Event(), []

    def run(self) -> None:
        import ray

        from raysc.cluster import local

        while not self.done.wait(0.5):
            alive = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU")]
            if len(alive) < 2:
                seen = time.time()
                if self.done.wait(RETURN_S):
                    return
                local.add_node(self.state)
                self.log.append({"lost_seen": seen, "returned": time.time()})


def main() -> None:
    import ray

    from raysc.cluster import local

    losses = schedule(SEED)
    policies = os.environ.get("BENCH_ELASTIC_POLICIES", "wait,elastic,ray_train").split(",")
    tokens_per_step = 16 * 128
    out: dict = {
        "steps": STEPS,
        "every": EVERY,
        "losses_before_steps": losses,
        "seed": SEED,
        "return_s": RETURN_S,
        "tokens_per_step": tokens_per_step,
        "node_wait_s_elastic": NODE_WAIT_S,
    }
    with tempfile.TemporaryDirectory(prefix="raysc-elastic-bench-") as d:
        tmp = Path(os.environ.get("BENCH_ELASTIC_DIR") or d)  # a directory to keep the runs' records in
        tmp.mkdir(parents=True, exist_ok=True)
        for side in policies:
            state, st = fresh_cluster(tmp, side)
            ray.init(address=st.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
            returns = Returns(state)
            returns.start()
            try:
                if side == "ray_train":
                    res = ray_train_policy(tmp, losses)
                else:
                    extra = ["parallel.elastic=true", "parallel.min_dp=1", f"supervisor.node_wait_s={NODE_WAIT_S}"]
                    res = raysc_policy(st, tmp, side, losses, *(extra if side == "elastic" else []))
            finally:
                returns.done.set()
                ray.shutdown()
                local.down(state)
            res["returns"] = len(returns.log)
            res["tokens_trained"] = res["steps_kept"] * tokens_per_step
            res["tokens_processed"] = (res["steps_kept"] + res["steps_lost"]) * tokens_per_step
            res["trained_tokens_per_s"] = round(res["tokens_trained"] / res["wall_s"], 1)
            out[side] = res
            print(json.dumps({side: res}), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
