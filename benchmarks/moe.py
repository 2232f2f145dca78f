"""The mixture-of-experts block on this machine (issue 58): what it costs and how well it balances.

Four measurements, one process, the same torch thread count throughout (``BENCH_THREADS``, default 2):

1. **Grouped GEMM against a loop over experts**: ``GroupedExperts`` (one ``torch._grouped_mm`` per
   projection) against ``expert_loop`` (one matmul per expert, the reference its tests compare with), on
   the tokens of one tiny-moe step (16 × 128 tokens, top-2 of 8 experts, sorted by expert with a
   realistic, uneven split), forward and backward; the median of ``BENCH_REPS`` timings of each,
   alternated.
2. **The MoE against a dense model of the same active parameters**: ``jobs/configs/tiny-moe.toml``'s
   model (8 experts of 256, top-2, in 3 of 4 layers) against the same model dense with ffn_dim 512 (two
   experts' worth: the parameters a token goes through, less the router's 1,024 a layer); training
   tokens/s of ``Trainer.train_step`` from step 10 on, the runs alternated, the median of ``BENCH_REPS``.
3. **Load balance** after ``BENCH_BALANCE_STEPS`` (default 200) steps of tiny-moe with no balancing,
   with the switch auxiliary loss (0.01, the shipped config's), and with DeepSeek-V3's selection bias
   (rate 1e-3, no auxiliary loss): the mean over the last 50 steps of the busiest expert's load over
   the mean (worst layer; 1.0 is perfect), dead experts, and the final loss.
4. **Expert parallelism**: tiny-moe on two gloo ranks (``dp_shard=2``, one torch thread each, forked
   from this process), ``ep=1`` (each rank holds every expert, FSDP-sharded) against ``ep=2`` (each holds
   four and tokens travel by all-to-all): training tokens/s from step 10 on, the runs alternated, the
   median of ``BENCH_EP_REPS`` (default 3); and the all-to-all's share of an ``ep=2`` step, from torch's
   profiler on rank 0 (the self CPU time of the all-to-all and wait ops, forward and backward, over
   the wall time of ``BENCH_EP_STEPS`` profiled steps).

Prints JSON on its last line.
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
from raysc.model.moe import GroupedExperts, expert_loop  # noqa: E402
from raysc.train.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THREADS = int(os.environ.get("BENCH_THREADS", "2"))
REPS = int(os.environ.get("BENCH_REPS", "5"))
TPS_STEPS = int(os.environ.get("BENCH_STEPS", "40"))
BALANCE_STEPS = int(os.environ.get("BENCH_BALANCE_STEPS", "200"))
EP_REPS = int(os.environ.get("BENCH_EP_REPS", "3"))
EP_STEPS = int(os.environ.get("BENCH_EP_STEPS", "30"))
COMM_OPS = ("all_to_all", "alltoall", "wait_tensor")
SHIPPED = ROOT / "jobs/configs/tiny-moe.toml"


def _config(run_dir: str, *sets: str):
    cache = ROOT / ".cache/raysc"
    return load_config(SHIPPED, [f'data.cache_dir="{cache}"', f'run.dir="{run_dir}"', *sets])


def grouped_vs_loop() -> dict:
    """Forward + backward of one step's routed tokens through 8 experts, grouped GEMM against the loop."""
    torch.manual_seed(0)
    cfg = load_config(SHIPPED).model
    experts = GroupedExperts(cfg.dim, cfg.moe_hidden_dim, cfg.moe_experts)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    tokens = 16 * 128 * cfg.moe_top_k
    share = torch.tensor([0.22, 0.17, 0.14, 0.12, 0.11, 0.10, 0.08, 0.06])  # an uneven, realistic load
    counts = (share * tokens).long()
    counts[0] += tokens - int(counts.sum())
    x = torch.randn(tokens, cfg.dim, requires_grad=True)
    grad = torch.randn(tokens, cfg.dim)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(5):
            fn(experts, x, counts).backward(grad)
        return (time.perf_counter() - t0) / 5

    grouped, loop = [], []
    for _ in range(REPS):
        grouped.append(timed(lambda e, a, c: e(a, c)))
        loop.append(timed(expert_loop))
    g, lo = statistics.median(grouped), statistics.median(loop)
    return {
        "tokens": tokens,
        "grouped_ms": round(g * 1e3, 2),
        "loop_ms": round(lo * 1e3, 2),
        "loop_over_grouped": round(lo / g, 3),
    }


def _rate(ms: list[dict]) -> float:
    """Training tokens/s of the steps ``ms`` from step 10 on (the first ones warm up)."""
    warm = ms[9:]
    return (warm[-1]["tokens"] - warm[0]["tokens"]) / (warm[-1]["time"] - warm[0]["time"])


def _tps(cfg, rows) -> float:
    t = Trainer(cfg, rows, measure_peak=False)
    return _rate([t.train_step() for _ in range(TPS_STEPS)])


def moe_vs_dense(tmp: str) -> dict:
    moe_cfg = _config(tmp, f"train.steps={TPS_STEPS}")
    dense_cfg = _config(tmp, f"train.steps={TPS_STEPS}", "model.moe_experts=0", "model.ffn_dim=512")
    rows = prepare_data(moe_cfg)[0].train
    moe, dense = [], []
    for _ in range(REPS):
        moe.append(_tps(moe_cfg, rows))
        dense.append(_tps(dense_cfg, rows))
    from raysc.model.flops import param_count

    m, d = statistics.median(moe), statistics.median(dense)
    return {
        "moe_tokens_per_s": round(m),
        "dense_tokens_per_s": round(d),
        "moe_over_dense": round(m / d, 3),
        "moe_params": param_count(moe_cfg.model),
        "dense_params": param_count(dense_cfg.model)["total"],
    }


def balance(tmp: str) -> dict:
    variants = {
        "none": ["model.moe_aux_loss_coeff=0.0", "model.moe_z_loss_coeff=0.0"],
        "aux_loss_0.01": [],
        "bias_1e-3": ["model.moe_aux_loss_coeff=0.0", "model.moe_bias_update_rate=0.001"],
    }
    out = {}
    for name, sets in variants.items():
        cfg = _config(tmp, f"train.steps={BALANCE_STEPS}", *sets)
        t = Trainer(cfg, prepare_data(cfg)[0].train, measure_peak=False)
        ms = [t.train_step() for _ in range(BALANCE_STEPS)]
        last = ms[-50:]
        out[name] = {
            "load_max_mean": round(statistics.mean(m["moe_load_max"] for m in last), 3),
            "dead_experts_mean": round(statistics.mean(m["moe_dead_experts"] for m in last), 2),
            "final_loss": round(statistics.mean(m["loss"] for m in last), 4),
        }
        print(name, out[name], flush=True)
    return out


def _ep_rank(rank: int, port: int, ep: int, tmp: str, out: str) -> None:
    """One of two gloo ranks training tiny-moe at dp_shard=2 and ``ep``; rank 0 writes its figures."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from raysc.parallel.dims import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    steps = 10 + EP_STEPS * 2
    cfg = _config(tmp, f"train.steps={steps}", "parallel.dp_shard=2", f"parallel.ep={ep}")
    rows = prepare_data(cfg)[0].train
    t = Trainer(cfg, rows, rank=rank, mesh=build_mesh(cfg.parallel.dims, "cpu"), measure_peak=False)
    tps = _rate([t.train_step() for _ in range(10 + EP_STEPS)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(EP_STEPS):
            t.train_step()
        wall = time.perf_counter() - t0
    comm = sum(e.self_cpu_time_total for e in prof.key_averages() if any(k in e.key for k in COMM_OPS)) / 1e6
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"tokens_per_s": tps, "comm_share": comm / wall}))


def expert_parallel(tmp: str) -> dict:
    """tokens/s at ep=1 and ep=2 on two ranks, alternated; the all-to-all's share of an ep=2 step."""
    import torch.multiprocessing as mp

    from raysc.cluster.ports import free_port

    prepare_data(_config(tmp))  # tokenized once, here
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(EP_REPS):
        for ep in (1, 2):
            out = Path(tmp) / f"ep{ep}.json"
            mp.start_processes(_ep_rank, args=(free_port(), ep, tmp, str(out)), nprocs=2, start_method="fork")
            runs[ep].append(json.loads(out.read_text()))
            print(f"ep={ep}", runs[ep][-1], flush=True)
    one = statistics.median(r["tokens_per_s"] for r in runs[1])
    two = statistics.median(r["tokens_per_s"] for r in runs[2])
    return {
        "ranks": 2,
        "ep1_tokens_per_s": round(one),
        "ep2_tokens_per_s": round(two),
        "ep2_over_ep1": round(two / one, 3),
        "ep2_all_to_all_share": round(statistics.median(r["comm_share"] for r in runs[2]), 3),
        "ep1_comm_ops_share": round(statistics.median(r["comm_share"] for r in runs[1]), 3),
    }


def main() -> None:
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        result = {
            "threads": THREADS,
            "reps": REPS,
            "grouped_gemm": grouped_vs_loop(),
            "moe_vs_dense": moe_vs_dense(tmp),
            "balance": balance(tmp),
            "expert_parallel": expert_parallel(tmp),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
