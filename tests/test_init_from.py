"""Continued pre-training from a Hugging Face checkpoint (``model.init_from``): export → import gives the
exported parameters bit for bit and the same first-step loss in one process, under FSDP × TP and PP
(4 forked gloo ranks, no Ray) and through ``raysc train`` from an S3 URL (the shared Ray session); a
transformers-built, sharded checkpoint computes transformers' logits; a checkpoint that does not fit
the config is refused before any weight is read, naming what differs."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from conftest import TINY
from forked import run_forked
from raysc.cluster.ports import free_port
from raysc.config import load_config
from raysc.data.tokenizer import train_tokenizer
from raysc.export.hf import export_hf
from raysc.fleet.parity import layout_overrides
from raysc.model import hf_checkpoint
from raysc.model.hf_checkpoint import CheckpointMismatch, content_sha256
from raysc.model.llama import Llama
from raysc.parallel.dims import build_mesh
from raysc.train.trainer import Trainer

MODEL = [o for o in TINY if o.startswith("model.")] + ["train.seq_len=32", "train.global_batch=8", "train.seed=3"]
MUP = ["model.mup=true", "model.mup_base_width=32"]  # m = 2, sqrt(head_dim 16) = 4: unfolding is exact
ROWS = np.random.default_rng(1).integers(0, 512, size=(16, 33))
LAYOUTS = ["dp_shard=2,tp=2", "pp=2,dp_shard=2"]
# a tiny Qwen3's config.json keys (transformers' config classes), beside MODEL's shapes; test_moe_interop's
# Qwen3-MoE adds its experts to them
QWEN3_HF = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "use_sliding_window": False,
}


def _exported(out: Path, extra: list[str]) -> tuple[dict[str, torch.Tensor], Path]:
    """Train a tiny model 2 steps (away from its init), export it; its parameters and the folder."""
    trainer = Trainer(load_config(None, [*MODEL, *extra]), ROWS, measure_peak=False)
    for _ in range(2):
        trainer.train_step()
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, 300)
    tok.save(str(out.parent / f"{out.name}-tokenizer.json"))
    export_hf(trainer.model, out.parent / f"{out.name}-tokenizer.json", out)
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, out


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[dict[str, torch.Tensor], Path]:
    return _exported(tmp_path_factory.mktemp("init-from") / "hf", [])


def _first_loss(cfg_overrides: list[str], params: dict[str, torch.Tensor] | None) -> tuple[Trainer, float]:
    trainer = Trainer(load_config(None, cfg_overrides), ROWS, measure_peak=False)
    if params is not None:
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                p.copy_(params[name])
    return trainer, trainer.train_step()["loss"]


@pytest.mark.parametrize("extra", [[], ["model.tie_embeddings=true"], MUP], ids=["plain", "tied", "mup"])
def test_round_trip_one_process_is_bit_identical(extra, export, tmp_path):
    params, out = _exported(tmp_path / "hf", extra) if extra else export
    imported = Trainer(load_config(None, [*MODEL, *extra, f'model.init_from="{out}"']), ROWS, measure_peak=False)
    got = dict(imported.model.named_parameters())
    assert got.keys() == params.keys() and all(torch.equal(got[k], params[k]) for k in params)
    # the same weights put into a fresh trainer by hand: the same first step, to the bit
    _, want = _first_loss([*MODEL, *extra], params)
    assert imported.train_step()["loss"] == want


def _rank(rank: int, port: int, out: str, params: dict[str, torch.Tensor], ref_loss: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60)
    )
    errors = []
    for layout in LAYOUTS:
        cfg = load_config(None, [*MODEL, f'model.init_from="{out}"', *layout_overrides(layout)])
        trainer = Trainer(cfg, ROWS, rank=rank, mesh=build_mesh(cfg.parallel.dims, "cpu"), measure_peak=False)
        for part in trainer.shard.parts:
            for name, p in part.named_parameters():
                want = params[name]
                if isinstance(p, DTensor):
                    got = p.to_local()
                    want = distribute_tensor(want, p.device_mesh, p.placements, src_data_rank=None).to_local()
                else:
                    got = p
                if not torch.equal(got, want):
                    errors.append(f"rank {rank} {layout}: {name} differs")
        loss = trainer.train_step()["loss"]
        if abs(loss - ref_loss) > 1e-5 * ref_loss:
            errors.append(f"rank {rank} {layout}: first loss {loss} != one process's {ref_loss}")
    dist.destroy_process_group()
    assert not errors, "\n".join(errors[:20])


def test_round_trip_under_fsdp_tp_and_pp(export):
    params, out = export
    _, ref_loss = _first_loss(MODEL, params)
    run_forked(_rank, (free_port(), str(out), params, ref_loss), nprocs=4)


def test_transformers_checkpoint_gives_transformers_logits(tmp_path):
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded: model.safetensors.index.json
    assert (tmp_path / "hf" / hf_checkpoint.INDEX).is_file()
    cfg = load_config(
        None,
        [
            *MODEL,
            "model.ffn_dim=160",
            "model.norm_eps=1e-6",
            "model.rope_theta=500000.0",
            f'model.init_from="{tmp_path / "hf"}"',
        ],
    )
    ours = Trainer(cfg, ROWS, measure_peak=False).model.eval()
    ids = torch.from_numpy(ROWS[:2, :32])
    with torch.no_grad():
        mine, theirs = ours(ids), hf(ids).logits
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-5 of ``b``'s largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


def _tokenizer(tmp_path: Path) -> Path:
    tok = tmp_path / "tokenizer.json"
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, 300).save(str(tok))
    return tok


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
RAYSC_LLAMA3 = [
    "model.rope_theta=500000.0",
    "model.rope_scaling=llama3",
    "model.rope_factor=4.0",
    "model.rope_original_max_position=16",
]


def test_llama3_rope_scaling_matches_transformers_on_import_export_and_in_llama_cpp(tmp_path):
    """Llama 3.1's scaled rotary embedding (an original context of 16 so that the 32-token rows reach
    past it): a transformers checkpoint imports with transformers' logits, raysc's export loads in
    transformers with raysc's logits, and the GGUF export (rope_freqs) gives llama.cpp the same logits."""
    import llama_cpp
    import transformers

    from raysc.export.gguf import export_gguf

    hf_cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters=LLAMA3_ROPE,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    base = [*MODEL, "model.ffn_dim=160", "model.norm_eps=1e-6", *RAYSC_LLAMA3]
    ours = Trainer(
        load_config(None, [*base, f'model.init_from="{tmp_path / "hf"}"']), ROWS, measure_peak=False
    ).model.eval()
    ids = torch.from_numpy(ROWS[:2, :32])

    with torch.no_grad():
        theirs = hf(ids).logits
        assert _close(ours(ids), theirs)
        # the same weights without the scaling are another model: the test can tell
        plain = Llama(load_config(None, [*base, "model.rope_scaling=none"]).model, 32).eval()
        plain.load_state_dict(ours.state_dict())
        assert not _close(plain(ids), theirs)
    tok = _tokenizer(tmp_path)
    out = export_hf(ours, tok, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert _close(back(ids).logits, theirs)
    gguf_file = export_gguf(ours, tok, tmp_path / "model.gguf")
    llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    llm.eval(ids[0].tolist())
    got = torch.tensor(np.array(llm.scores[:32]))
    # llama.cpp's f32 kernels differ from torch's by ~2e-4 on these logits with or without scaling; the
    # unscaled model is 30x further away, so the bound tells them apart
    with torch.no_grad():
        unscaled = (plain(ids)[0] - theirs[0]).abs().max().item()
    assert (got - theirs[0]).abs().max().item() < 1e-3 < unscaled / 5


def test_qwen2_imports_exports_and_runs_in_llama_cpp_with_transformers_logits(tmp_path):
    """Qwen2 (Llama with q/k/v biases, ``model.attention_bias``): a transformers ``Qwen2ForCausalLM``
    with random biases imports with transformers' logits, raysc's export loads back as
    ``Qwen2ForCausalLM`` with them, and the GGUF export runs as llama.cpp's ``qwen2`` architecture."""
    import llama_cpp
    import transformers

    from raysc.export.gguf import export_gguf

    hf_cfg = transformers.Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)  # transformers starts them at zero: make them matter
    hf.save_pretrained(tmp_path / "hf")
    base = [*MODEL, "model.ffn_dim=160", "model.norm_eps=1e-6", "model.rope_theta=1000000.0"]
    with pytest.raises(
        CheckpointMismatch,
        match=r"q/k/v biases \(qwen2\) but model.attention_bias = false; set "
        r"model.attention_bias=true",
    ):
        Trainer(load_config(None, [*base, f'model.init_from="{tmp_path / "hf"}"']), ROWS, measure_peak=False)
    ours = Trainer(
        load_config(None, [*base, "model.attention_bias=true", f'model.init_from="{tmp_path / "hf"}"']),
        ROWS,
        measure_peak=False,
    ).model.eval()
    ids = torch.from_numpy(ROWS[:2, :32])

    with torch.no_grad():
        theirs = hf(ids).logits
        assert _close(ours(ids), theirs)
        unbiased = Llama(load_config(None, base).model, 32).eval()
        unbiased.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.endswith(".bias")})
        assert not _close(unbiased(ids), theirs)  # the biases count
    tok = _tokenizer(tmp_path)
    out = export_hf(ours, tok, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert _close(back(ids).logits, theirs)
    gguf_file = export_gguf(ours, tok, tmp_path / "model.gguf")
    llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    assert llm.metadata["general.architecture"] == "qwen2"
    llm.eval(ids[0].tolist())
    got = torch.tensor(np.array(llm.scores[:32]))
    with torch.no_grad():
        off = (unbiased(ids)[0] - theirs[0]).abs().max().item()
    assert (got - theirs[0]).abs().max().item() < 1e-3 < off / 5


def test_qwen3_qk_norm_and_wide_heads_import_export_and_run_in_llama_cpp(tmp_path):
    """Qwen3 (``model.qk_norm``: an RMSNorm over each head's q and k; heads wider than hidden_size /
    num_attention_heads, ``model.head_dim``): a transformers ``Qwen3ForCausalLM`` with random norm weights
    imports with its logits, exports back as ``Qwen3ForCausalLM`` with them, and runs as llama.cpp's
    ``qwen3`` architecture; without the keys the checkpoint is refused naming both."""
    import llama_cpp
    import transformers

    from raysc.export.gguf import export_gguf

    hf_cfg = transformers.Qwen3Config(**QWEN3_HF, head_dim=32)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)  # transformers starts them at one: make them matter
    hf.save_pretrained(tmp_path / "hf")
    base = [
        *MODEL,
        "model.ffn_dim=160",
        "model.norm_eps=1e-6",
        "model.rope_theta=1000000.0",
        f'model.init_from="{tmp_path / "hf"}"',
    ]
    with pytest.raises(CheckpointMismatch) as refused:
        Trainer(load_config(None, base), ROWS, measure_peak=False)
    assert "q/k norms (qwen3) but model.qk_norm = false; set model.qk_norm=true" in str(refused.value)
    assert "head_dim = 32 but the config's heads are 16 wide; set model.head_dim=32" in str(refused.value)
    qwen3 = [*base, "model.head_dim=32", "model.qk_norm=true"]
    ours = Trainer(load_config(None, qwen3), ROWS, measure_peak=False).model.eval()
    ids = torch.from_numpy(ROWS[:2, :32])
    with torch.no_grad():
        theirs = hf(ids).logits
        assert _close(ours(ids), theirs)
        unnormed = Llama(load_config(None, qwen3[:-1] + ["model.qk_norm=false"]).model, 32).eval()
        unnormed.load_state_dict(
            {k: v for k, v in ours.state_dict().items() if not k.endswith(("q_norm.weight", "k_norm.weight"))}
        )
        assert not _close(unnormed(ids), theirs)  # the norms count
    tok = _tokenizer(tmp_path)
    out = export_hf(ours, tok, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 32)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert _close(back(ids).logits, theirs)
    llm = llama_cpp.Llama(
        model_path=str(export_gguf(ours, tok, tmp_path / "model.gguf")),
        n_ctx=64,
        n_batch=64,
        logits_all=True,
        verbose=False,
    )
    assert llm.metadata["general.architecture"] == "qwen3"
    llm.eval(ids[0].tolist())
    got = torch.tensor(np.array(llm.scores[:32]))
    with torch.no_grad():
        off = (unnormed(ids)[0] - theirs[0]).abs().max().item()
    assert (got - theirs[0]).abs().max().item() < 1e-3 < off / 5


def test_a_checkpoint_that_does_not_fit_is_refused_naming_the_difference(export, tmp_path):
    params, out = export
    cfg = load_config(None, [*MODEL, "model.ffn_dim=96", f'model.init_from="{out}"'])
    with pytest.raises(CheckpointMismatch) as e:
        Trainer(cfg, ROWS, measure_peak=False)
    assert (
        "model.layers.0.mlp.gate_proj.weight (layers.0.mlp.w_gate.weight): checkpoint shape [192, 64], "
        "the config's model needs [96, 64]"
    ) in str(e.value)
    assert "set model.ffn_dim=192" in str(e.value)
    # a missing tensor: the same folder without one layer's up projection
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in out.iterdir():
        (cut / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(out / hf_checkpoint.WEIGHTS))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(cut / hf_checkpoint.WEIGHTS))
    with pytest.raises(
        CheckpointMismatch,
        match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight "
        r"\(layers\.1\.mlp\.w_up\.weight\): not in model\.safetensors",
    ):
        Trainer(load_config(None, [*MODEL, f'model.init_from="{cut}"']), ROWS, measure_peak=False)
    # a llama3-scaled rope into a config without the scaling, and with another factor
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for f in out.iterdir():
        (scaled / f.name).write_bytes(f.read_bytes())
    hf_cfg = json.loads((out / "config.json").read_text())
    hf_cfg["rope_parameters"] = {**LLAMA3_ROPE, "rope_theta": 10000.0}
    (scaled / "config.json").write_text(json.dumps(hf_cfg))
    with pytest.raises(
        CheckpointMismatch, match="rope type 'llama3' but model.rope_scaling = 'none'; set model.rope_scaling=llama3"
    ):
        Trainer(load_config(None, [*MODEL, f'model.init_from="{scaled}"']), ROWS, measure_peak=False)
    with pytest.raises(
        CheckpointMismatch, match="rope factor = 4.0 but model.rope_factor = 8.0; set model.rope_factor=4.0"
    ):
        Trainer(
            load_config(
                None,
                [
                    *MODEL,
                    "model.rope_scaling=llama3",
                    "model.rope_original_max_position=16",
                    f'model.init_from="{scaled}"',
                ],
            ),
            ROWS,
            measure_peak=False,
        )
    # an architecture raysc does not read, and Mistral's sliding window, are named
    (scaled / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "gemma"}))
    with pytest.raises(
        CheckpointMismatch, match="model_type 'gemma' is not one raysc reads .llama, qwen2, qwen3, mistral"
    ):
        Trainer(load_config(None, [*MODEL, f'model.init_from="{scaled}"']), ROWS, measure_peak=False)
    (scaled / "config.json").write_text(json.dumps({**hf_cfg, "model_type": "mistral", "sliding_window": 4096}))
    with pytest.raises(CheckpointMismatch, match="sliding-window attention .sliding_window = 4096"):
        Trainer(load_config(None, [*MODEL, f'model.init_from="{scaled}"']), ROWS, measure_peak=False)
    # μP whose folded scales cannot be multiplied back out exactly (m = 64/24)
    with pytest.raises(CheckpointMismatch, match="width multiplier m = 2.66667 is not; set model.mup=false"):
        Trainer(
            load_config(None, [*MODEL, "model.mup=true", "model.mup_base_width=24", f'model.init_from="{out}"']),
            ROWS,
            measure_peak=False,
        )


def test_raysc_train_init_from_s3(export, make_cfg, ray_session, s3_server, tmp_path):
    from raysc.data.prepare import prepare_data
    from raysc.fleet.driver import train

    params, out = export
    s3_server["client"].create_bucket(Bucket="hf-models")
    for f in out.iterdir():
        s3_server["client"].upload_file(str(f), "hf-models", f"tiny/{f.name}")
    url = "s3://hf-models/tiny"
    # s3fs's own keyword arguments, passed to fsspec as they are
    options = (
        f'model.init_from_options={{endpoint_url = "{s3_server["endpoint"]}", key = "testing", '
        f'secret = "testing-secret", client_kwargs = {{region_name = "us-east-1"}}}}'
    )
    cfg = make_cfg("train.steps=2", "train.seed=3", f'model.init_from="{url}"', options)
    train(cfg, progress=False)
    run = Path(cfg.run_dir)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    init = [e for e in events if e["kind"] == "init_from"]
    assert len(init) == 1 and init[0]["source"] == url and init[0]["sha256"] == content_sha256(out)
    # the run's tokenizer is the checkpoint's
    assert (run / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    # its first loss is that of the exported weights on the run's first batch
    cfg_ref = make_cfg("train.steps=2", "train.seed=3", f'data.tokenizer="{out / "tokenizer.json"}"')
    packed, _, _ = prepare_data(cfg_ref)
    ref = Trainer(cfg_ref, packed.train, measure_peak=False)
    with torch.no_grad():
        for name, p in ref.model.named_parameters():
            p.copy_(params[name])
    want = ref.train_step()["loss"]  # this process's thread count, not the worker's: not to the bit
    assert abs(metrics[0]["loss"] - want) <= 1e-6 * want


def test_a_corpus_packed_with_another_tokenizer_is_refused_before_ray(export, packed_corpus):
    """``raysc train --init-from`` on a ``raysc pack`` directory packed with another tokenizer than the
    checkpoint's stops in the CLI's input checks, naming both; its own tokenizer passes them."""
    from raysc.fleet.driver import check_inputs

    _, out = export
    packed = Path(packed_corpus["packed"])
    base = [*MODEL, "train.seq_len=64", f'model.init_from="{out}"', f'data.source="{packed}"']
    with pytest.raises(
        ValueError,
        match=r"data.source .* was packed with another tokenizer \(tokenizer.json in it, "
        r"SHA-256 \w{12}\) than the run's, '.*tokenizer.json' \(model.init_from's, "
        r"SHA-256 \w{12}\); re-pack the corpus with that tokenizer",
    ):
        check_inputs(load_config(None, base))
    check_inputs(load_config(None, [*base, f'data.tokenizer="{packed / packed_corpus["index"]["tokenizer"]}"']))
