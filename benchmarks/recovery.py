"""How fast does a run heal? MTTR after SIGKILL of a worker, raysc vs Ray Train, side by side.

One Ray instance, one S3-compatible store (moto on 127.0.0.1), the same tiny Llama, two data-parallel
workers with one CPU each, a checkpoint every ``EVERY`` steps, and worker rank 1 SIGKILLed just
before step ``KILL``:

1. raysc with the hot copy (warm spare workers, newest checkpoint in Ray's object store);
2. raysc with ``checkpoint.hot_copy = false`` (the restore reads the bucket);
3. Ray Train's ``TorchTrainer`` with ``FailureConfig(max_failures=1)``: it restarts its worker group
   and the loop resumes from ``ray.train.get_checkpoint()`` (same model, optimizer, data, interval).

MTTR = wall time from the SIGKILL to the next completed optimizer step. Steps of work lost = steps
re-run because they came after the newest checkpoint. Goodput of raysc with a kill every
``GOODPUT_EVERY`` steps is measured too. Targets (issue 5): hot-copy MTTR <= 3 s and >= 3x faster
than Ray Train.

Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, KILL = 160, 40, 130
GOODPUT_STEPS, GOODPUT_EVERY = 240, 80
MODEL = ["model.vocab_size=2048", "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "train.seq_len=128", "train.global_batch=16"]


def start_s3():
    server, endpoint, bucket = common.start_s3()
    opts = ", ".join(f'{k} = "{v}"' for k, v in common.s3_options(endpoint).items())
    return server, bucket, f"checkpoint.storage_options={{{opts}}}"


def raysc_cfg(tmp: Path, bucket: str, opts: str, name: str, *extra: str):
    from raysc.config import load_config

    return load_config(None, [
        *MODEL, f"train.steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.async=false",
        "parallel.dp_replicate=2", "parallel.cpus_per_worker=1", f'checkpoint.uri="s3://{bucket}/{name}"', opts,
        f'run.dir="{tmp / name}"', f'data.cache_dir="{ROOT / ".cache/raysc"}"', "train.log_every=1000", *extra])


def raysc_mttr(tmp: Path, bucket: str, opts: str, hot: bool) -> dict:
    from raysc.driver import train
    from raysc.fleet.records import read_jsonl

    name = "hot" if hot else "store"
    cfg = raysc_cfg(tmp, bucket, opts, name, f'supervisor.inject="kill@{KILL}:1"',
                    f"checkpoint.hot_copy={'true' if hot else 'false'}", f"supervisor.warm_spares={str(hot).lower()}")
    train(cfg, progress=False)
    events = read_jsonl(tmp / name / "events.jsonl")
    metrics = read_jsonl(tmp / name / "metrics.jsonl")
    killed = next(e for e in events if e["kind"] == "fault_injected")["time"]
    rec = next(e for e in events if e["kind"] == "recovered")
    resumed = next(e for e in events if e["kind"] == "resumed" and e["time"] >= killed)
    first = [m for m in metrics if m["step"] == rec["resumed_step"] + 1][-1]["time"]
    return {"mttr_s": round(first - killed, 3), "steps_lost": rec["steps_lost"], "restore_source": resumed["source"]}


def raysc_goodput(tmp: Path, bucket: str, opts: str) -> dict:
    from raysc.driver import train

    kills = ",".join(f"kill@{s}:1" for s in range(GOODPUT_EVERY, GOODPUT_STEPS, GOODPUT_EVERY))
    out = {}
    for name, inject in (("goodput-clean", ""), ("goodput-faults", kills)):
        cfg = raysc_cfg(tmp, bucket, opts, name, f"train.steps={GOODPUT_STEPS}", f'supervisor.inject="{inject}"')
        out[name] = train(cfg, progress=False)
    return {"goodput_no_faults": out["goodput-clean"]["goodput"],
            "goodput_kill_every_n": out["goodput-faults"]["goodput"], "n": GOODPUT_EVERY,
            "restarts": out["goodput-faults"]["restarts"]}


def ray_train_loop(config: dict) -> None:
    """The same job as a Ray Train user writes it: DDP, AdamW, a checkpoint every EVERY steps."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from ray import train

    from raysc.config import load_config
    from raysc.model.llama import build_model
    from raysc.train.optim import build_optimizer

    cfg = load_config(None, MODEL)
    torch.set_num_threads(1)
    rank, world = train.get_context().get_world_rank(), train.get_context().get_world_size()
    model = build_model(cfg.model, cfg.train.seq_len, seed=0)
    opt = build_optimizer(list(model.parameters()), cfg.optim)
    start, ckpt = 0, train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    model = train.torch.prepare_model(model)
    rows = config["rows"]
    per_rank = cfg.train.global_batch // world
    times = Path(config["times"])
    for step in range(start + 1, STEPS + 1):
        if step == KILL and ckpt is None and rank == 1:
            (times / "killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        idx = (np.arange(per_rank) + (step - 1) * cfg.train.global_batch + rank * per_rank) % len(rows)
        batch = torch.from_numpy(rows[idx].astype(np.int64))
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and ckpt is not None and step == start + 1:
            (times / "first_step_after_restart").write_text(str(time.time()))
        if step % EVERY == 0:
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step},
                               Path(d) / "state.pt")
                    checkpoint = train.Checkpoint.from_directory(d)
                train.report({"step": step, "loss": loss.item()}, checkpoint=checkpoint)


def ray_train_mttr(tmp: Path) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raysc.config import load_config
    from raysc.data.prepare import prepare_data

    packed, _, _ = prepare_data(load_config(None, [*MODEL, f'data.cache_dir="{ROOT / ".cache/raysc"}"']))
    times = tmp / "ray-train-times"
    times.mkdir()
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"rows": packed.train, "times": str(times)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="ray-train-mttr", storage_path=str(tmp / "ray-train"),
                             failure_config=FailureConfig(max_failures=1)))
    trainer.fit()
    killed = float((times / "killed").read_text())
    first = float((times / "first_step_after_restart").read_text())
    return {"mttr_s": round(first - killed, 3), "steps_lost": KILL - 1 - (KILL - 1) // EVERY * EVERY}


def main() -> None:
    import ray

    warnings.filterwarnings("ignore")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    server, bucket, opts = start_s3()
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-recovery-"))
    try:
        hot = raysc_mttr(tmp, bucket, opts, hot=True)
        print(f"raysc hot copy: {hot}", flush=True)
        store = raysc_mttr(tmp, bucket, opts, hot=False)
        print(f"raysc object store only: {store}", flush=True)
        rt = ray_train_mttr(tmp)
        print(f"Ray Train TorchTrainer: {rt}", flush=True)
        gp = raysc_goodput(tmp, bucket, opts)
    finally:
        server.stop()
        ray.shutdown()
    print(json.dumps({
        "benchmark": "recovery", "workers": 2, "kill_step": KILL, "checkpoint_every": EVERY,
        "raysc_hot_mttr_s": hot["mttr_s"], "raysc_store_mttr_s": store["mttr_s"],
        "ray_train_mttr_s": rt["mttr_s"], "ray_train_over_raysc_hot": round(rt["mttr_s"] / hot["mttr_s"], 2),
        "steps_lost": {"raysc_hot": hot["steps_lost"], "raysc_store": store["steps_lost"],
                       "ray_train": rt["steps_lost"]},
        "restore_source": {"hot": hot["restore_source"], "store": store["restore_source"]},
        **gp, "targets": {"raysc_hot_mttr_s": "<= 3", "ray_train_over_raysc_hot": ">= 3"}}))


if __name__ == "__main__":
    main()
