"""Hybrid parallelism: every layout reproduces single-process training (the parity bar) and
builds what it asks for (the ``layout`` event: an option that only changes scheduling would pass
parity even if ignored), plus the rank layout and the context-parallel pieces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raysc.parallel.cp import local_positions
from raysc.config.dims import ParallelDims
from raysc.parallel.dims import rank_table
from raysc.fleet.records import read_jsonl
from raysc.parity import ensure_reference, layout_overrides, run_parity

# a 4-layer model so that pp=2 with 2 virtual stages has a layer per stage
PARITY = [
    "model.vocab_size=512", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
    "train.seq_len=64", "train.global_batch=8", "schedule.warmup_steps=2", "data.max_corpus_mb=1.0",
    "data.tokenizer_sample_mb=0.5", "parallel.cpus_per_worker=0.5",
    "supervisor.warm_spares=false",  # no faults here: a spare per rank only slows 2 cores (test_reshard too)
    "data.val_fraction=0.002",  # 16 held-out rows, not 79: pipeline validation runs a row per microbatch
]

LAYOUTS = [
    "dp_replicate=2",
    "dp_shard=2",
    "tp=2",
    "tp=2,sequence_parallel=true",
    "pp=2,pp_schedule=gpipe",
    "pp=2,pp_schedule=1f1b",
    "pp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2",
    "pp=2,pp_schedule=interleaved_zero_bubble,pp_virtual_stages=2",
    "cp=2",
    "dp_shard=2,tp=2",
    "pp=2,tp=2",
    "pp=2,dp_shard=2,tp=2",
    "cp=2,tp=2",
    "dp_replicate=2,dp_shard=2",
    "dp_shard=2,tp=2,sequence_parallel=true,recompute=full",
    "pp=2,pp_schedule=1f1b,recompute=full",
]


SCHEDULE_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                  "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}


@pytest.fixture(scope="module")
def parity_dirs(ray_session, tmp_path_factory, cache_dir):
    """The work directory, with the single-process reference trained up front (whatever test runs
    first, and with whatever extra overrides, compares against the same reference)."""
    work = tmp_path_factory.mktemp("parity")
    overrides = [*PARITY, f'data.cache_dir="{cache_dir}"']
    ensure_reference(None, overrides, 10, work / "reference")
    return work, overrides


def check_built(layout: str, run_dir: str) -> None:
    """The run's ``layout`` event names the layout asked for, and rank 0 built what it implies."""
    from raysc.config import load_config

    par = load_config(None, [*PARITY, *layout_overrides(layout)]).parallel
    events = [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e["kind"] == "layout"]
    assert events and events[0]["layout"] == par.dims.describe() and events[0]["world_size"] == par.world_size
    built = events[0]["built"]
    virtual = par.pp_virtual_stages if par.pp > 1 else 1
    assert built["schedule"] == (SCHEDULE_CLASS[par.pp_schedule] if par.pp > 1 else None), built
    assert built["stages"] == [k * par.pp for k in range(virtual)] and built["num_stages"] == par.pp * virtual
    wq, norm = built["placements"]["attn.wq.weight"], built["placements"]["attn_norm.weight"]
    assert ("tp:S(0)" in wq) == (par.tp > 1), wq  # column-parallel over the TP mesh
    assert ("dp_replicate:R " in wq) == (par.dp_replicate > 1), wq  # HSDP / plain DP
    assert ("dp_shard_cp:" in wq) == (par.dp_replicate * par.dp_shard * par.cp > 1), wq  # FSDP
    assert ("tp:R" in norm) == par.sequence_parallel, norm  # SP: norms are TP-replicated DTensors
    assert (built["attention"] == "ContextParallelAttention") == (par.cp > 1), built["attention"]
    assert built["recompute"] == (par.recompute == "full")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(ray_session, parity_dirs, layout):
    work, overrides = parity_dirs
    report = run_parity(None, layout, overrides, steps=10, rtol=1e-4, work_dir=work,
                        ref_dir=work / "reference")
    print(report.table())
    assert len(report.steps) == 10
    assert report.ok, report.table()
    check_built(layout, report.run_dir)


def test_parity_detects_a_real_difference(ray_session, parity_dirs, tmp_path):
    """The harness must fail when the numbers differ: the reference against itself passes, and
    against a copy of itself whose step-5 loss (then grad norm) is off by ten times the tolerance, it
    fails. (No run of its own: the layouts above show it passes real runs that agree.)"""
    import json
    import shutil

    from raysc.parity import compare_runs

    work, _ = parity_dirs
    ref = work / "reference"
    assert compare_runs(ref, ref, "itself", rtol=1e-4).ok
    for key in ("loss", "grad_norm"):
        got = tmp_path / key
        shutil.copytree(ref, got, ignore=shutil.ignore_patterns("checkpoints"))  # its config names ref's store
        rows = read_jsonl(got / "metrics.jsonl")
        for row in rows:
            if row["step"] == 5:
                row[key] *= 1 + 1e-3
        (got / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        report = compare_runs(ref, got, f"{key} off at step 5", rtol=1e-4)
        assert not report.ok and "FAIL" in report.table(), report.table()


def test_rank_order_keeps_tp_innermost_and_pp_outermost():
    dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2)
    assert [dims.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [dims.coords(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.dp_rank(2) == 1 and dims.dp_rank(5) == 0
    table = rank_table(dims, ["node-a"] * 4 + ["node-b"] * 4)
    assert table.splitlines()[5].split()[-1] == "node-b" and len(table.splitlines()) == 9


def test_context_parallel_chunks_are_load_balanced_and_cover_the_sequence():
    pos = [local_positions(16, r, 2) for r in range(2)]
    assert pos[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert pos[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(torch.cat(pos).tolist()) == list(range(16))
    # causal work (keys visible to each query) is equal across ranks
    work = [int((p + 1).sum()) for p in pos]
    assert work[0] == work[1]


def test_layout_string_parsing():
    assert layout_overrides("pp=2, tp=2,sequence_parallel=true,pp_schedule=gpipe") == [
        "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", 'parallel.pp_schedule="gpipe"']
    from raysc.config import ConfigError
    with pytest.raises(ConfigError, match="unknown key 'tpp'"):
        layout_overrides("tpp=2")


@pytest.mark.parametrize("layout", ["dp_shard=2,tp=2", "cp=2"])
def test_mup_layouts_match_single_process(ray_session, parity_dirs, layout):
    """μP (width multiplier 2) under FSDP + TP and under context parallelism: its per-name LR groups,
    logit multiplier and 1/head_dim attention scale reproduce the single-process run."""
    work, overrides = parity_dirs
    mup = [*overrides, "model.mup=true", "model.mup_base_width=32"]
    report = run_parity(None, layout, mup, steps=10, rtol=1e-4, work_dir=work,
                        ref_dir=ensure_reference(None, mup, 10, work / "reference-mup"))
    print(report.table())
    assert report.ok, report.table()
    check_built(layout, report.run_dir)
