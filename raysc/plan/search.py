"""Enumerate every layout of a model on a cluster, reject the invalid ones with the reason,
estimate the rest, rank them, and the simple heuristic to compare against.

A candidate is checked by the same code that checks a run's config
(``raysc.config.checks.check_layout``: head/vocab/FFN divisibility by tp, layers by pp ×
virtual stages, sequence by 2·cp, micro-batches by dp …; ``check_moe``: the layouts a mixture of
experts runs in, data parallelism so far), then against the cluster (a TP
group must sit inside one node, the world must equal the GPU count) and memory (the estimate
must fit ``gpu_mem_gb × (1 − headroom) − overhead``). Valid layouts are ranked by estimated
tokens/s, then by memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter

from raysc.config.checks import ConfigError, check_layout, check_moe
from raysc.config.dims import PP_SCHEDULES
from raysc.config.schema import Config
from raysc.model.flops import param_count
from raysc.plan.layout import Cluster, Layout
from raysc.plan.memory import estimate_memory
from raysc.plan.perf import estimate_step

GB = 1e9


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_config(cfg: Config, lay: Layout) -> Config:
    """``cfg`` with ``lay`` applied (the config a run of this layout would use)."""
    gb = cfg.train.global_batch_sequences
    par = dataclasses.replace(
        cfg.parallel,
        **lay.dims.as_dict(),
        ep=lay.ep,
        sequence_parallel=lay.sequence_parallel,
        pp_schedule=lay.pp_schedule,
        pp_virtual_stages=lay.pp_virtual_stages,
        pp_microbatches=lay.microbatches(gb) if lay.pp > 1 else 0,
        recompute=lay.recompute,
    )
    train = dataclasses.replace(cfg.train, micro_batch=0 if lay.pp > 1 else lay.micro_batch)
    return dataclasses.replace(cfg, parallel=par, train=train)


def check(cfg: Config, lay: Layout, cluster: Cluster, dtype: str) -> tuple[str | None, dict | None]:
    """(reason it is invalid, None) or (None, memory estimate)."""
    gb = cfg.train.global_batch_sequences
    if lay.world_size != cluster.gpus:
        return f"uses {lay.world_size} GPUs, not {cluster.gpus}", None
    if lay.tp > cluster.gpus_per_node or cluster.gpus_per_node % lay.tp:
        return "tp group crosses nodes", None
    if gb % lay.dp or (gb // lay.dp) % lay.micro_batch:
        return "global batch not divisible by dp × micro_batch", None
    try:
        laid = layout_config(cfg, lay)
        check_layout(laid, "layout")
        check_moe(laid, "layout")  # a mixture of experts runs only the layouts built for it (docs/moe.md)
    except ConfigError as e:  # counted by kind: the numbers differ from candidate to candidate
        return re.sub(r"=[^\s,]+", "", str(e).split(": ", 1)[1].split(";")[0]).strip(" ."), None
    mem = estimate_memory(cfg.model, cfg.train.seq_len, gb, lay, dtype, cluster.device)
    if mem["peak"] > cluster.usable_bytes:  # the step's peak, or start-up's when that is larger
        return "does not fit in memory", mem
    return None, mem


def candidates(cfg: Config, cluster: Cluster):
    """Every combination of the knobs the planner varies."""
    n, gb = cluster.gpus, cfg.train.global_batch_sequences
    for tp, pp, cp in itertools.product(divisors(n), repeat=3):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        for dp_shard in divisors(dp):
            local = gb // dp if gb % dp == 0 else 0
            micros = [b for b in (1, 2, 4, 8, 16, 32) if local and local % b == 0] or [1]
            schedules = (
                [("1f1b", 1)] if pp == 1 else [(name, 2 if s.multi_stage else 1) for name, s in PP_SCHEDULES.items()]
            )
            experts = cfg.model.moe_experts
            eps = [e for e in divisors(dp_shard) if experts % e == 0] if experts else [1]
            for mb, (sched, v), sp, rc, ep in itertools.product(
                micros, schedules, (False, True) if tp > 1 else (False,), ("none", "full"), eps
            ):
                yield Layout(
                    dp_replicate=dp // dp_shard,
                    dp_shard=dp_shard,
                    tp=tp,
                    pp=pp,
                    cp=cp,
                    ep=ep,
                    sequence_parallel=sp,
                    pp_schedule=sched,
                    pp_virtual_stages=v,
                    micro_batch=mb,
                    recompute=rc,
                )


def why_not_higher(est: dict, lay: Layout) -> str:
    """The largest losses of this layout, as shares of its step time."""
    step = est["step_s"]
    parts = {
        "bubble": est["bubble"],
        "TP comm": est["tp_comm_s"] / step,
        "CP comm": est["cp_comm_s"] / step,
        "DP exposed": est["dp_exposed_s"] / step,
        "PP send": est["pp_comm_s"] / step,
        "EP all-to-all": est["ep_comm_s"] / step,
    }
    if lay.recompute == "full":
        parts["recompute"] = 0.25  # one extra forward: a quarter of the work done
    top = [f"{k} {v:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.01][:3]
    return ", ".join(top) or "compute-bound"


def plan(cfg: Config, cluster: Cluster, dtype: str = "bf16") -> dict:
    """Ranked valid layouts and the rejections counted by reason."""
    gb = cfg.train.global_batch_sequences
    valid, rejected, seen = [], Counter(), set()
    for lay in candidates(cfg, cluster):
        if lay in seen:
            continue
        seen.add(lay)
        reason, mem = check(cfg, lay, cluster, dtype)
        if reason:
            rejected[reason] += 1
            continue
        est = estimate_step(cfg.model, cfg.train.seq_len, gb, lay, cluster, dtype)
        valid.append({"layout": lay, "memory": mem, "estimate": est, "why": why_not_higher(est, lay)})
    valid.sort(key=lambda r: (-r["estimate"]["tokens_per_s"], r["memory"]["total"]))
    return {"ranked": valid, "rejected": dict(rejected.most_common()), "considered": len(seen)}


def heuristic_layout(cfg: Config, cluster: Cluster, dtype: str = "bf16") -> Layout:
    """The rule of thumb: tp = min(8, GPUs per node) when the model does not fit on one GPU, then the
    smallest pp (a divisor of the layers) that fits, data parallelism (replicated) with the rest;
    micro-batch 1, 1F1B, no sequence parallelism, no recomputation."""
    total = param_count(cfg.model)["total"]
    n, gb = cluster.gpus, cfg.train.global_batch_sequences
    tp = 1 if 16 * total <= cluster.usable_bytes else min(8, cluster.gpus_per_node)
    options = [p for p in divisors(cfg.model.n_layers) if n % (tp * p) == 0] or [1]
    for pp in options:
        lay = Layout(dp_replicate=n // (tp * pp), tp=tp, pp=pp, micro_batch=1)
        if (
            gb % lay.dp == 0
            and estimate_memory(cfg.model, cfg.train.seq_len, gb, lay, dtype, cluster.device)["peak"]
            <= cluster.usable_bytes
        ):
            return lay
    pp = options[-1]
    return Layout(dp_replicate=n // (tp * pp), tp=tp, pp=pp, micro_batch=1)


def format_size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}GB" if nbytes >= GB else f"{nbytes / 1e6:.1f}MB"


def format_table(result: dict, top: int = 10) -> str:
    rows = [f"{'#':>3}  {'layout':<66} {'mem/GPU':>9} {'tokens/s':>12} {'MFU':>6} {'bubble':>7}  why not higher"]
    for i, r in enumerate(result["ranked"][:top], 1):
        est = r["estimate"]
        rows.append(
            f"{i:>3}  {r['layout'].describe():<66} {format_size(r['memory']['total']):>9} "
            f"{est['tokens_per_s']:>12,.0f} {est['mfu']:>6.1%} {est['bubble']:>7.1%}  {r['why']}"
        )
    rows.append(
        f"{len(result['ranked'])} valid of {result['considered']} layouts considered; rejected: "
        + ("; ".join(f"{k} ({v})" for k, v in result["rejected"].items()) or "none")
    )
    return "\n".join(rows)
