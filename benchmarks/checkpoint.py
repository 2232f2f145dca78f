"""Checkpoint speed against the store itself, and the training stall of an async save.

All against an S3-compatible server (moto) on 127.0.0.1, side by side in one run:

1. Save throughput: raysc's save of a model + AdamW state (DCP staging on local disk, checksummed
   upload of every file, manifest) vs a plain fsspec write of the same bytes to the same store.
   Target: ratio >= 0.8.
2. Load throughput: raysc's verified fetch (download + SHA-256 of every file) and DCP load vs a
   plain fsspec read of the same bytes. Target: ratio >= 0.8.
3. Training stall: the fleet trains with checkpoints every few steps, once with
   ``checkpoint.async = true`` and once synchronous; the mean time training is held per save
   (async) relative to the mean duration of a synchronous save. Target: <= 0.1.

Prints JSON on its last line.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from raysc.checkpoint.staging import load_local, stage_shards  # noqa: E402
from raysc.checkpoint.store import CheckpointStore  # noqa: E402
from raysc.config import ModelConfig, OptimConfig  # noqa: E402
from raysc.model.llama import build_model  # noqa: E402
from raysc.train.optim import build_optimizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def start_s3():
    server, endpoint, bucket = common.start_s3()
    return server, bucket, common.s3_options(endpoint)


def model_and_optimizer():
    cfg = ModelConfig(vocab_size=8192, dim=384, n_layers=6, n_heads=6, n_kv_heads=2)
    model = build_model(cfg, 256, seed=0)
    opt = build_optimizer(list(model.parameters()), OptimConfig())
    model(torch.randint(0, 8192, (2, 64))).sum().backward()
    opt.step()  # materialise AdamW's moments
    return model, opt


def throughput(bucket: str, options: dict, repeats: int = 5) -> dict:
    model, opt = model_and_optimizer()
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-ckpt-"))
    store = CheckpointStore(f"s3://{bucket}/ours", options)  # default transfer_concurrency
    fs = store.storage.fs
    save_ours, save_plain, load_ours, load_plain = [], [], [], []
    nbytes = 0
    for i in range(repeats):
        step = i + 1
        local = tmp / f"stage{step}"
        t0 = time.perf_counter()
        names, digests = stage_shards(local, model, opt, {"step": step}, rank=0)
        files = store.upload(step, local, names, digests)
        store.commit(step, files, {"tokens": 0})
        save_ours.append(time.perf_counter() - t0)
        nbytes = sum(f["size"] for f in files)
        blobs = {n: (local / n).read_bytes() for n in names}
        t0 = time.perf_counter()
        for n, b in blobs.items():
            fs.pipe_file(f"{bucket}/plain{step}/{n}", b)
        save_plain.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        fresh = tmp / f"fetch{step}"
        store.fetch(step, fresh)
        load_local(fresh, model, opt, rank=0)
        load_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for n in blobs:
            fs.cat_file(f"{bucket}/plain{step}/{n}")
        load_plain.append(time.perf_counter() - t0)
    med = statistics.median
    return {"checkpoint_bytes": nbytes,
            "save_s": round(med(save_ours), 3), "plain_write_s": round(med(save_plain), 3),
            "save_throughput_ratio": round(med(save_plain) / med(save_ours), 3),
            "load_s": round(med(load_ours), 3), "plain_read_s": round(med(load_plain), 3),
            "load_throughput_ratio": round(med(load_plain) / med(load_ours), 3)}


def stall(bucket: str, options: dict) -> dict:
    import ray

    from raysc.config import load_config
    from raysc.driver import train
    from raysc.fleet.records import read_jsonl

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-stall-"))
    opts = "{" + ", ".join(f'{k} = "{v}"' for k, v in options.items()) + "}"
    out = {}
    for mode in ("true", "false"):
        cfg = load_config(ROOT / "jobs/configs/tiny.toml", [
            "train.steps=60", "checkpoint.every_steps=10", f"checkpoint.async={mode}", "parallel.cpus_per_worker=2",
            "model.dim=256", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=8192",
            f'checkpoint.uri="s3://{bucket}/stall-{mode}"', f"checkpoint.storage_options={opts}",
            "checkpoint.keep_last=2", f'run.dir="{tmp / mode}"', f'data.cache_dir="{ROOT / ".cache/raysc"}"'])
        train(cfg, progress=False)
        saves = [e for e in read_jsonl(tmp / mode / "events.jsonl") if e["kind"] == "checkpoint_saved"]
        out[mode] = {"stall_s": statistics.mean(e["stall_s"] for e in saves),
                     "total_s": statistics.mean(e["total_s"] for e in saves), "saves": len(saves)}
    ray.shutdown()
    return {"async_stall_s": round(out["true"]["stall_s"], 4), "sync_save_s": round(out["false"]["total_s"], 4),
            "async_stall_over_sync_save": round(out["true"]["stall_s"] / out["false"]["total_s"], 4),
            "saves_per_run": out["true"]["saves"]}


def main() -> None:
    server, bucket, options = start_s3()
    try:
        tp = throughput(bucket, options)
        print(f"save {tp['save_throughput_ratio']}x, load {tp['load_throughput_ratio']}x of plain fsspec", flush=True)
        st = stall(bucket, options)
    finally:
        server.stop()
    print(json.dumps({"benchmark": "checkpoint", "store": "moto S3 on 127.0.0.1", **tp, **st,
                      "targets": {"save_throughput_ratio": ">= 0.8", "load_throughput_ratio": ">= 0.8",
                                  "async_stall_over_sync_save": "<= 0.1"}}))


if __name__ == "__main__":
    main()
