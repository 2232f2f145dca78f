"""Parallel layouts on this machine: throughput relative to world size 1, and pipeline bubbles.

Part 1 trains the parity model (4 layers, dim 64) for a few steps under each tested layout through
the real fleet (supervisor, Ray actors, gloo) and reports steady-state tokens/s relative to world
size 1 measured in the same run. On a 2-core machine these ratios mostly measure CPU
oversubscription and gloo overhead, not scaling; they are recorded to catch regressions.

Part 2 measures the bubble of the pipeline schedules with stages whose compute is a timed sleep
(forward t, backward 2t) run through the real ``torch.distributed.pipelining`` schedules over
gloo. Sleeping stages do not compete for the two cores, so the measured step time shows the
schedule itself: bubble = 1 − m·(t_f + t_b) / step_time per rank, next to the theory
(p−1)/(m+p−1) for GPipe and 1F1B and (p−1)/(v·m+p−1) for interleaved 1F1B. The same schedule run
with zero-time stages gives the runtime's own cost per step (Python, gloo send/recv: about 1 ms per
action here, which a GPU run overlaps with kernels); ``measured_net_of_runtime`` subtracts it and is
what the 25% target is checked on. Both figures are printed.

Part 3 times the global gradient norm on a model of many small parameters (48 blocks of dim 32: 435
tensors) under ``dp_shard=2 × tp=2`` (4 forked gloo processes, one thread each): the grouped norm
(``raysc.parallel.clip``: one all-reduce per mesh dim) against the per-parameter assembly it replaced
(one ``full_tensor`` reduction per DTensor, kept below as the baseline), each in the same processes,
alternating, the median of 3 runs of 5 steps (GRADNORM_REPS, GRADNORM_STEPS): the whole training step (the same step with
``global_grad_norm`` swapped) and the norm call alone, both ways on the same gradients, whose two
norms are printed to show they agree.

``python benchmarks/parallel.py [layouts] [bubbles] [gradnorm]`` runs the parts named (default all).
Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
T_FWD = float(os.environ.get("BENCH_T_FWD", "0.05"))
LAYOUTS = [
    "dp_replicate=2",
    "dp_shard=2",
    "tp=2",
    "tp=2,sequence_parallel=true",
    "pp=2,pp_schedule=gpipe",
    "pp=2,pp_schedule=1f1b",
    "pp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2",
    "cp=2",
    "dp_shard=2,tp=2",
    "pp=2,tp=2",
    "pp=2,dp_shard=2,tp=2",
    "cp=2,tp=2",
    "dp_replicate=2,dp_shard=2",
]
MODEL = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=64",
    "train.global_batch=8",
    "schedule.warmup_steps=2",
    "data.max_corpus_mb=1.0",
    "data.tokenizer_sample_mb=0.5",
    "parallel.cpus_per_worker=0.25",
    "train.steps=20",
    "checkpoint.every_steps=0",
    f'data.cache_dir="{ROOT / ".cache/raysc"}"',
]


# ---------------- part 1: layouts through the fleet ----------------
def layout_throughput() -> dict:
    import ray

    from raysc.config import load_config
    from raysc.fleet.driver import train
    from raysc.fleet.parity import layout_overrides
    from raysc.fleet.records import read_jsonl

    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=False)
    tmp = Path(tempfile.mkdtemp(prefix="raysc-bench-par-"))

    def tps(layout: str) -> float:
        name = layout.replace(",", "_").replace("=", "") or "single"
        cfg = load_config(None, [*MODEL, *layout_overrides(layout), f'run.dir="{tmp / name}"'])
        train(cfg, progress=False)
        m = read_jsonl(tmp / name / "metrics.jsonl")
        a, b = m[4], m[-1]  # skip warm-up steps
        return (b["tokens"] - a["tokens"]) / (b["time"] - a["time"])

    base = tps("")
    out = {"world1_tokens_per_s": round(base, 1)}
    for layout in LAYOUTS:
        out[layout] = round(tps(layout) / base, 3)
        print(f"{layout}: {out[layout]}x of world size 1", flush=True)
    ray.shutdown()
    return out


# ---------------- part 2: pipeline bubbles with sleeping stages ----------------
class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        ctx.t = t
        time.sleep(t)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.t)
        return g.clone(), None


class SleepStage(nn.Module):
    def __init__(self, t: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.t = t

    def forward(self, x):
        return _Sleep.apply(x * self.w, self.t)


def _time_schedule(
    schedule: str, virtual: int, ids: list[int], world: int, m: int, t: float, first: bool, last: bool
) -> float:
    """Best of two timed steps (after one warm-up) of ``schedule`` with sleeping stages."""
    from torch.distributed.pipelining import PipelineStage

    from raysc.parallel.pp import SCHEDULES

    stages = [PipelineStage(SleepStage(t), s, world * virtual, torch.device("cpu")) for s in ids]
    loss = lambda y, tgt: (y - tgt).pow(2).mean()  # noqa: E731
    cls = SCHEDULES[schedule]
    sched = (
        cls(stages, n_microbatches=m, loss_fn=loss) if virtual > 1 else cls(stages[0], n_microbatches=m, loss_fn=loss)
    )
    x = torch.ones(m, 4)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*((x,) if first else ()), target=x if last else None, losses=[] if last else None)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _bubble_worker(rank: int, world: int, port: int, results) -> None:
    from raysc.parallel.pp import stage_ids

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = {}
    for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for m in (world * 2, world * 4):
            ids = stage_ids(rank, world, virtual)
            first, last = 0 in ids, world * virtual - 1 in ids
            step = _time_schedule(schedule, virtual, ids, world, m, T_FWD / virtual, first, last)
            overhead = _time_schedule(schedule, virtual, ids, world, m, 0.0, first, last)
            busy = m * 3 * T_FWD  # each rank: m microbatches × (fwd t + bwd 2t) over its v chunks
            p, v = world, virtual
            out[f"pp{p}_{schedule}_m{m}"] = {
                "measured": round(1 - busy / step, 4),
                "measured_net_of_runtime": round(1 - busy / (step - overhead), 4),
                "runtime_overhead_s": round(overhead, 4),
                "theory": round((p - 1) / (v * m + p - 1), 4),
            }
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def bubbles() -> dict:
    from raysc.cluster.ports import free_port

    manager = mp.Manager()
    results = manager.dict()
    for world in (2, 4):
        mp.spawn(_bubble_worker, args=(world, free_port(), results), nprocs=world, join=True)
    return dict(results)


# ---------------- part 3: grouped vs per-parameter gradient-norm reductions ----------------
SMALL = [
    "model.vocab_size=512",
    "model.dim=32",
    "model.n_layers=48",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "train.seq_len=16",
    "train.global_batch=4",
    "parallel.dp_shard=2",
    "parallel.tp=2",
]


@torch.no_grad()
def per_parameter_norm(params: list[torch.Tensor], pp_group) -> torch.Tensor:
    """The assembly ``raysc.parallel.clip`` replaced: each gradient's norm reduced on its own."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float32)
    for g in (p.grad for p in params if p.grad is not None):
        n = torch.linalg.vector_norm(g, dtype=torch.float32)
        total += (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _seconds_per_call(fn, n: int) -> float:
    """Wall time of ``n`` calls of ``fn`` on every rank (barriers on both sides), per call."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def _gradnorm_worker(rank: int, port: int, results) -> None:
    import statistics

    import numpy as np

    from raysc.config import load_config
    from raysc.parallel import clip
    from raysc.parallel.dims import build_mesh
    from raysc.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    cfg = load_config(None, SMALL)
    rows = np.random.default_rng(0).integers(0, 512, size=(64, 17))
    trainer = Trainer(cfg, rows, rank=rank, mesh=build_mesh(cfg.parallel.dims, "cpu"), measure_peak=False)
    grouped = clip.global_grad_norm
    ways = {"grouped": grouped, "per_parameter": per_parameter_norm}
    trainer.train_step()  # warm-up
    times: dict = {f"{w}_{k}": [] for w in ways for k in ("step_s", "norm_s")}
    norms = {}
    reps, steps = int(os.environ.get("GRADNORM_REPS", 3)), int(os.environ.get("GRADNORM_STEPS", 5))
    for _ in range(reps):
        for way, fn in ways.items():
            clip.global_grad_norm = fn  # what clip_grad_norm calls inside the step
            times[f"{way}_step_s"].append(_seconds_per_call(trainer.train_step, steps))
        with trainer._loss_ctx():  # one set of gradients, normed both ways
            trainer._forward_backward(*trainer._inputs(trainer.loader.next_batch()))
        for way, fn in ways.items():
            times[f"{way}_norm_s"].append(_seconds_per_call(lambda fn=fn: fn(trainer.params, trainer.pp_group), steps))
            norms[way] = float(fn(trainer.params, trainer.pp_group))
        trainer.optimizer.zero_grad(set_to_none=True)
    clip.global_grad_norm = grouped
    if rank == 0:
        out = {k: round(statistics.median(v), 5) for k, v in times.items()}
        out.update(
            parameters=len(trainer.params),
            norm_grouped=norms["grouped"],
            norm_per_parameter=norms["per_parameter"],
            step_speedup=round(out["per_parameter_step_s"] / out["grouped_step_s"], 3),
            norm_speedup=round(out["per_parameter_norm_s"] / out["grouped_norm_s"], 2),
        )
        results.update(out)
    dist.destroy_process_group()


def gradnorm() -> dict:
    from raysc.cluster.ports import free_port

    results = mp.Manager().dict()
    mp.start_processes(_gradnorm_worker, args=(free_port(), results), nprocs=4, start_method="fork")
    return dict(results)


def main() -> None:
    parts = set(sys.argv[1:]) or {"layouts", "bubbles", "gradnorm"}
    out: dict = {"benchmark": "parallel"}
    if "layouts" in parts:
        out["throughput_vs_world1"] = layout_throughput()
    if "bubbles" in parts:
        bub = bubbles()
        for k, v in sorted(bub.items()):
            print(
                f"bubble {k}: measured {v['measured']:.3f} (net of runtime overhead "
                f"{v['measured_net_of_runtime']:.3f}) theory {v['theory']:.3f}",
                flush=True,
            )
        out["bubble"] = bub
        out["bubble_within_25pct_of_theory"] = all(
            abs(v["measured_net_of_runtime"] - v["theory"]) <= 0.25 * v["theory"] for v in bub.values()
        )
        out["stage_t_fwd_s"] = T_FWD
    if "gradnorm" in parts:
        out["grad_norm"] = g = gradnorm()
        print(
            f"grad norm over {g['parameters']} tensors, dp_shard=2 x tp=2: step {g['grouped_step_s'] * 1e3:.1f} ms "
            f"grouped vs {g['per_parameter_step_s'] * 1e3:.1f} ms per parameter ({g['step_speedup']}x); norm alone "
            f"{g['grouped_norm_s'] * 1e3:.2f} vs {g['per_parameter_norm_s'] * 1e3:.2f} ms",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
