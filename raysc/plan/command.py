"""``raysc plan CONFIG --gpus N ...``: the ranked table, the best layout as a config fragment,
and with ``--profile`` the measured check and calibration of the top candidates."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from raysc.config import Config, load_config
from raysc.plan.layout import Cluster
from raysc.plan.memory import estimate_memory
from raysc.plan.perf import estimate_step
from raysc.plan.search import format_size, format_table, heuristic_layout, plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``raysc plan`` but ``--set``, which ``raysc.cli`` declares once for every command."""
    p.add_argument("config", help="TOML config of the run to plan (its model, seq_len and global batch)")
    p.add_argument("--gpus", type=int, help="devices in the cluster (default on CPU: parallel.world_size)")
    p.add_argument("--gpus-per-node", type=int, help="devices per node (default 8; on CPU: --gpus)")
    p.add_argument("--gpu-mem-gb", type=float, help="memory per device in GB (default 80)")
    p.add_argument("--intra-gbps", type=float, help="GB/s per device inside a node (default 450, NVLink)")
    p.add_argument("--inter-gbps", type=float, help="GB/s per device between nodes (default 50, 400 Gb/s IB)")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 TFLOP/s per device (default 989, H100)")
    p.add_argument("--efficiency", type=float, help="achieved share of peak in matmuls (default 0.5)")
    p.add_argument("--headroom", type=float, help="share of device memory kept free (default 0.1)")
    p.add_argument("--overhead-gb", type=float, help="per-device memory outside tensors (default 3 GB on GPU)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--out", help="where the best layout's config fragment goes (default <run.dir>/plan.toml)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object last")
    p.add_argument("--profile", action="store_true", help="run the top candidates for a few steps and compare")
    p.add_argument("--profile-top", type=int, default=3, help="candidates to profile")
    p.add_argument("--profile-steps", type=int, default=6, help="steps per profiled candidate")
    g = p.add_argument_group("goodput under failures (--goodput)")
    g.add_argument(
        "--goodput",
        action="store_true",
        help="only the expected goodput with whole-job restarts and with peer healing, at --gpus and at "
        "1k/16k/100k devices (raysc.plan.goodput)",
    )
    g.add_argument(
        "--failure-rate",
        default="llama3",
        help="failures per 1,000 device-days, or llama3 (0.47), rsc1 (0.81), rsc2 (0.29) (default llama3)",
    )
    g.add_argument("--from-run", help="a run directory whose events and metrics give the measured costs below")
    g.add_argument("--save-stall-s", type=float, help="seconds a checkpoint save stalls training (C)")
    g.add_argument("--restart-s", type=float, help="seconds of a whole-job restart to the next completed step (R)")
    g.add_argument("--peer-heal-s", type=float, help="seconds every survivor loses to a peer heal (s)")
    g.add_argument("--step-s", type=float, help="seconds per training step (t)")
    g.add_argument("--interval-s", type=float, help="the run's checkpoint interval in seconds (T)")
    g.add_argument(
        "--uncovered", type=float, help="share of failures no peer covers, healed by a restart (default 0.01)"
    )
    p.add_argument(
        "--serve",
        action="store_true",
        help="only the serving memory per vLLM replica (weights at "
        "serve.dtype + KV cache for serve.max_num_seqs x max_model_len); needs no --gpus",
    )


def cluster_from_args(args: argparse.Namespace, cfg: Config) -> Cluster:
    cpu = cfg.parallel.device == "cpu"
    kw = {}
    for name in (
        "gpus_per_node",
        "gpu_mem_gb",
        "intra_gbps",
        "inter_gbps",
        "peak_tflops",
        "efficiency",
        "headroom",
        "overhead_gb",
    ):
        value = getattr(args, name)
        if value is not None:
            kw[name] = value
    gpus = args.gpus or (cfg.parallel.world_size if cpu else None)
    if not gpus:
        raise ValueError("raysc plan needs --gpus N (the devices of the cluster)")
    if cpu:  # the fleet is CPU workers on this machine: measured matmul peak, host memory, loopback links
        from raysc.train.throughput import measure_cpu_peak  # torch: only when measuring, not to build the CLI

        kw.setdefault("gpus_per_node", gpus)
        kw.setdefault("peak_tflops", measure_cpu_peak() / 1e12)
        kw.setdefault("gpu_mem_gb", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / gpus)
        kw.setdefault("intra_gbps", 2.0)
        kw.setdefault("inter_gbps", 1.0)
        kw.setdefault("overhead_gb", 0.0)
        kw.setdefault("headroom", 0.0)
        kw["device"] = "cpu"
    return Cluster(gpus=gpus, **kw)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.serve:
        from raysc.plan.serve_memory import format_serve_memory, serve_memory

        est = serve_memory(cfg)
        print(format_serve_memory(est), flush=True)
        if args.json:
            print(json.dumps({"serve": est}))
        return 0
    cluster = cluster_from_args(args, cfg)
    dtype = "fp32" if cluster.device == "cpu" or cfg.train.dtype == "fp32" else "bf16"
    gb = cfg.train.global_batch_sequences
    result = plan(cfg, cluster, dtype)
    if args.goodput:
        return _goodput(args, cluster, result)
    print(
        f"plan: {cfg.model.n_layers} layers × {cfg.model.dim}, seq {cfg.train.seq_len}, global batch {gb} on "
        f"{cluster.gpus} × {cluster.gpu_mem_gb:.0f} GB ({cluster.gpus_per_node} per node), {dtype}",
        flush=True,
    )
    print(format_table(result, args.top), flush=True)
    heur = heuristic_layout(cfg, cluster, dtype)
    h_mem = estimate_memory(cfg.model, cfg.train.seq_len, gb, heur, dtype)["total"]
    h_est = estimate_step(cfg.model, cfg.train.seq_len, gb, heur, cluster, dtype)
    print(
        f"heuristic (tp=min(8, per node) if it does not fit, then pp, dp with the rest): {heur.describe()}: "
        f"{format_size(h_mem)}/GPU{' (does not fit)' if h_mem > cluster.usable_bytes else ''}, "
        f"{h_est['tokens_per_s']:,.0f} tokens/s",
        flush=True,
    )
    out: dict = {
        "cluster": cluster.__dict__,
        "dtype": dtype,
        "considered": result["considered"],
        "rejected": result["rejected"],
        "ranked": [_row(r) for r in result["ranked"][: args.top]],
        "heuristic": {"layout": heur.describe(), "memory_gb": h_mem / 1e9, **h_est},
    }
    if not result["ranked"]:
        print("no valid layout: see the rejections above (more GPUs, more memory, or a smaller batch/model)")
        if args.json:
            print(json.dumps(out, default=str))
        return 1
    best = result["ranked"][0]["layout"]
    print(format_startup(result["ranked"][0]["memory"]["startup"], cluster.device), flush=True)
    path = Path(args.out or f"{cfg.run_dir}/plan.toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# raysc plan: best of {result['considered']} layouts for {cluster.gpus} devices\n" + best.fragment(gb)
    )
    print(f"best layout -> {path} (use it with --set or paste it into the config)", flush=True)
    out["best"] = {"layout": best.describe(), "fragment": str(path)}
    if args.profile:
        from raysc.fleet.driver import ensure_ray
        from raysc.plan.profile import calibrate, profile_layouts

        ensure_ray()
        picks = [r["layout"] for r in result["ranked"][: args.profile_top]]
        measured = profile_layouts(cfg, picks, cluster, args.profile_steps, dtype)
        calibrated, mem_factor = calibrate(cluster, measured)
        print(f"{'layout':<58} {'mem est':>9} {'mem meas':>9} {'step est':>10} {'step meas':>10}")
        for r in measured:
            print(
                f"{r['layout']:<58} {r['memory_estimate_gb'] * 1e3:>7.1f}MB {r['memory_measured_gb'] * 1e3:>7.1f}MB "
                f"{r['step_estimate_s'] * 1e3:>8.1f}ms {r['step_measured_s'] * 1e3:>8.1f}ms"
            )
        print(
            f"calibrated: efficiency {cluster.efficiency:.2f} -> {calibrated.efficiency:.3f}, memory estimates "
            f"× {mem_factor:.2f}",
            flush=True,
        )
        recal = plan(cfg, calibrated, dtype)
        print(format_table(recal, args.top), flush=True)
        out["profile"] = [{k: v for k, v in r.items() if k != "layout_obj"} for r in measured]
        out["calibrated"] = {
            "efficiency": calibrated.efficiency,
            "memory_factor": mem_factor,
            "best": recal["ranked"][0]["layout"].describe() if recal["ranked"] else None,
        }
    if args.json:
        print(json.dumps(out, default=str))
    return 0


def _goodput(args: argparse.Namespace, cluster: Cluster, result: dict) -> int:
    """``raysc plan --goodput``: the goodput table (``raysc.plan.goodput``)."""
    from raysc.plan import goodput

    rate, rate_source = goodput.failure_rate(args.failure_rate)
    measured = goodput.from_run(args.from_run) if args.from_run else {}
    planned = result["ranked"][0]["estimate"]["step_s"] if result["ranked"] else None
    rec = goodput.recovery_from(args, measured, planned)
    rec = goodput.Recovery(**{**rec.__dict__, "sources": (("failure rate", rate_source), *rec.sources)})
    rows = goodput.table(cluster.gpus, rate, rec)
    print(goodput.format_table(rows, rate, rec), flush=True)
    if args.json:
        print(json.dumps({"goodput": rows, "failure_rate": rate, "costs": dict(rec.sources)}, default=str))
    return 0


def format_startup(startup: dict, device: str) -> str:
    """One line: what the best layout's rank holds while it materialises its shard."""
    host = f"; the init block, {format_size(startup['host_block'])}, in host memory" if startup["host_block"] else ""
    return (
        f"start-up peak of the best layout: {format_size(startup['total'])}/{'rank' if device == 'cpu' else 'GPU'}"
        f" while materialising (shards {format_size(startup['shards'])}, rotary tables "
        f"{format_size(startup['buffers'])}, init block {format_size(startup['init_block'])}{host})"
    )


def _row(r: dict) -> dict:
    return {
        "layout": r["layout"].describe(),
        "memory_gb": r["memory"]["total"] / 1e9,
        "startup_gb": r["memory"]["startup"]["total"] / 1e9,
        "tokens_per_s": r["estimate"]["tokens_per_s"],
        "mfu": r["estimate"]["mfu"],
        "bubble": r["estimate"]["bubble"],
        "why_not_higher": r["why"],
    }
