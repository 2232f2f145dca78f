"""Mixture loader throughput against what training consumes, side by side in one run.

Data: two domains of packed rows (``--seq-len``, random tokens; the loader never looks at
them) under a two-phase ``data.schedule``. Measured on this machine:

- ``loader_samples_per_s``: ``MixtureLoader.next_batch`` alone (assignment of every sample of
  the global batch on every rank, the gather of this rank's rows and the int64 tensor), for a
  dp rank of ``--dp`` (each rank computes the whole global batch's assignments).
- ``train_samples_per_s``: samples per second a ``Trainer`` consumes with the same loader
  (through the ``Prefetcher`` as in a worker), tiny model of ``--dim`` on this CPU.
- ``ratio``: loader / training (target ≥ 20×), and ``stall_fraction``: the share of training
  time spent waiting for the prefetcher's next batch.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysc.config import load_config  # noqa: E402
from raysc.config.syntax import parse_schedule  # noqa: E402
from raysc.data.mixture import MixtureLoader, Prefetcher  # noqa: E402
from raysc.train.trainer import Trainer  # noqa: E402


def domains(seq_len: int, vocab: int, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {name: rng.integers(0, vocab, (n, seq_len + 1), dtype=np.uint16) for name, n in sizes.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--dp", type=int, default=8, help="data-parallel size the loader slices for")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    rows = domains(args.seq_len, 2048, {"prose": 20_000, "code": 8_000})
    tokens_per_step = args.global_batch * args.seq_len
    schedule = f"0:prose=0.7,code=0.3; {tokens_per_step * 1000}:prose=0.3,code=0.7"

    loader = MixtureLoader(rows, parse_schedule(schedule), 0, args.global_batch, args.seq_len, 0, args.dp)
    batches = 2000
    t0 = time.perf_counter()
    for _ in range(batches):
        loader.next_batch()
    dt = time.perf_counter() - t0
    loader_sps = batches * args.global_batch / dt  # global samples advanced per second
    print(f"loader: {batches} global batches of {args.global_batch} in {dt:.2f} s", flush=True)

    cfg = load_config(None, ["model.vocab_size=2048", f"model.dim={args.dim}", "model.n_layers=2", "model.n_heads=4",
                             "model.n_kv_heads=2", f"train.seq_len={args.seq_len}",
                             f"train.global_batch={args.global_batch}", f"train.steps={args.steps}",
                             f'data.schedule="{schedule}"', "schedule.warmup_steps=2"])
    trainer = Trainer(cfg, rows, measure_peak=False)
    assert isinstance(trainer.loader, Prefetcher)
    waited = 0.0
    real_next = trainer.loader.next_batch

    def timed_next():
        nonlocal waited
        t = time.perf_counter()
        out = real_next()
        waited += time.perf_counter() - t
        return out

    trainer.loader.next_batch = timed_next
    trainer.train_step()  # warm-up
    waited = 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    dt = time.perf_counter() - t0
    trainer.loader.close()
    train_sps = args.steps * args.global_batch / dt
    print(f"training: {args.steps} steps in {dt:.2f} s, waited {waited:.4f} s for data", flush=True)
    print(json.dumps({"seq_len": args.seq_len, "global_batch": args.global_batch, "dp": args.dp,
                      "loader_samples_per_s": round(loader_sps, 1), "train_samples_per_s": round(train_sps, 1),
                      "ratio": round(loader_sps / train_sps, 1), "stall_fraction": round(waited / dt, 5),
                      "target_ratio": 20}))


if __name__ == "__main__":
    main()
