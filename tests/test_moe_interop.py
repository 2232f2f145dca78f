"""Public mixture-of-experts checkpoints in (issue 59, its first part): a transformers-built tiny
``Qwen3MoeForCausalLM``, in the fused expert layout transformers 5 holds and in the per-expert layout
most published checkpoints have, continues in raysc (``model.init_from``) with transformers' logits,
its 12 experts in numeric order; a checkpoint that does not fit is refused before any weight is read,
naming the keys or settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from forked import run_forked
from raysc.cluster.ports import free_port
from raysc.config import load_config
from raysc.model.hf_checkpoint import CheckpointMismatch
from raysc.train.trainer import Trainer
from test_init_from import MODEL, QWEN3_HF, ROWS

EXPERTS = 12  # more than ten: "10" sorts before "2" as text
QWEN3_MOE = [
    *MODEL,
    "model.norm_eps=1e-6",
    "model.rope_theta=1000000.0",
    "model.qk_norm=true",
    f"model.moe_experts={EXPERTS}",
    "model.moe_top_k=2",
    "model.moe_ffn_dim=32",
    "model.moe_norm_topk_prob=true",
]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE saved by transformers (``per_expert``: one tensor per expert) and the same
    weights as transformers 5 holds them (``fused``), with the transformers model."""
    import transformers

    hf_cfg = transformers.Qwen3MoeConfig(
        **QWEN3_HF,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)  # transformers starts them at one: make them matter
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # a router starting at zero would tie every expert
    root = tmp_path_factory.mktemp("qwen3_moe")
    fused, per_expert = root / "fused", root / "per_expert"
    hf.save_pretrained(per_expert)  # transformers 5 writes one tensor per expert (its conversion reversed)
    fused.mkdir()  # what it holds in memory, as some published checkpoints store it
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors", {"format": "pt"})
    shutil.copy(per_expert / "config.json", fused / "config.json")
    return hf, fused, per_expert


def test_the_saved_layouts_are_the_two_the_issue_names(qwen3_moe):
    """transformers 5 holds experts fused and writes them one tensor per expert; both copies exist."""
    _, fused, per_expert = qwen3_moe
    fused_keys = set(load_file(fused / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused_keys and "model.layers.0.mlp.gate.weight" in fused_keys
    per_keys = set(load_file(per_expert / "model.safetensors"))
    assert f"model.layers.1.mlp.experts.{EXPERTS - 1}.down_proj.weight" in per_keys
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in per_keys)


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_a_qwen3_moe_checkpoint_continues_with_transformers_logits(qwen3_moe, layout):
    """Each layout imports with zero missing or unexpected keys and gives transformers' fp32 logits
    (within 1e-5 of their largest magnitude)."""
    hf, fused, per_expert = qwen3_moe
    directory = fused if layout == "fused" else per_expert
    cfg = load_config(None, [*QWEN3_MOE, f'model.init_from="{directory}"'])
    ours = Trainer(cfg, ROWS, measure_peak=False).model.eval()
    ids = torch.from_numpy(ROWS[:2, :32])
    with torch.no_grad():
        mine, theirs = ours(ids), hf(ids).logits
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def test_a_qwen3_moe_checkpoint_that_does_not_fit_is_refused_naming_what_differs(qwen3_moe, tmp_path):
    """A config whose MoE settings differ, and a per-expert checkpoint missing an expert, are refused
    before any weight is read: each setting with the --set that fixes it, the missing expert by number."""
    _, fused, per_expert = qwen3_moe
    wrong = [*QWEN3_MOE, "model.moe_top_k=3", "model.moe_ffn_dim=48", f'model.init_from="{fused}"']
    with pytest.raises(CheckpointMismatch) as refused:
        Trainer(load_config(None, wrong), ROWS, measure_peak=False)
    assert "num_experts_per_tok = 2 but model.moe_top_k = 3; set model.moe_top_k=2" in str(refused.value)
    assert "moe_intermediate_size = 32 but model.moe_ffn_dim = 48; set model.moe_ffn_dim=32" in str(refused.value)
    dense = [o for o in QWEN3_MOE if not o.startswith("model.moe_")] + [f'model.init_from="{fused}"']
    with pytest.raises(CheckpointMismatch, match="a mixture of 12 experts but model.moe_experts = 0"):
        Trainer(load_config(None, dense), ROWS, measure_peak=False)
    gap = tmp_path / "gap"
    gap.mkdir()
    tensors = {k: v for k, v in load_file(per_expert / "model.safetensors").items() if ".experts.10." not in k}
    save_file(tensors, gap / "model.safetensors", metadata={"format": "pt"})
    (gap / "config.json").write_text(json.dumps(json.loads((per_expert / "config.json").read_text())))
    with pytest.raises(CheckpointMismatch) as refused:
        Trainer(load_config(None, [*QWEN3_MOE, f'model.init_from="{gap}"']), ROWS, measure_peak=False)
    assert "layers.0.mlp.experts.w_gate: the checkpoint has no tensor for expert(s) [10]" in str(refused.value)


def _ep_rank(rank: int, port: int, directory: str, out: str) -> None:
    """One of two gloo ranks: the checkpoint read at dp_shard=2, ep=2 (each rank its 6 experts' rows, its
    FSDP shard of the rest), 2 training steps; rank 0 writes their losses."""
    import datetime

    import torch.distributed as dist

    from raysc.parallel.dims import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    cfg = load_config(None, [*QWEN3_MOE, f'model.init_from="{directory}"', "parallel.dp_shard=2", "parallel.ep=2"])
    trainer = Trainer(cfg, ROWS, rank=rank, mesh=build_mesh(cfg.parallel.dims, "cpu"), measure_peak=False)
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def test_a_qwen3_moe_checkpoint_trains_under_expert_parallelism_as_on_one_process(qwen3_moe, tmp_path):
    """The per-expert checkpoint read into an ep=2 layout (forked gloo ranks): its first two steps' losses
    equal one process's within 1e-5 (every rank read its own experts' rows of the stacked tensors)."""
    _, _, per_expert = qwen3_moe
    one = Trainer(load_config(None, [*QWEN3_MOE, f'model.init_from="{per_expert}"']), ROWS, measure_peak=False)
    want = [one.train_step()["loss"] for _ in range(2)]
    out = tmp_path / "losses.json"
    run_forked(_ep_rank, (free_port(), str(per_expert), str(out)), nprocs=2)
    assert json.loads(out.read_text()) == pytest.approx(want, rel=1e-5)


def test_a_qwen3_moe_exports_back_with_its_logits_and_refuses_what_it_cannot_hold(qwen3_moe, tmp_path):
    """The imported model exported as ``Qwen3MoeForCausalLM`` (experts one tensor per expert): transformers
    loads it with no missing or unexpected key and computes raysc's fp32 logits; a trained routing bias,
    which Qwen3-MoE has no key for, is refused at export naming the setting, not dropped."""
    import transformers

    from raysc.export.hf import export_hf
    from test_init_from import _tokenizer

    _, fused, _ = qwen3_moe
    ours = Trainer(load_config(None, [*QWEN3_MOE, f'model.init_from="{fused}"']), ROWS, measure_peak=False).model
    ours.eval()
    out = export_hf(ours, _tokenizer(tmp_path), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["num_experts"], config["mlp_only_layers"]) == (
        ["Qwen3MoeForCausalLM"],
        EXPERTS,
        [],
    )
    back, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.from_numpy(ROWS[:2, :32])
    with torch.no_grad():
        mine, theirs = ours(ids), back.eval()(ids).logits
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5
    with torch.no_grad():
        ours.layers["1"].mlp.router.expert_bias[3] = 0.01
    with pytest.raises(ValueError, match=r"a trained routing bias \(model.moe_bias_update_rate"):
        export_hf(ours, _tokenizer(tmp_path), tmp_path / "biased")
