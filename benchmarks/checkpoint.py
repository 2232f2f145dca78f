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

Both sides run at every concurrency ``c`` in ``BENCH_CKPT_CONCURRENCY`` (default 1,2,4, plus
raysc's default): raysc with ``checkpoint.transfer_concurrency = c`` (``c`` files at once, large
files in ``c`` ranged GETs), the baseline with fsspec's bulk ``pipe`` / ``cat`` moving ``c`` files
at once and s3fs splitting large files into up to ``c`` parallel parts (multipart upload, ranged
GETs). The headline ratios take each side at its fastest ``c`` (the physical limit of this machine
and store); the ratios at raysc's default ``c`` are given too. ``BENCH_CKPT_REPEATS`` (default 3)
interleaved repeats, medians.

Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import shutil
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


def plain_write(fs, bucket: str, prefix: str, blobs: dict[str, bytes], c: int) -> float:
    """Seconds for fsspec to write ``blobs`` under ``prefix``, ``c`` files at once, ``c`` parts each."""
    t0 = time.perf_counter()
    fs.pipe({f"{bucket}/{prefix}/{n}": b for n, b in blobs.items()}, batch_size=c, max_concurrency=c)
    return time.perf_counter() - t0


def plain_read(fs, bucket: str, prefix: str, names: list[str], c: int) -> float:
    """Seconds for fsspec to read ``names`` back, ``c`` files at once, ``c`` ranged GETs each."""
    t0 = time.perf_counter()
    fs.cat([f"{bucket}/{prefix}/{n}" for n in names], batch_size=c, max_concurrency=c)
    return time.perf_counter() - t0


def throughput(bucket: str, options: dict, repeats: int, levels: list[int]) -> dict:
    model, opt = model_and_optimizer()
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-ckpt-"))
    default_c = CheckpointStore(f"s3://{bucket}/probe", options).storage.concurrency
    levels = sorted({*levels, default_c})
    times = {c: {"save": [], "write": [], "load": [], "read": []} for c in levels}
    nbytes, nfiles = 0, 0
    for i in range(repeats):  # interleaved: every concurrency, both sides, in each repeat
        step = i + 1
        for c in levels:
            store = CheckpointStore(f"s3://{bucket}/ours-c{c}", options, concurrency=c)
            local = tmp / f"stage-c{c}"
            t0 = time.perf_counter()
            names, digests = stage_shards(local, model, opt, {"step": step}, rank=0)
            files = store.upload(step, local, names, digests)
            store.commit(step, files, {"tokens": 0})
            times[c]["save"].append(time.perf_counter() - t0)
            nbytes, nfiles = sum(f["size"] for f in files), len(files)
            blobs = {n: (local / n).read_bytes() for n in names}
            shutil.rmtree(local)
            times[c]["write"].append(plain_write(store.storage.fs, bucket, f"plain-c{c}-{step}", blobs, c))
            del blobs

            fresh = tmp / f"fetch-c{c}"
            t0 = time.perf_counter()
            store.fetch(step, fresh)
            load_local(fresh, model, opt, rank=0)
            times[c]["load"].append(time.perf_counter() - t0)
            shutil.rmtree(fresh)
            times[c]["read"].append(plain_read(store.storage.fs, bucket, f"plain-c{c}-{step}", names, c))
    med = {c: {k: statistics.median(v) for k, v in t.items()} for c, t in times.items()}

    def best(kind: str) -> int:
        return min(levels, key=lambda c: med[c][kind])

    by_c = {c: {k: round(v, 3) for k, v in m.items()} for c, m in med.items()}
    return {
        "checkpoint_bytes": nbytes,
        "checkpoint_files": nfiles,
        "repeats": repeats,
        "default_concurrency": default_c,
        "seconds_by_concurrency": by_c,
        "best_concurrency": {k: best(k) for k in ("save", "write", "load", "read")},
        # each side at its fastest concurrency (the physical limit of this machine and store)
        "save_throughput_ratio": round(med[best("write")]["write"] / med[best("save")]["save"], 3),
        "load_throughput_ratio": round(med[best("read")]["read"] / med[best("load")]["load"], 3),
        # raysc at its default concurrency against the baseline at the same concurrency
        "save_ratio_at_default": round(med[default_c]["write"] / med[default_c]["save"], 3),
        "load_ratio_at_default": round(med[default_c]["read"] / med[default_c]["load"], 3),
    }


def stall(bucket: str, options: dict) -> dict:
    import ray

    from raysc.config import load_config
    from raysc.fleet.driver import train
    from raysc.fleet.records import read_jsonl

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-stall-"))
    opts = "{" + ", ".join(f'{k} = "{v}"' for k, v in options.items()) + "}"
    out = {}
    for mode in ("true", "false"):
        cfg = load_config(
            ROOT / "jobs/configs/tiny.toml",
            [
                "train.steps=60",
                "checkpoint.every_steps=10",
                f"checkpoint.async={mode}",
                "parallel.cpus_per_worker=2",
                "model.dim=256",
                "model.n_layers=4",
                "model.n_heads=8",
                "model.n_kv_heads=4",
                "model.vocab_size=8192",
                f'checkpoint.uri="s3://{bucket}/stall-{mode}"',
                f"checkpoint.storage_options={opts}",
                "checkpoint.keep_last=2",
                f'run.dir="{tmp / mode}"',
                f'data.cache_dir="{ROOT / ".cache/raysc"}"',
            ],
        )
        train(cfg, progress=False)
        saves = [e for e in read_jsonl(tmp / mode / "events.jsonl") if e["kind"] == "checkpoint_saved"]
        out[mode] = {
            "stall_s": statistics.mean(e["stall_s"] for e in saves),
            "total_s": statistics.mean(e["total_s"] for e in saves),
            "saves": len(saves),
        }
    ray.shutdown()
    return {
        "async_stall_s": round(out["true"]["stall_s"], 4),
        "sync_save_s": round(out["false"]["total_s"], 4),
        "async_stall_over_sync_save": round(out["true"]["stall_s"] / out["false"]["total_s"], 4),
        "saves_per_run": out["true"]["saves"],
    }


def main() -> None:
    server, bucket, options = start_s3()
    try:
        levels = [int(c) for c in os.environ.get("BENCH_CKPT_CONCURRENCY", "1,2,4").split(",")]
        tp = throughput(bucket, options, int(os.environ.get("BENCH_CKPT_REPEATS", "3")), levels)
        print(
            f"save {tp['save_throughput_ratio']}x, load {tp['load_throughput_ratio']}x of plain fsspec (each at its "
            f"best concurrency, {tp['best_concurrency']}); seconds by concurrency {tp['seconds_by_concurrency']}",
            flush=True,
        )
        st = stall(bucket, options)
    finally:
        server.stop()
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "store": "moto S3 on 127.0.0.1",
                **tp,
                **st,
                "targets": {
                    "save_throughput_ratio": ">= 0.8",
                    "load_throughput_ratio": ">= 0.8",
                    "async_stall_over_sync_save": "<= 0.1",
                },
            }
        )
    )


if __name__ == "__main__":
    main()
