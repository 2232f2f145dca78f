"""Hybrid parallelism: every layout reproduces single-process training (the parity bar) and
builds what it asks for (what rank 0 built, as the ``layout`` event reports it: an option that only
changes scheduling would pass parity even if ignored), plus the rank layout and the context-parallel
pieces.

Every layout (and μP under FSDP+TP and CP, Qwen2's biases under FSDP+TP+SP and PP, Llama 3.1's scaled
rope under CP+TP, block-causal document masking under PP, CP, TP+SP and FSDP+TP+PP, a mixture of experts
under FSDP and replicas, its tokens per expert too) trains 10 steps in forked gloo processes, one group per
world size, against one process's ``Trainer`` on the same packed rows: the numbers of a layout are
the ``Trainer``'s, wherever it runs. ``RAY_LAYOUTS`` run the same through Ray as users run them
(``raysc parity``: supervisor, workers, per-step reports), the harness that compares them included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from forked import run_forked
from raysc.config.dims import ParallelDims
from raysc.fleet.parity import ensure_reference, layout_overrides, run_parity
from raysc.fleet.records import read_jsonl
from raysc.parallel.cp import local_positions
from raysc.parallel.dims import rank_table

# a 4-layer model so that pp=2 with 2 virtual stages has a layer per stage
PARITY = [
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
    "parallel.cpus_per_worker=0.5",
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


SCHEDULE_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
}


RAY_LAYOUTS = [  # end to end through Ray: the deepest layout, CP with TP, an interleaved zero-bubble schedule
    "pp=2,dp_shard=2,tp=2",
    "cp=2,tp=2",
    "pp=2,pp_schedule=interleaved_zero_bubble,pp_virtual_stages=2",
]
MUP = ["model.mup=true", "model.mup_base_width=32"]
MUP_LAYOUTS = ["dp_shard=2,tp=2", "cp=2"]
# the public families' switches: Qwen2's q/k/v biases (sharded with their weights under TP and SP, on
# their stage under PP) and Llama 3.1's scaled rope (rotary tables indexed by CP's chunk positions)
QWEN2 = ["model.attention_bias=true"]
LLAMA3_ROPE = [
    "model.rope_scaling=llama3",
    "model.rope_factor=4.0",
    "model.rope_original_max_position=16",
    "model.rope_theta=500000.0",
]
# Qwen3: a q and a k norm per head (replicated under TP, their gradients summed over the TP group) and
# heads that are not dim / n_heads wide (model.head_dim): 4 heads of 8 on a 64-wide model.
# (4 of 32 trains the same way but its 10th step's grad norm drifts 1.4e-4 from one process's under
# FSDP+TP, past the 1e-4 bound; FSDP alone drifts 2.6e-5 there: reduction order amplified, not a bug)
QWEN3 = ["model.head_dim=8", "model.qk_norm=true"]
FAMILY_CASES = [
    ("dp_shard=2,tp=2,sequence_parallel=true", QWEN2),
    ("dp_shard=2,tp=2", QWEN3),
    ("pp=2,pp_schedule=1f1b", QWEN2),
    ("cp=2,tp=2", LLAMA3_ROPE),
]
# the grad norm's bound where 1e-4 is tighter than reduction order allows: the Qwen3 case's grad norm
# drifts 1.7e-4 from one process's at step 7 (its loss stays within 4e-7 for all 10 steps); with the TP
# reduction of the q/k norms' gradients taken out it is 2.2e-4 off at step 3 and 3.8e-2 at step 7
GRAD_RTOL = {"dp_shard=2,tp=2 " + " ".join(QWEN3): 5e-4}
# block-causal attention over documents (train.document_mask) with per-document rotary positions: the
# document ids travel to every pipeline stage as the schedule's keyword input, split into microbatches;
# CP masks its local queries against the whole row. Boundaries at the corpus's most frequent token
# (about 2.6 per 64-token row) rather than its EOS (in 1.4% of rows): most rows hold several documents.
DOCS = ["train.document_mask=true", "train.document_positions=true"]
DOC_CASES = [
    ("pp=2,pp_schedule=interleaved_zero_bubble,pp_virtual_stages=2", DOCS),
    ("cp=2", DOCS),
    ("tp=2,sequence_parallel=true", DOCS),
    ("pp=2,dp_shard=2,tp=2", DOCS),
    ("cp=2,tp=2", DOCS[:1]),
]
# a mixture of experts (issue 58, milestone 1: data parallelism) with both balancing losses and the
# selection bias: every step's tokens per expert (summed over the ranks) equal one process's, and so does
# the bias they move. One process takes the ranks' halves of the batch as its two micro-batches, so its
# gradient sums the same terms (halving is exact): with the whole batch at once its sums ran in another
# order, and the parameters' last-bit differences sent a near-tied token to another expert at step 2.
MOE = [
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=64",
    "model.moe_first_dense_layers=1",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_z_loss_coeff=0.001",
    "model.moe_bias_update_rate=0.001",
    "train.micro_batch=4",
]
# expert parallelism (milestone 3) carved from dp_shard: one EP group; EP with FSDP over the other group
# (efsdp=2); EP inside replicas (HSDP); one expert per rank. On 4 ranks one process takes the ranks'
# quarters of the batch as its micro-batches, for the same reason. CP (the balancing loss over the
# whole micro-batch: its statistics summed over the CP group) alone and under EP; PP with two chunks a
# rank (each stage's layers in the step's table) and under EP, a pipeline's micro-batches the same as one
# process's (train.micro_batch agrees with them); TP with sequence parallelism and a gated shared expert
# (each expert's hidden dim split over the TP ranks), and TP under EP (experts on the (ep, tp) mesh).
# That is every layout of {ep 1, 2, 4} x {FSDP, TP, PP, CP} (docs/parallelism.md's table); the ep=4 ones
# with TP, PP or CP run on 8 ranks, dp=4, so their one process takes quarters of the batch too.
MOE4 = [*MOE[:-1], "train.micro_batch=2"]
MOE_SHARED = [*MOE, "model.moe_shared_experts=1", "model.moe_shared_expert_gate=true"]
MOE_CASES = [
    ("dp_shard=2", MOE),
    ("dp_replicate=2", MOE),
    ("dp_shard=2,ep=2", MOE),
    ("dp_shard=4,ep=2", MOE4),
    ("dp_replicate=2,dp_shard=2,ep=2", MOE4),
    ("dp_shard=4,ep=4", MOE4),
    ("cp=2", MOE),
    ("dp_shard=2,cp=2,ep=2", MOE4),
    ("pp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2", MOE),
    ("pp=2,dp_shard=2,ep=2", MOE4),
    ("tp=2,sequence_parallel=true", MOE_SHARED),
    ("dp_shard=2,tp=2,ep=2", MOE4),
    ("dp_shard=4,tp=2,ep=4", MOE4),
    ("pp=2,dp_shard=4,ep=4,pp_schedule=gpipe,pp_microbatches=1", MOE4),
    ("dp_shard=4,cp=2,ep=4", MOE4),
]
STEPS = 10
COMPARED = ("loss", "grad_norm", "moe_tokens", "moe_aux_loss", "moe_z_loss")


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
    check_built_parts(layout, events[0]["built"])


def check_built_parts(layout: str, built: dict, extra: list[str] = ()) -> None:
    """What rank 0 built (``raysc.parallel.describe.describe_shard``) is what ``layout`` (with the
    ``extra`` overrides of its case) implies."""
    from raysc.config import load_config

    par = load_config(None, [*PARITY, *extra, *layout_overrides(layout)]).parallel
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
    experts = built["placements"].get("experts.w_gate")
    if experts is not None:  # a mixture of experts: split over the EP group, the rest of dp_shard shards them
        assert ("ep:S(0)" in experts) == (par.ep > 1), experts
        assert ("efsdp" in experts) == (par.ep > 1), experts
        assert ("efsdp_cp:" in experts) == (par.ep > 1 and par.cp > 1), experts  # CP ranks hold the same experts
        assert ("tp:S(1)" in experts) == (par.tp > 1), experts  # each expert's hidden dim split over TP


def _layout_rank(
    rank: int, world: int, port: int, layouts: list[tuple[str, list[str]]], overrides: list[str], out: str
) -> None:
    """One gloo rank: for each (layout, extra overrides), STEPS steps of a ``Trainer`` under that layout
    against one process's on the same rows; rank 0 writes the losses, grad norms and what it built."""
    import datetime
    import json

    import torch.distributed as dist

    from raysc.config import load_config
    from raysc.data.prepare import prepare_data
    from raysc.parallel.describe import describe_shard
    from raysc.parallel.dims import build_mesh
    from raysc.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results, refs = {}, {}
    for layout, extra in layouts:
        common = [*overrides, *extra, f"train.steps={STEPS}"]
        packed = prepare_data(load_config(None, common))[0]  # cached on disk by the parent
        ids, counts = np.unique(packed.train, return_counts=True)
        boundary = int(ids[counts.argmax()])  # document ends (DOC_CASES)
        if rank == 0 and tuple(extra) not in refs:  # one process's run: once per set of extra overrides
            one = Trainer(load_config(None, common), packed.train, packed.val, measure_peak=False, eos_id=boundary)
            refs[tuple(extra)] = [one.train_step() for _ in range(STEPS)]
        ref = refs.get(tuple(extra), [])
        cfg = load_config(None, [*common, *layout_overrides(layout)])
        trainer = Trainer(
            cfg,
            packed.train,
            packed.val,
            rank=rank,
            mesh=build_mesh(cfg.parallel.dims, "cpu"),
            measure_peak=False,
            eos_id=boundary,
        )
        got = [trainer.train_step() for _ in range(STEPS)]
        results[f"{layout} {' '.join(extra)}".strip()] = {
            "layout": layout,
            "extra": list(extra),
            "built": describe_shard(trainer.shard, trainer.schedule),
            "steps": [{k: m[k] for k in COMPARED if k in m} for m in got],
            "ref": [{k: m[k] for k in COMPARED if k in m} for m in ref],
        }
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results, default=str))


def _world(layout: str, extra: list[str] = ()) -> int:
    from raysc.config import load_config

    return load_config(None, [*PARITY, *extra, *layout_overrides(layout)]).parallel.world_size


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_matches_one_process(world, cache_dir, tmp_path):
    """Every layout of LAYOUTS (and μP's, the public families' switches, document masking, a mixture of
    experts) with ``world`` ranks: each of 10 steps' loss and grad norm within 1e-4 of one process's (and
    an MoE's tokens per expert equal to them), and rank 0 built what the layout implies."""
    import json

    from raysc.cluster.ports import free_port
    from raysc.config import load_config
    from raysc.data.prepare import prepare_data

    overrides = [*PARITY, f'data.cache_dir="{cache_dir}"']
    cases = [(lay, []) for lay in LAYOUTS if _world(lay) == world]
    cases += [(lay, MUP) for lay in MUP_LAYOUTS if _world(lay) == world]
    cases += [(lay, extra) for lay, extra in FAMILY_CASES if _world(lay) == world]
    cases += [(lay, extra) for lay, extra in DOC_CASES if _world(lay) == world]
    cases += [(lay, extra) for lay, extra in MOE_CASES if _world(lay, extra) == world]
    assert cases
    for extra in {tuple(e) for _, e in cases}:
        prepare_data(load_config(None, [*overrides, *extra, f"train.steps={STEPS}"]))  # tokenize once, here
    out = tmp_path / "results.json"
    run_forked(_layout_rank, (world, free_port(), cases, overrides, str(out)), nprocs=world)
    results = json.loads(out.read_text())
    assert len(results) == len(cases)
    for name, r in results.items():
        assert len(r["steps"]) == len(r["ref"]) == STEPS, name
        for step, (got, want) in enumerate(zip(r["steps"], r["ref"]), 1):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (name, step, "loss")
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=GRAD_RTOL.get(name, 1e-4)), (
                name,
                step,
                "grad_norm",
            )
            assert got.get("moe_tokens") == want.get("moe_tokens"), (name, step, "tokens per expert")
            for key in ("moe_aux_loss", "moe_z_loss"):  # the mean over every micro-batch of every rank
                if key in want:
                    assert got.get(key) == pytest.approx(want[key], rel=1e-5), (name, step, key)
        check_built_parts(r["layout"], r["built"], r["extra"])


@pytest.mark.parametrize("layout", RAY_LAYOUTS)
def test_layout_matches_single_process(ray_session, parity_dirs, layout):
    work, overrides = parity_dirs
    report = run_parity(None, layout, overrides, steps=10, rtol=1e-4, work_dir=work, ref_dir=work / "reference")
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

    from raysc.fleet.parity import compare_runs

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
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        'parallel.pp_schedule="gpipe"',
    ]
    from raysc.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'tpp'"):
        layout_overrides("tpp=2")
