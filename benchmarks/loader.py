"""Mixture loader supply against what one data-parallel rank consumes, side by side in one run.

Data: two domains of packed rows (``--seq-len``, random tokens; the loader never looks at
them) under a two-phase ``data.schedule``. Both figures are per rank: the loader is rank 0 of
``--dp`` ranks, and a rank receives and trains ``--global-batch / --dp`` samples per step.
Measured on this machine:

- ``loader_samples_per_s``: samples rank 0 receives per second from ``MixtureLoader.next_batch``
  alone (assignment of every sample of the global batch, which each rank computes, the gather of
  this rank's rows and the int64 tensor).
- ``train_samples_per_s``: samples per second one process consumes training a rank's share
  (``--global-batch / --dp`` samples per step, tiny model of ``--dim`` on this CPU), fed by the
  same rank-0 loader through the ``Prefetcher`` as in a worker. No gradient all-reduce runs, so
  a real rank consumes at most this much.
- ``ratio``: supply / consumption (target ≥ 20×), and ``stall_fraction``: the share of training
  time spent waiting for the prefetcher's next batch.

Each figure is the median of ``--repeats`` timed repetitions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def supply(loader: MixtureLoader, batches: int) -> float:
    """Samples per second ``loader`` hands its rank."""
    t0 = time.perf_counter()
    got = sum(len(loader.next_batch()) for _ in range(batches))
    return got / (time.perf_counter() - t0)


def consumption(trainer: Trainer, steps: int) -> tuple[float, float]:
    """(samples per second ``trainer`` consumes, share of the time it waited for a batch)."""
    waited, samples = 0.0, 0
    real_next = trainer.loader.next_batch

    def timed_next():
        nonlocal waited, samples
        t = time.perf_counter()
        out = real_next()
        waited += time.perf_counter() - t
        samples += len(out)
        return out

    trainer.loader.next_batch = timed_next
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    dt = time.perf_counter() - t0
    trainer.loader.next_batch = real_next
    return samples / dt, waited / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--dp", type=int, default=8, help="data-parallel size; the loader is rank 0 of it")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20, help="training steps per repetition")
    ap.add_argument("--batches", type=int, default=2000, help="loader batches per repetition")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = domains(args.seq_len, 2048, {"prose": 20_000, "code": 8_000})
    per_rank = args.global_batch // args.dp
    schedule = f"0:prose=0.7,code=0.3; {args.global_batch * args.seq_len * 1000}:prose=0.3,code=0.7"

    def rank0() -> MixtureLoader:
        return MixtureLoader(rows, parse_schedule(schedule), 0, args.global_batch, args.seq_len, 0, args.dp)

    loader = rank0()
    supplies = [supply(loader, args.batches) for _ in range(args.repeats)]
    print(f"loader (rank 0 of dp={args.dp}): {[round(s) for s in supplies]} samples/s", flush=True)

    # one rank's share of the step: global_batch / dp sequences, single process
    cfg = load_config(
        None,
        [
            "model.vocab_size=2048",
            f"model.dim={args.dim}",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            f"train.seq_len={args.seq_len}",
            f"train.global_batch={per_rank}",
            f"train.steps={args.steps * args.repeats + 1}",
            "schedule.warmup_steps=2",
        ],
    )
    trainer = Trainer(cfg, rows, measure_peak=False)
    trainer.loader.close()
    trainer.loader = Prefetcher(rank0(), cfg.data.prefetch)  # the rank's data path: rank 0 of dp
    trainer._domain_epochs = trainer.loader.epochs
    trainer.train_step()  # warm-up
    runs = [consumption(trainer, args.steps) for _ in range(args.repeats)]
    trainer.loader.close()
    print(
        f"training a rank's share ({per_rank} samples/step): {[round(r[0], 1) for r in runs]} samples/s, "
        f"waited {[round(r[1], 5) for r in runs]} of the time",
        flush=True,
    )
    med = statistics.median
    loader_sps, train_sps = med(supplies), med(r[0] for r in runs)
    print(
        json.dumps(
            {
                "benchmark": "loader",
                "seq_len": args.seq_len,
                "global_batch": args.global_batch,
                "dp": args.dp,
                "rank": 0,
                "samples_per_rank_step": per_rank,
                "repeats": args.repeats,
                "loader_samples_per_s": round(loader_sps, 1),
                "train_samples_per_s": round(train_sps, 1),
                "ratio": round(loader_sps / train_sps, 1),
                "stall_fraction": round(med(r[1] for r in runs), 5),
                "target_ratio": 20,
            }
        )
    )


if __name__ == "__main__":
    main()
