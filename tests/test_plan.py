"""The layout planner: published configurations against the rule of thumb, rejections with reasons,
the config fragment, full recomputation, and the memory estimate against measured peaks on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forked import run_forked
from raysc.config import load_config
from raysc.plan.layout import Cluster, Layout
from raysc.plan.memory import estimate_memory
from raysc.plan.perf import bubble_fraction, estimate_step
from raysc.plan.search import heuristic_layout, plan

ROOT = Path(__file__).resolve().parents[1]

# published shapes; GPU counts: GPT-3 175B as Narayanan et al. 2021 (Megatron-LM, SC21) size its
# end-to-end estimate (1,024 A100 80 GB), Llama 3 405B as Meta did (16,384 H100, 16M-token batches of
# 8K sequences); Llama 3 70B's count is not published: 2,048 H100 assumed. GPT-3's vocabulary is
# padded to 51,200 as Megatron pads it (divisible by tp); its MLP (two 12,288 x 49,152 matrices) is
# written as a SwiGLU of the same parameter count and FLOPs (three 12,288 x 32,768), so the model has
# GPT-3's 175B parameters.
PUBLISHED = {
    "gpt3-175b": (
        [
            "model.vocab_size=51200",
            "model.dim=12288",
            "model.n_layers=96",
            "model.n_heads=96",
            "model.n_kv_heads=96",
            "model.ffn_dim=32768",
            "train.seq_len=2048",
            "train.global_batch=1536",
        ],
        dict(gpus=1024, gpu_mem_gb=80, peak_tflops=312, intra_gbps=300, inter_gbps=25),
    ),
    "llama3-70b": (
        [
            "model.vocab_size=128256",
            "model.dim=8192",
            "model.n_layers=80",
            "model.n_heads=64",
            "model.n_kv_heads=8",
            "model.ffn_dim=28672",
            "train.seq_len=8192",
            "train.global_batch=2048",
        ],
        dict(gpus=2048),
    ),
    "llama3-405b": (
        [
            "model.vocab_size=128256",
            "model.dim=16384",
            "model.n_layers=126",
            "model.n_heads=128",
            "model.n_kv_heads=8",
            "model.ffn_dim=53248",
            "train.seq_len=8192",
            "train.global_batch=2048",
        ],
        dict(gpus=16384),
    ),
}


# the rule of thumb's verdict on each (does its layout fit in memory?), asserted, not branched on
HEURISTIC_FITS = {"gpt3-175b": True, "llama3-70b": False, "llama3-405b": False}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_planner_choice_fits_and_beats_the_rule_of_thumb(name):
    overrides, cluster_kw = PUBLISHED[name]
    cfg = load_config(None, overrides)
    cluster = Cluster(**cluster_kw)
    result = plan(cfg, cluster)
    best = result["ranked"][0]
    lay = best["layout"]
    gb, seq = cfg.train.global_batch_sequences, cfg.train.seq_len
    heur = heuristic_layout(cfg, cluster)
    heur_mem = estimate_memory(cfg.model, seq, gb, heur)["total"]
    assert (heur_mem <= cluster.usable_bytes) == HEURISTIC_FITS[name], (heur, heur_mem / 1e9)
    if HEURISTIC_FITS[name]:  # it fits, and the planner's choice is faster by the estimator's own measure
        assert best["estimate"]["tokens_per_s"] > 1.1 * estimate_step(cfg.model, seq, gb, heur, cluster)["tokens_per_s"]
    assert lay.world_size == cluster.gpus and best["memory"]["total"] <= cluster.usable_bytes
    assert 0.2 < best["estimate"]["mfu"] <= cluster.efficiency  # a plausible model FLOPs utilisation
    load_config(None, [*overrides, *lay.overrides(gb)])  # the fragment is a config the run would accept


def test_estimate_of_megatrons_published_gpt3_layout_matches_its_throughput():
    """Narayanan et al. 2021 (Megatron-LM, SC21): GPT-3 175B on 1,024 A100 (312 TFLOP/s bf16 peak),
    batch 1,536 x 2,048 tokens, 140 TFLOP/s per GPU, counted with their formula
    96·B·s·l·h²·(1 + s/6h + V/16lh), which includes the activation recomputation's extra forward:
    1.0e5 tokens/s (their "34 days" for 300B tokens), model FLOPs utilisation 140·72/96 / 312 = 33.7%.
    The layout: tp 8 (a node), pp 8, dp 16, micro-batch 1, full recomputation, 1F1B. The planner's
    estimator (default efficiency 0.5, no calibration) must land within 10% of both."""
    overrides, cluster_kw = PUBLISHED["gpt3-175b"]
    cfg = load_config(None, overrides)
    cluster = Cluster(**cluster_kw)
    layers, h, s, v, batch = 96, 12288, 2048, 51200, 1536
    published_tps = 140e12 * 1024 / (96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h)))
    assert published_tps == pytest.approx(1.0e5, rel=0.01) and 300e9 / published_tps / 86400 == pytest.approx(34, abs=1)
    lay = Layout(dp_replicate=16, tp=8, pp=8, micro_batch=1, recompute="full")
    assert lay.world_size == cluster.gpus
    assert estimate_memory(cfg.model, s, batch, lay)["total"] <= cluster.usable_bytes  # it fit their 80 GB
    est = estimate_step(cfg.model, s, batch, lay, cluster)
    assert est["tokens_per_s"] == pytest.approx(published_tps, rel=0.10), est
    assert est["mfu"] == pytest.approx(140 * 72 / 96 / 312, rel=0.10), est


def test_invalid_layouts_are_rejected_with_the_reason():
    cfg = load_config(
        None,
        [
            "model.vocab_size=512",
            "model.dim=96",
            "model.n_layers=3",
            "model.n_heads=6",
            "model.n_kv_heads=3",
            "train.seq_len=64",
            "train.global_batch=16",
        ],
    )
    result = plan(cfg, Cluster(gpus=16, gpus_per_node=4, gpu_mem_gb=80))
    rejected = result["rejected"]
    assert rejected["tp group crosses nodes"] > 0
    assert any(k.startswith("model.n_heads is not divisible by parallel.tp") for k in rejected)
    assert any(k.startswith("model.n_layers is not divisible by parallel.pp") for k in rejected)
    assert all(r["layout"].tp <= 4 and 6 % r["layout"].tp == 0 for r in result["ranked"])
    tight = plan(cfg, Cluster(gpus=16, gpus_per_node=4, gpu_mem_gb=0.0002, overhead_gb=0, headroom=0))
    assert tight["rejected"]["does not fit in memory"] > 0
    assert all(r["memory"]["total"] <= 0.0002e9 for r in tight["ranked"])


def test_a_mixture_of_experts_is_planned_only_in_the_layouts_it_runs():
    """The planner checks a candidate as a run's config is checked: an MoE gets TP, PP, CP and EP
    layouts, and never one that `raysc train` then refuses (a TP degree that does not divide an
    expert's hidden size)."""
    cfg = load_config(
        None,
        [
            "model.vocab_size=512",
            "model.dim=64",
            "model.n_layers=4",
            "model.n_heads=8",
            "model.n_kv_heads=8",
            "model.moe_experts=8",
            "model.moe_top_k=2",
            "model.moe_ffn_dim=36",
            "train.seq_len=64",
            "train.global_batch=16",
        ],
    )
    ranked = [r["layout"] for r in plan(cfg, Cluster(gpus=8, gpus_per_node=8, gpu_mem_gb=80))["ranked"]]
    assert all(any(getattr(lay, dim) > 1 for lay in ranked) for dim in ("tp", "pp", "cp", "ep"))
    assert all(36 % lay.tp == 0 for lay in ranked), sorted({lay.tp for lay in ranked})
    result = plan(cfg, Cluster(gpus=8, gpus_per_node=8, gpu_mem_gb=80))
    assert any("routed expert's hidden size" in k for k in result["rejected"]), result["rejected"]


def test_the_planner_weighs_expert_parallelism_for_the_qwen3_moe_config():
    """jobs/configs/qwen3-moe-30b-a3b.toml on 64 GPUs: EP layouts are candidates; under EP a block
    gathers only its own experts (less memory than FSDP alone at the same degrees), the all-to-all is
    four exchanges per MoE layer and micro-batch of the routed rows leaving the rank; EP layouts are
    ranked (with PP and CP too); and the best layout is the shipped config's own."""
    from raysc.plan.memory import expert_params_per_layer

    cfg = load_config(ROOT / "jobs/configs/qwen3-moe-30b-a3b.toml")
    cluster = Cluster(gpus=64, gpus_per_node=8, gpu_mem_gb=80)
    m, s, gb = cfg.model, cfg.train.seq_len, cfg.train.global_batch_sequences
    fsdp, ep8 = Layout(dp_shard=64, micro_batch=1), Layout(dp_shard=64, ep=8, micro_batch=1)
    saved = estimate_memory(m, s, gb, fsdp)["unsharded"] - estimate_memory(m, s, gb, ep8)["unsharded"]
    assert saved == pytest.approx((2 * 2 + 4) * expert_params_per_layer(m) * 7 / 8)  # bf16 x2 + fp32 grads
    est = estimate_step(m, s, gb, ep8, cluster)
    rows = s * 1 * m.moe_top_k * m.dim * 2 * 7 / 8
    assert est["ep_comm_s"] == pytest.approx(48 * (gb // 64) * 4 * rows / (cluster.intra_gbps * 1e9))
    assert estimate_step(m, s, gb, fsdp, cluster)["ep_comm_s"] == 0
    ranked = [r["layout"] for r in plan(cfg, cluster)["ranked"]]
    assert any(lay.ep > 1 and lay.pp > 1 for lay in ranked) and any(lay.ep > 1 and lay.cp > 1 for lay in ranked)
    assert ranked[0] == Layout.from_config(cfg), ranked[0].describe()


def test_estimates_follow_the_formulas():
    cfg = load_config(
        None,
        [
            "model.dim=256",
            "model.n_layers=8",
            "model.n_heads=8",
            "model.n_kv_heads=8",
            "train.seq_len=512",
            "train.global_batch=64",
        ],
    )
    m = cfg.model
    assert bubble_fraction(Layout(pp=4, micro_batch=1), 12) == pytest.approx(3 / 15)
    assert bubble_fraction(Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 12) == pytest.approx(
        3 / 27
    )
    base = estimate_memory(m, 512, 64, Layout(micro_batch=4), "fp32")
    sp = estimate_memory(m, 512, 64, Layout(tp=2, sequence_parallel=True, micro_batch=4), "fp32")
    tp = estimate_memory(m, 512, 64, Layout(tp=2, micro_batch=4), "fp32")
    full = estimate_memory(m, 512, 64, Layout(micro_batch=4, recompute="full"), "fp32")
    fsdp = estimate_memory(m, 512, 64, Layout(dp_shard=4, micro_batch=4), "fp32")
    assert sp["activations"] < tp["activations"] < base["activations"]
    assert full["activations"] < base["activations"] / 5
    assert fsdp["optimizer"] == pytest.approx(base["optimizer"] / 4)
    gpipe = estimate_memory(m, 512, 64, Layout(pp=2, pp_schedule="gpipe", micro_batch=4), "fp32")
    ofob = estimate_memory(m, 512, 64, Layout(pp=2, micro_batch=4), "fp32")
    assert gpipe["inflight"] == 16 and ofob["inflight"] == 2 and gpipe["activations"] > ofob["activations"]
    cl = Cluster(gpus=4)
    assert estimate_step(m, 512, 64, Layout(dp_shard=4, recompute="full"), cl)["compute_s"] == pytest.approx(
        4 / 3 * estimate_step(m, 512, 64, Layout(dp_shard=4), cl)["compute_s"]
    )


def test_full_recompute_gives_the_same_loss_and_gradients(make_cfg):
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    out = {}
    for mode in ("none", "full"):
        cfg = make_cfg(f'parallel.recompute="{mode}"', "train.micro_batch=4")
        packed, _, _ = prepare_data(cfg)
        trainer = Trainer(cfg, packed.train, measure_peak=False)
        out[mode] = [trainer.train_step()["grad_norm"] for _ in range(3)], [p.detach().clone() for p in trainer.params]
    assert out["none"][0] == out["full"][0]
    assert all(torch.equal(a, b) for a, b in zip(out["none"][1], out["full"][1]))


CPU_MODEL = [
    "model.vocab_size=512",
    "model.dim=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=128",
    "train.global_batch=8",
    "supervisor.calibrate_steps=0",
]


MEMORY_LAYOUTS = [
    Layout(micro_batch=8),
    Layout(micro_batch=2),
    Layout(dp_shard=2, micro_batch=4),
    Layout(dp_replicate=2, micro_batch=2),
    Layout(tp=2, sequence_parallel=True, micro_batch=8),
    Layout(tp=2, micro_batch=8, recompute="full"),
    Layout(pp=2, micro_batch=2),
    Layout(pp=2, pp_schedule="gpipe", micro_batch=1),
    Layout(cp=2, micro_batch=8),
]


def _measure_rank(rank: int, port: int, cfg, rows, out: str) -> None:
    """One of two forked gloo ranks: each layout's 5 steps as a fleet rank measures them (a ``Trainer``
    under ``PeakMemory``, the windows ``raysc.fleet.rank`` opens around each step, the measuring run's
    config); the one-rank layouts run one per process, side by side. Writes ``{layout: peak bytes}``."""
    import datetime

    import torch.distributed as dist

    from raysc.config.measure import measurement_config
    from raysc.parallel.dims import build_mesh
    from raysc.plan.search import layout_config
    from raysc.train.memory import PeakMemory
    from raysc.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    single = [lay for lay in MEMORY_LAYOUTS if lay.dims.world_size == 1]
    peaks = {}
    for lay in [single[rank]] + [lay for lay in MEMORY_LAYOUTS if lay.dims.world_size == 2]:
        run = measurement_config(layout_config(cfg, lay), 5, out)
        mesh = build_mesh(run.parallel.dims, "cpu") if lay.dims.world_size > 1 else None
        trainer = Trainer(run, rows, rank=rank if mesh else 0, mesh=mesh, measure_peak=False)
        memory = PeakMemory(trainer.model_parts, trainer.optimizer, trainer.device)
        for _ in range(5):
            memory.before_step()
            trainer.train_step()
            memory.after_step()
        memory.close()
        peaks[lay.describe()] = memory.report()["peak_bytes"]
        del trainer, memory
        dist.barrier()
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(peaks))


def test_memory_estimate_within_25_percent_of_measured_peak_on_cpu(make_cfg, tmp_path):
    """Every kind of layout runs 5 steps in two forked gloo processes, measured as a fleet rank measures
    (``PeakMemory``: glibc heap minus the process's own, see raysc.train.memory); each rank's measured
    peak is within 25% of the estimate. (The same measurement through the fleet, ``raysc plan --profile``
    running the layout with Ray: test_cli_plan_ranks_writes_the_fragment_and_profiles.)"""
    from raysc.cluster.ports import free_port
    from raysc.data.prepare import prepare_data
    from raysc.plan.profile import calibrate

    cfg = make_cfg(*CPU_MODEL)
    rows = prepare_data(cfg)[0].train
    run_forked(_measure_rank, (free_port(), cfg, rows, str(tmp_path)), nprocs=2)
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    gb = cfg.train.global_batch_sequences
    results = []
    for lay in MEMORY_LAYOUTS:
        peak = max(m[lay.describe()] for m in measured if lay.describe() in m)
        est = estimate_memory(cfg.model, cfg.train.seq_len, gb, lay, "fp32")["total"]
        print(lay.describe(), round(est / 1e6, 2), round(peak / 1e6, 2))
        assert peak > 0, lay.describe()
        assert abs(peak / est - 1) <= 0.25, (lay.describe(), est, peak)
        results.append({"memory_ratio": peak / est, "step_ratio": None})
    _, factor = calibrate(Cluster(gpus=2, gpus_per_node=2, peak_tflops=0.05, device="cpu"), results)
    assert 0.75 <= factor <= 1.25


def test_cli_plan_ranks_writes_the_fragment_and_profiles(ray_session, make_cfg, tmp_path, capsys):
    from raysc.cli import main

    cfg = make_cfg(*CPU_MODEL)
    cfg_path = tmp_path / "cfg.toml"
    from raysc.config.load import dump_config

    cfg_path.write_text(dump_config(cfg))
    out = tmp_path / "best.toml"
    assert (
        main(
            [
                "plan",
                str(cfg_path),
                "--gpus",
                "2",
                "--out",
                str(out),
                "--profile",
                "--profile-top",
                "1",
                "--profile-steps",
                "4",
                "--json",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["ranked"] and result["best"]["layout"] == result["ranked"][0]["layout"]
    assert "why not higher" in printed and "calibrated: efficiency" in printed
    assert abs(result["profile"][0]["memory_ratio"] - 1) <= 0.25
    fragment = out.read_text()
    assert "[parallel]" in fragment and "[train]" in fragment
    import tomllib

    parsed = tomllib.loads(fragment)
    overrides = [
        f"{s}.{k}={json.dumps(v) if isinstance(v, str) else str(v).lower()}"
        for s, table in parsed.items()
        for k, v in table.items()
    ]
    assert load_config(str(cfg_path), overrides).parallel.world_size == 2


@pytest.mark.parametrize(
    "recipe,params", [("llama-3.2-1b", 1.236e9), ("qwen2.5-0.5b", 0.494e9), ("qwen3-0.6b", 0.596e9)]
)
def test_plan_ranks_the_continued_pretraining_recipes(tmp_path, capsys, recipe, params):
    """The continued pre-training recipes (jobs/configs/: Llama 3.2 1B's shapes with llama3 rope scaling
    and a 128,256-token vocabulary; Qwen2.5 0.5B's with q/k/v biases and 151,936 tokens; Qwen3 0.6B's with q/k norms and 128-wide heads) plan on 8 GPUs,
    and their parameter counts are the published ones."""
    from raysc.cli import main
    from raysc.model.flops import param_count

    assert (
        main(["plan", f"jobs/configs/{recipe}.toml", "--gpus", "8", "--out", str(tmp_path / "best.toml"), "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ranked"][0]["layout"] == result["best"]["layout"] and result["ranked"][0]["memory_gb"] < 80
    assert param_count(load_config(f"jobs/configs/{recipe}.toml").model)["total"] == pytest.approx(params, rel=2e-3)
