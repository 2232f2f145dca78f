"""The planner's start-up peak (``raysc.plan.memory.startup_memory``): what a rank holds while it
materialises its shard, counted against the meta model split as the runtime splits it, used in the
fit check, and reported by ``raysc preflight``. Pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from raysc.config import load_config
from raysc.model.flops import param_count
from raysc.model.llama import Llama
from raysc.parallel import materialise
from raysc.parallel.pp import build_stages
from raysc.plan.layout import Cluster, Layout
from raysc.plan.memory import INIT_BLOCK_VALUES, estimate_memory, startup_memory
from raysc.plan.search import check
from raysc.preflight.checklist import Evidence, check_profile

# sizes divisible by every degree below, so each rank's shard is exactly its stage / (tp × dp_shard × cp)
MODEL = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_layers=8",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "train.seq_len=32",
    "train.global_batch=8",
]
LAYOUTS = [
    Layout(),
    Layout(dp_shard=4),
    Layout(tp=2, dp_shard=2),
    Layout(pp=2, dp_shard=2),
    Layout(pp=4),
    Layout(pp=2, pp_virtual_stages=2, pp_schedule="interleaved_1f1b", tp=2),
    Layout(cp=2, dp_shard=2),
]


def test_the_init_block_is_the_one_materialise_draws():
    assert INIT_BLOCK_VALUES == materialise.CHUNK_ELEMS


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.describe())
def test_startup_is_the_worst_ranks_shards_tables_and_one_block(lay):
    cfg = load_config(None, MODEL)
    with torch.device("meta"):
        full = Llama(cfg.model, cfg.rope_len)
    held, tables = [], []
    for pp_rank in range(lay.pp):
        parts, _ = build_stages(full, pp_rank, lay.pp, lay.pp_virtual_stages) if lay.pp > 1 else ([full], [0])
        held.append(sum(p.numel() * p.element_size() for part in parts for p in part.parameters()))
        tables.append(sum(b.numel() * b.element_size() for part in parts for b in part.buffers()))
    shards = max(held) / (lay.tp * lay.dp_shard * lay.cp)
    cpu = startup_memory(cfg.model, cfg.train.seq_len, lay, "cpu")
    gpu = startup_memory(cfg.model, cfg.train.seq_len, lay, "cuda")
    assert cpu["shards"] == gpu["shards"] == shards and cpu["buffers"] == max(tables)
    assert cpu["init_block"] == gpu["host_block"] == 4 * materialise.CHUNK_ELEMS and gpu["init_block"] == 0
    assert cpu["total"] == shards + max(tables) + 4 * materialise.CHUNK_ELEMS
    assert gpu["total"] == shards + max(tables)


def test_a_layout_that_fits_its_step_but_not_its_startup_is_rejected():
    cfg = load_config(None, MODEL)
    lay = Layout(dp_shard=4, micro_batch=2)
    est = estimate_memory(cfg.model, 32, 8, lay, "fp32", "cpu")
    assert est["startup"]["total"] > est["total"] and est["peak"] == est["startup"]["total"]  # tiny model: the block
    between = (est["total"] + est["peak"]) / 2 / 1e9
    cluster = Cluster(gpus=4, gpus_per_node=4, gpu_mem_gb=between, headroom=0.0, overhead_gb=0.0, device="cpu")
    assert check(cfg, lay, cluster, "fp32") == ("does not fit in memory", est)
    roomy = Cluster(
        gpus=4, gpus_per_node=4, gpu_mem_gb=est["peak"] * 1.01 / 1e9, headroom=0.0, overhead_gb=0.0, device="cpu"
    )
    assert check(cfg, lay, roomy, "fp32") == (None, est)


def test_llama3_405b_starts_on_its_planned_layout_with_a_sliver_of_the_model():
    cfg = load_config(
        None,
        [
            "model.vocab_size=128256",
            "model.dim=16384",
            "model.n_layers=126",
            "model.n_heads=128",
            "model.n_kv_heads=8",
            "model.ffn_dim=53248",
            "train.seq_len=8192",
        ],
    )
    lay = Layout(dp_shard=64, tp=8, pp=16, pp_virtual_stages=1)
    start = startup_memory(cfg.model, 8192, lay)
    full = 4 * param_count(cfg.model)["total"]  # 1.6 TB in fp32: what every rank built before meta construction
    assert 405e9 < full / 4 < 406e9 and start["total"] < full / 5000
    step = estimate_memory(cfg.model, 8192, 2048, lay)
    assert step["peak"] == step["total"] > start["total"]  # the step, not start-up, bounds a real layout


def test_preflight_reports_the_startup_estimate():
    ev = Evidence(
        summary={
            "probe": [{"bandwidth": [{"group": "dp_shard", "size": 2, "bytes": 1, "allreduce_gbps": 1.0}]}],
            "peak_memory_gb": [0.004],
        },
        events=[],
        step_s=0.1,
        store={},
        estimate_bytes=4e6,
        startup_bytes=17.3e6,
    )
    cfg = load_config(None, ["parallel.dp_shard=2"])
    item = check_profile(cfg, ev)
    assert item.evidence["planner_startup_gb"] == 0.0173 and "start-up 17.3 MB/rank estimated" in item.summary
