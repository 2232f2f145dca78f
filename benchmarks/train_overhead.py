"""What does the actor path cost? Plain torch loop vs. supervisor + TrainWorker, side by side.

Both train the same model on the same data for the same steps with the same
torch thread count: (a) ``Trainer`` in this process, (b) ``raysc.fleet.driver.train``
(supervisor actor, placement group, one TrainWorker, per-step metric reports,
checkpoint at the end). Throughput is steady-state tokens/s from the wall-clock
stamps of the steps after warm-up (the first 10%, and on the actor path until its warm spares
answer: the ``spares_ready`` event; their start-up, a few CPU-seconds once per fleet start that
shares the 2 cores with training, is reported apart as ``ratio_incl_spare_startup``); start-up
(Ray, actors, data) is reported separately. The actor path also saves a checkpoint halfway (the
default asynchronous save, as a run does every ``checkpoint.every_steps``): its tokens/s are counted
up to that step, and the steps after it are reported apart (``ratio_after_save``; before
``raysc.train.cpu_threads`` a run trained ~30% slower after its first save). Runs alternate a, b, a,
b, a, b (``BENCH_REPS``, default 3) and the median of each counts. Both paths must run the same
number of torch threads (the worker's ``workers_ready`` event says how many it used; a different
count also changes the floats, so the final losses would differ): the benchmark checks it before
comparing losses.
Prints JSON on its last line: tokens/s of both and the ratio b/a (target >= 0.95), before and after
the save.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysc.config import load_config  # noqa: E402
from raysc.data.prepare import prepare_data  # noqa: E402
from raysc.fleet.records import read_jsonl  # noqa: E402
from raysc.train.trainer import Trainer  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "150"))
REPS = int(os.environ.get("BENCH_REPS", "3"))
THREADS = 2
SAVE_AT = STEPS // 2
ROOT = Path(__file__).resolve().parents[1]


def steady_tps(metrics: list[dict], after: float = 0.0) -> float:
    """Tokens/s from the end of the first 10% of the steps (or the first step ending after ``after``,
    a wall-clock time, when later) to the last step."""
    warm = max(1, len(metrics) // 10)
    while warm < len(metrics) - 1 and metrics[warm - 1]["time"] < after:
        warm += 1
    a, b = metrics[warm - 1], metrics[-1]
    return (b["tokens"] - a["tokens"]) / (b["time"] - a["time"])


def plain_loop(cfg) -> dict:
    torch.set_num_threads(THREADS)
    t0 = time.time()
    packed, _, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, packed.val)
    metrics = [trainer.train_step() for _ in range(cfg.train.steps)]
    return {
        "tps": steady_tps(metrics),
        "wall_s": time.time() - t0,
        "final_loss": metrics[-1]["loss"],
        "threads": torch.get_num_threads(),
    }


def actor_path(cfg) -> dict:
    from raysc.fleet.driver import train

    t0 = time.time()
    summary = train(cfg, progress=False)
    metrics = read_jsonl(Path(summary["run_dir"]) / "metrics.jsonl")
    events = read_jsonl(Path(summary["run_dir"]) / "events.jsonl")
    ready = [e for e in events if e["kind"] == "workers_ready"]
    spares = [e for e in events if e["kind"] == "spares_ready"]
    spares_at = spares[0]["time"] if spares else 0.0
    before = [m for m in metrics if m["step"] <= SAVE_AT]
    after = [m for m in metrics if m["step"] > SAVE_AT + 2]  # the save's own steps are its stall, not this
    return {
        "tps": steady_tps(before, spares_at),
        "tps_incl_spares": steady_tps(before),
        "tps_after_save": (after[-1]["tokens"] - after[0]["tokens"]) / (after[-1]["time"] - after[0]["time"]),
        "spares_ready_step": next((m["step"] for m in metrics if m["time"] >= spares_at), None) if spares else None,
        "spares_s": spares[0]["seconds"] if spares else None,
        "wall_s": time.time() - t0,
        "final_loss": summary["final_loss"],
        "threads": ready[-1]["threads"],
    }


def main() -> None:
    import ray

    ray.init(num_cpus=THREADS, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-"))
    base = [f"train.steps={STEPS}", f"parallel.cpus_per_worker={THREADS}", f'data.cache_dir="{ROOT / ".cache/raysc"}"']
    plain, actor = [], []
    for rep in range(REPS):
        plain.append(
            plain_loop(
                load_config(
                    ROOT / "jobs/configs/tiny.toml", base + ["checkpoint.every_steps=0", f'run.dir="{tmp}/a{rep}"']
                )
            )
        )
        actor.append(
            actor_path(
                load_config(
                    ROOT / "jobs/configs/tiny.toml",
                    base + [f"checkpoint.every_steps={SAVE_AT}", f'run.dir="{tmp}/b{rep}"'],
                )
            )
        )
        print(
            f"rep {rep}: plain {plain[-1]['tps']:.0f} tok/s, actor {actor[-1]['tps']:.0f} tok/s (from step "
            f"{actor[-1]['spares_ready_step']}; {actor[-1]['tps_incl_spares']:.0f} with the spares' start-up; "
            f"{actor[-1]['tps_after_save']:.0f} after its save at step {SAVE_AT}); final loss "
            f"{plain[-1]['final_loss']!r} / {actor[-1]['final_loss']!r}",
            flush=True,
        )
    threads = {r["threads"] for r in plain + actor}
    assert threads == {THREADS}, (
        f"torch threads differ between the paths: plain {[r['threads'] for r in plain]}, "
        f"actor {[r['threads'] for r in actor]} (expected {THREADS})"
    )
    assert all(p["final_loss"] == a["final_loss"] for p, a in zip(plain, actor)), "paths diverged"
    a_tps = statistics.median(p["tps"] for p in plain)
    b_tps = statistics.median(p["tps"] for p in actor)
    b_incl = statistics.median(p["tps_incl_spares"] for p in actor)
    b_after = statistics.median(p["tps_after_save"] for p in actor)
    print(
        json.dumps(
            {
                "benchmark": "train_overhead",
                "steps": STEPS,
                "reps": REPS,
                "threads": THREADS,
                "plain_tokens_per_s": round(a_tps, 1),
                "actor_tokens_per_s": round(b_tps, 1),
                "ratio_actor_over_plain": round(b_tps / a_tps, 4),
                "target_ratio": 0.95,
                "ratio_incl_spare_startup": round(b_incl / a_tps, 4),
                "actor_after_save_tokens_per_s": round(b_after, 1),
                "ratio_after_save": round(b_after / a_tps, 4),
                "spares_ready_steps": [p["spares_ready_step"] for p in actor],
                "spares_s": [p["spares_s"] for p in actor],
                "plain_wall_s": round(statistics.median(p["wall_s"] for p in plain), 2),
                "actor_wall_s_incl_startup": round(statistics.median(p["wall_s"] for p in actor), 2),
                "plain_runs": [round(p["tps"], 1) for p in plain],
                "actor_runs": [round(p["tps"], 1) for p in actor],
                "actor_after_save_runs": [round(p["tps_after_save"], 1) for p in actor],
                "same_final_loss": True,
            }
        )
    )


if __name__ == "__main__":
    main()
