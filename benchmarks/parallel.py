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
LAYOUTS = ["dp_replicate=2", "dp_shard=2", "tp=2", "tp=2,sequence_parallel=true", "pp=2,pp_schedule=gpipe",
           "pp=2,pp_schedule=1f1b", "pp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2", "cp=2",
           "dp_shard=2,tp=2", "pp=2,tp=2", "pp=2,dp_shard=2,tp=2", "cp=2,tp=2", "dp_replicate=2,dp_shard=2"]
MODEL = ["model.vocab_size=512", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "train.seq_len=64", "train.global_batch=8", "schedule.warmup_steps=2", "data.max_corpus_mb=1.0",
         "data.tokenizer_sample_mb=0.5", "parallel.cpus_per_worker=0.25", "train.steps=20",
         "checkpoint.every_steps=0", f'data.cache_dir="{ROOT / ".cache/raysc"}"']


# ---------------- part 1: layouts through the fleet ----------------
def layout_throughput() -> dict:
    import ray

    from raysc.config import load_config
    from raysc.driver import train
    from raysc.fleet.records import read_jsonl
    from raysc.parity import layout_overrides

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


def _time_schedule(schedule: str, virtual: int, ids: list[int], world: int, m: int, t: float,
                   first: bool, last: bool) -> float:
    """Best of two timed steps (after one warm-up) of ``schedule`` with sleeping stages."""
    from torch.distributed.pipelining import PipelineStage

    from raysc.parallel.pp import SCHEDULES

    stages = [PipelineStage(SleepStage(t), s, world * virtual, torch.device("cpu")) for s in ids]
    loss = lambda y, tgt: (y - tgt).pow(2).mean()  # noqa: E731
    cls = SCHEDULES[schedule]
    sched = cls(stages, n_microbatches=m, loss_fn=loss) if virtual > 1 else \
        cls(stages[0], n_microbatches=m, loss_fn=loss)
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
    from raysc.ports import free_port

    manager = mp.Manager()
    results = manager.dict()
    for world in (2, 4):
        mp.spawn(_bubble_worker, args=(world, free_port(), results), nprocs=world, join=True)
    return dict(results)


def main() -> None:
    layouts = layout_throughput()
    bub = bubbles()
    for k, v in sorted(bub.items()):
        print(f"bubble {k}: measured {v['measured']:.3f} (net of runtime overhead "
              f"{v['measured_net_of_runtime']:.3f}) theory {v['theory']:.3f}", flush=True)
    within = all(abs(v["measured_net_of_runtime"] - v["theory"]) <= 0.25 * v["theory"] for v in bub.values())
    print(json.dumps({"benchmark": "parallel", "throughput_vs_world1": layouts, "bubble": bub,
                      "bubble_within_25pct_of_theory": within, "stage_t_fwd_s": T_FWD}))


if __name__ == "__main__":
    main()
