"""The mixture-of-experts block on one rank (issue 58, milestone 1; docs/moe.md): grouped GEMM equal to a
loop over experts, routing and combining equal to a per-token reference, the load-balancing losses
against their definitions and reaching the router's gradient without changing the reported loss, the
auxiliary-loss-free bias moving load toward balance, parameter counts, the config's refusals, and a tiny
MoE trained in-process with its routing in the step metrics. The data-parallel layouts are in
tests/test_parallel.py (MOE_CASES)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raysc.config import ConfigError, load_config
from raysc.model.flops import param_count
from raysc.model.llama import build_model
from raysc.model.moe import (
    GroupedExperts,
    MoEFeedForward,
    expert_loop,
    router_z_loss,
    switch_aux_loss,
    update_expert_bias,
)

SHAPE = [
    "model.vocab_size=512",
    "model.dim=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "train.seq_len=32",
]
MOE = [
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=32",
]


def _cfg(*sets: str):
    return load_config(None, [*SHAPE, *MOE, *sets])


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


def test_grouped_experts_equal_a_loop_over_experts_forward_and_backward():
    """Experts with no token included; fp32, the gradients of the input and of every weight."""
    torch.manual_seed(0)
    experts = GroupedExperts(64, 32, 8)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.1)
    counts = torch.tensor([5, 0, 3, 9, 0, 1, 2, 0])
    x = torch.randn(int(counts.sum()), 64, requires_grad=True)
    grad = torch.randn(int(counts.sum()), 64)
    got = experts(x, counts)
    got.backward(grad)
    got_grads = [x.grad.clone(), *(p.grad.clone() for p in experts.parameters())]
    x.grad = None
    experts.zero_grad()
    want = expert_loop(experts, x, counts)
    want.backward(grad)
    want_grads = [x.grad, *(p.grad for p in experts.parameters())]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert experts.w_gate.grad[1].abs().sum() == 0  # an expert without tokens gets no gradient


def test_the_block_routes_each_token_to_its_top_k_experts_and_adds_the_gated_shared_expert():
    """The block against a per-token reference: softmax scores, the top-k of scores + bias chosen, the
    weights from the unbiased scores (renormalised or not), each chosen expert's SwiGLU, the shared
    expert times its sigmoid gate; and the counts it reports."""
    torch.manual_seed(1)
    for norm, score in ((True, "softmax"), (False, "softmax"), (True, "sigmoid")):
        cfg = _cfg(
            "model.moe_shared_experts=1",
            "model.moe_shared_expert_gate=true",
            f"model.moe_norm_topk_prob={str(norm).lower()}",
            f'model.moe_score_func="{score}"',
        ).model
        block = MoEFeedForward(cfg)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.2)
        block.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
        x = torch.randn(2, 5, 64)
        got = block(x)
        flat = x.reshape(-1, 64)
        logits = flat @ block.router.gate.weight.T
        scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
        want = torch.zeros_like(flat)
        counts = torch.zeros(8, dtype=torch.long)
        e = block.experts
        for t in range(flat.shape[0]):
            chosen = (scores[t] + block.router.expert_bias).topk(2).indices
            weights = scores[t][chosen]
            if norm:
                weights = weights / weights.sum()
            for w, i in zip(weights, chosen):
                counts[i] += 1
                h = F.silu(flat[t] @ e.w_gate[i].T) * (flat[t] @ e.w_up[i].T)
                want[t] += w * (h @ e.w_down[i].T)
        want += block.shared(flat) * torch.sigmoid(block.shared_gate(flat))
        torch.testing.assert_close(got.reshape(-1, 64), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(block.last.counts, counts)


def test_the_aux_loss_is_megatrons_switch_loss_and_one_at_a_uniform_load():
    """E/(k·T²)·Σ P_i·c_i, by hand on a small case; exactly 1 when probabilities and counts are uniform."""
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    experts = logits.topk(2, dim=-1).indices
    counts = torch.bincount(experts.flatten(), minlength=4)
    p = logits.softmax(-1)
    hand = sum(4 / (2 * 3 * 3) * float(p[:, i].sum()) * int(counts[i]) for i in range(4))
    assert float(switch_aux_loss(logits.softmax(-1), experts, counts)) == pytest.approx(hand, rel=1e-6)
    uniform = torch.zeros(8, 4)
    chosen = torch.tensor([[0, 1], [2, 3]] * 4)
    assert float(switch_aux_loss(uniform.softmax(-1), chosen, torch.full((4,), 4))) == pytest.approx(1.0)
    assert float(router_z_loss(logits)) == pytest.approx(float(torch.logsumexp(logits, -1).square().mean()))


def test_the_balancing_losses_reach_the_router_gradient_but_not_the_output():
    """With aux and z coefficients the block's output is unchanged and the router's gradient is that of
    output·g + coeff·aux + z_coeff·z, the losses scaled by the block's ``loss_scale`` (1/micro-batches)."""
    torch.manual_seed(2)
    x = torch.randn(3, 4, 64)
    g = torch.randn(3, 4, 64)
    grads, outs = {}, {}
    for name, sets in (("off", []), ("on", ["model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01"])):
        torch.manual_seed(3)
        block = MoEFeedForward(_cfg(*sets).model)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.2)
        block.loss_scale = 0.5
        out = block(x)
        (out * g).sum().backward()
        outs[name], grads[name] = out.detach(), block.router.gate.weight.grad.clone()
        if name == "on":
            block.zero_grad()
            flat = x.reshape(-1, 64)
            logits = flat @ block.router.gate.weight.T
            chosen = (logits.softmax(-1) + block.router.expert_bias).topk(2).indices
            counts = torch.bincount(chosen.flatten(), minlength=8)
            extra = 0.5 * (0.1 * switch_aux_loss(logits.softmax(-1), chosen, counts) + 0.01 * router_z_loss(logits))
            block.aux_coeff = block.z_coeff = 0.0  # the losses added by hand instead
            ((block(x) * g).sum() + extra).backward()
            want = block.router.gate.weight.grad
    assert torch.equal(outs["off"], outs["on"])
    assert not torch.allclose(grads["off"], grads["on"])
    torch.testing.assert_close(grads["on"], want, rtol=1e-5, atol=1e-7)


def test_the_selection_bias_moves_load_toward_balance_and_stays_centred():
    """A router that sends most tokens to two experts: 200 updates at rate 1e-3 from its own counts
    bring the busiest expert's load from over 3x the mean to under 1.1x, the biases summing to 0."""
    torch.manual_seed(4)
    block = MoEFeedForward(_cfg().model)
    with torch.no_grad():
        block.router.gate.weight.normal_(std=0.05)
        block.router.gate.weight[:2] += 0.02  # experts 0 and 1 score high for most tokens
    x = torch.randn(512, 64).abs()

    def load() -> float:
        with torch.no_grad():
            block(x)
        counts = block.last.counts.float()
        return float(counts.max() / counts.mean())

    before = load()
    for _ in range(200):
        load()
        update_expert_bias(block.router, block.last.counts, 1e-3)
    after = load()
    assert before > 3 and after < 1.1, (before, after)
    assert abs(float(block.router.expert_bias.sum())) < 1e-5


def test_parameter_counts_match_the_model_and_active_counts_k_experts():
    cfg = _cfg(
        "model.n_layers=4",
        "model.moe_shared_experts=1",
        "model.moe_shared_expert_gate=true",
        "model.moe_first_dense_layers=1",
        "model.moe_every_n_layers=2",
    ).model
    assert cfg.moe_layers == [2]  # after one dense layer, every second layer
    model = build_model(cfg, 32, 0)
    counts = param_count(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    expert = 3 * 64 * 32
    assert counts["total"] - counts["active"] == (8 - 2) * expert  # one MoE layer: six experts a token skips
    dense = param_count(load_config(None, [*SHAPE, "model.n_layers=4"]).model)
    assert dense["active"] == dense["total"]


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["model.moe_top_k=9"], "model.moe_top_k=9 is more than model.moe_experts=8"),
        (["model.n_layers=2", "model.moe_first_dense_layers=2"], "no layer is MoE"),
        (
            ["parallel.tp=2", "model.moe_ffn_dim=33"],
            "expert's hidden size \\(model.moe_ffn_dim\\)=33 is not divisible by",
        ),
        (["model.mup=true"], "model.mup = true with a mixture of experts"),
        (["parallel.dp_shard=4", "parallel.ep=3"], "parallel.ep=3 does not divide parallel.dp_shard=4"),
        (["parallel.dp_shard=6", "parallel.ep=3"], "parallel.ep=3 does not divide model.moe_experts=8"),
        (["parallel.dp_replicate=2", "parallel.ep=2"], "parallel.ep=2 does not divide parallel.dp_shard=1"),
        (
            ["parallel.dp_shard=2", "parallel.ep=2", "parallel.elastic=true", 'parallel.elastic_dim="dp_shard"'],
            "resize dp_replicate instead",
        ),
        (["model.moe_experts=0", "parallel.dp_shard=2", "parallel.ep=2"], "model.moe_experts = 0 \\(a dense model\\)"),
    ],
)
def test_a_config_moe_cannot_run_is_refused_with_the_fix(sets, says):
    with pytest.raises(ConfigError, match=says):
        _cfg(*sets)


def test_a_tiny_moe_trains_in_process_and_its_steps_report_routing(make_cfg):
    """20 steps of a 2-layer MoE (the second layer MoE) with both balancing losses and the bias update,
    two micro-batches a step: the loss falls; every step's tokens per expert add up to k per token;
    the bias moved; the aux loss and load are reported."""
    from raysc.data.prepare import prepare_data
    from raysc.train.trainer import Trainer

    cfg = make_cfg(
        *MOE,
        "model.moe_first_dense_layers=1",
        "model.moe_aux_loss_coeff=0.01",
        "model.moe_z_loss_coeff=0.001",
        "model.moe_bias_update_rate=0.001",
        "train.micro_batch=4",
    )
    packed, _, _ = prepare_data(cfg)
    t = Trainer(cfg, packed.train, measure_peak=False)
    ms = [t.train_step() for _ in range(20)]
    assert ms[-1]["loss"] < ms[0]["loss"] - 0.5
    tokens = cfg.train.global_batch * cfg.train.seq_len
    for m in ms:
        assert list(m["moe_tokens"]) == ["1"] and sum(m["moe_tokens"]["1"]) == tokens * 2
        assert m["moe_load_max"] >= 1.0 and m["moe_aux_loss"] >= 1.0 - 1e-6
    bias = t.model.layers["1"].mlp.router.expert_bias
    assert bias.abs().sum() > 0 and abs(float(bias.sum())) < 1e-6


def test_an_moe_fleet_under_expert_parallelism_stops_on_a_router_collapse_with_a_checkpoint(ray_session, make_cfg):
    """`raysc train`'s path on Ray: a dp_shard=2, ep=2 MoE run (each worker holds half the experts)
    whose supervisor is told to stop on a router collapse, with a bound (0.3 of the worst load, a 4-step
    window) that a tiny untrained router meets: the collapse is an event naming the layer, the run
    stops at a step boundary and saves it, and the checkpoint, read back by one process, holds every
    expert's 3-D weights (each worker's half, none left at its fresh draw) and the routers' selection
    biases. A rank killed while its peer waits in the all-to-all is healed bit-exact. (The EP numbers
    against one process: test_parallel's MOE_CASES.)"""
    from raysc.export.restore import load_run
    from raysc.fleet.driver import train
    from raysc.fleet.errors import RunStopped
    from raysc.fleet.records import read_jsonl

    sets = [
        *MOE,
        "model.moe_first_dense_layers=1",
        "model.moe_bias_update_rate=0.001",
        "parallel.dp_shard=2",
        "parallel.ep=2",
        "train.steps=40",
        "checkpoint.every_steps=2",
        "supervisor.router_window=4",
        "supervisor.router_collapse_load=0.3",
        "supervisor.router_collapse=stop",
    ]
    cfg = make_cfg(*sets)
    with pytest.raises(RunStopped) as stopped:
        train(cfg, progress=False)
    summary = stopped.value.summary

    events = read_jsonl(Path(cfg.run_dir) / "events.jsonl")
    [collapse] = [e for e in events if e["kind"] == "router_collapse"]
    assert collapse["layer"] == 1 and collapse["action"] == "stop" and collapse["step"] >= 4
    [stop] = [e for e in events if e["kind"] == "stop_requested"]
    assert stop["reason"] == "router collapse in layer 1"
    assert summary["stopped"] == stop["reason"] and collapse["step"] <= summary["step"] < 40, summary
    assert summary["checkpoint_step"] == summary["step"]  # saved where it stopped
    [layout] = [e for e in events if e["kind"] == "layout"]
    assert layout["ep"] == 2 and "ep:S(0)" in layout["built"]["placements"]["experts.w_gate"], layout
    run = load_run(cfg.run_dir)
    moe = run.model.layers["1"].mlp
    assert tuple(moe.experts.w_gate.shape) == (8, 32, 64)
    fresh = build_model(run.cfg.model, run.cfg.rope_len, run.cfg.train.seed).layers["1"].mlp.experts.w_gate
    assert all(not torch.equal(moe.experts.w_gate[e], fresh[e]) for e in range(8))  # both halves trained

    # the same run with rank 1 SIGKILLed as its backward starts: rank 0's first exchange with it is the
    # MoE layer's all-to-all (the dense weights' reduce-scatters come after it), so rank 0 is inside the
    # all-to-all when its peer dies. Detected (not a hang), healed from the checkpoint, and the run stops at
    # the same collapse with the same parameters, bit for bit
    faulty = make_cfg(*sets, 'supervisor.inject="kill@3:1/backward"', run="faulty")
    with pytest.raises(RunStopped) as again:
        train(faulty, progress=False)
    healed = read_jsonl(Path(faulty.run_dir) / "events.jsonl")
    assert [e["rank"] for e in healed if e["kind"] == "worker_died"] == [1]
    assert [e["healed_by"] for e in healed if e["kind"] == "recovered"] == ["checkpoint"]
    assert again.value.summary["step"] == summary["step"] and again.value.summary["stopped"] == summary["stopped"]
    trained = dict(run.model.named_parameters())
    assert all(torch.equal(p, trained[k]) for k, p in load_run(faulty.run_dir).model.named_parameters())
    bias = moe.router.expert_bias
    assert bias.abs().sum() > 0 and abs(float(bias.sum())) < 1e-6  # the trained bias, not a fresh zero


def _reshard_rank(rank: int, port: int, cache_dir: str, work: str, out: str) -> None:
    """One of four gloo ranks: tiny MoE at dp_shard=4, ep=4 for 3 steps, checkpointed as a worker does
    (DCP shards and the rank's extra state), then 3 more steps; the checkpoint loaded at ep=2 and at ep=1
    (dp_shard=4) for the same 3 steps; rank 0 then loads it into one process and runs them too. Each load
    gathers every parameter and its AdamW moments to compare them with the saved run's."""
    import datetime
    import json

    import torch.distributed as dist

    from raysc.checkpoint.staging import load_local, stage_shards
    from raysc.data.prepare import prepare_data
    from raysc.parallel.dims import build_mesh
    from raysc.train.trainer import Trainer
    from test_parallel import MOE4, PARITY

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=120)
    )
    common = [*PARITY, *MOE4, f'data.cache_dir="{cache_dir}"', "train.steps=6"]
    packed = prepare_data(load_config(None, common))[0]

    def trainer(*layout: str) -> Trainer:
        cfg = load_config(None, [*common, *layout])
        mesh = build_mesh(cfg.parallel.dims, "cpu") if cfg.parallel.world_size > 1 else None
        return Trainer(cfg, packed.train, packed.val, rank=rank if mesh else 0, mesh=mesh, measure_peak=False)

    def gathered(t: Trainer) -> dict[str, torch.Tensor]:
        """Every parameter and its AdamW moments, whole (a collective under a mesh)."""
        whole = {}
        for name, p in t.shard.state_module().named_parameters():
            state = t.optimizer.state[p]
            for key, value in (("", p), *((f".{m}", state[m]) for m in ("exp_avg", "exp_avg_sq"))):
                whole[name + key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
        return whole

    def steps(t: Trainer) -> list[dict]:
        return [
            {k: m[k] for k in ("step", "loss", "grad_norm", "moe_tokens")} for m in (t.train_step() for _ in range(3))
        ]

    def load(t: Trainer, ckpt: Path, as_rank: int) -> Trainer:
        t.load_extra_state(load_local(ckpt, t.shard.state_module(), t.optimizer, as_rank, step=3))
        return t

    ep4 = trainer("parallel.dp_shard=4", "parallel.ep=4")
    for _ in range(3):
        ep4.train_step()
    ckpt = Path(work) / "step_3"
    stage_shards(ckpt, ep4.shard.state_module(), ep4.optimizer, ep4.extra_state(), rank)
    saved = gathered(ep4)
    results = {"ep4": steps(ep4)}
    for name, layout in (("ep2", ("parallel.dp_shard=4", "parallel.ep=2")), ("ep1", ("parallel.dp_shard=4",))):
        resumed = load(trainer(*layout), ckpt, rank)
        loaded = gathered(resumed)
        results[f"{name}_differ"] = sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))
        results[name] = steps(resumed)
    dist.destroy_process_group()
    if rank == 0:
        one = load(trainer(), ckpt, 0)
        loaded = gathered(one)
        results["one_differ"] = sorted(k for k in saved if not torch.equal(saved[k], loaded[k]))
        results["one"] = steps(one)
        Path(out).write_text(json.dumps(results))


def test_an_ep4_checkpoint_resumes_at_ep2_ep1_and_on_one_process(cache_dir, tmp_path):
    """Reshard across expert-parallel sizes: a checkpoint of a dp_shard=4, ep=4 run (each rank wrote its
    quarter of the experts) loads at ep=2, at ep=1 (each rank's FSDP shard of all experts) and into one
    process with every parameter and AdamW moment equal to the saved run's, gathered; the next 3 steps'
    losses and grad norms match the uninterrupted ep=4 run's within 1e-5 and their tokens per expert are
    equal. (The fleet's own checkpoint path at ep=2: test_an_moe_fleet_under_expert_parallelism_... .)"""
    import json

    from forked import run_forked
    from raysc.cluster.ports import free_port
    from raysc.data.prepare import prepare_data
    from test_parallel import MOE4, PARITY

    prepare_data(load_config(None, [*PARITY, *MOE4, f'data.cache_dir="{cache_dir}"', "train.steps=6"]))
    out = tmp_path / "results.json"
    run_forked(_reshard_rank, (free_port(), cache_dir, str(tmp_path), str(out)), nprocs=4)
    r = json.loads(out.read_text())
    for name in ("ep2", "ep1", "one"):
        assert r[f"{name}_differ"] == [], (name, "differ after the load", r[f"{name}_differ"])
        for got, want in zip(r[name], r["ep4"], strict=True):
            assert got["step"] == want["step"] and got["moe_tokens"] == want["moe_tokens"], (name, got["step"])
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (name, got["step"])
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (name, got["step"])


def _all_to_all_probe_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: the pre-flight probe's rows with the world as the EP group."""
    import datetime
    import json

    import torch.distributed as dist

    from raysc.train.probe import group_bandwidth

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    rows = group_bandwidth(None, {}, 1 << 16, torch.device("cpu"), iters=2, ep_group=dist.group.WORLD)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def test_preflight_measures_the_ep_all_to_all_and_warns_when_an_ep_group_spans_nodes(tmp_path):
    """Pre-flight knows EP: the probe times the EP group's all-to-all (forked gloo ranks), the profile
    item expects that row, and the topology item warns, naming the fix, when an EP group's ranks sit on
    two nodes (its all-to-all then runs at the inter-node bandwidth), and passes when each group is on one."""
    import json

    from forked import run_forked
    from raysc.cluster.ports import free_port
    from raysc.preflight.checklist import FAIL, PASS, WARN, Evidence, check_profile, check_topology

    out = tmp_path / "rows.json"
    run_forked(_all_to_all_probe_rank, (free_port(), str(out)), nprocs=2)
    (row,) = json.loads(out.read_text())
    assert row["group"] == "ep" and row["size"] == 2 and row["all_to_all_busbw_gbps"] > 0

    cfg = _cfg("parallel.dp_shard=4", "parallel.ep=2")
    dims = cfg.parallel.dims

    def evidence(nodes: list[str], groups: list[str]) -> Evidence:
        probe = [
            {
                "rank": r,
                "coords": dims.coords(r),
                "node_id": nodes[r],
                "topology": {"device_type": "cpu"},
                "bandwidth": [{"group": g, "size": 2, "bytes": 1, "all_reduce_busbw_gbps": 1.0} for g in groups],
            }
            for r in range(4)
        ]
        return Evidence(
            summary={"probe": probe, "peak_memory_gb": [0.01] * 4},
            events=[],
            step_s=0.1,
            store={},
            estimate_bytes=1e7,
        )

    inside = evidence(["a", "a", "b", "b"], ["dp_shard", "ep"])  # EP groups {0, 1} and {2, 3}
    assert check_topology(cfg, inside).status == PASS and check_topology(cfg, inside).evidence["ep_groups"] == 2
    assert "every TP group and EP group inside one node" in check_topology(cfg, inside).summary
    across = check_topology(cfg, evidence(["a", "b", "a", "b"], ["dp_shard", "ep"]))
    assert across.status == WARN and across.evidence["ep_groups_across_nodes"] == 2
    assert "expert-parallel group(s) span nodes" in across.summary and "lower parallel.ep" in across.summary
    assert check_profile(cfg, inside).status != FAIL
    missing = check_profile(cfg, evidence(["a", "a", "b", "b"], ["dp_shard"]))
    assert missing.status == FAIL and "'ep'" in missing.summary
