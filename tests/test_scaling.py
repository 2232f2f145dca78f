"""Scaling recipes: the Chinchilla split and shapes, μP's parametrisation, its coordinate check and LR transfer.

All CPU and in-process (no Ray). The μP experiments train tiny Llamas (2 layers,
vocab 512, seq 32) on the bundled corpus prepared by ``prepare_data``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from forked import run_forked
from raysc.cli import main
from raysc.config.schema import ModelConfig, OptimConfig
from raysc.data.prepare import prepare_data
from raysc.model import mup
from raysc.model.flops import param_count
from raysc.model.llama import Rope, build_model
from raysc.scaling import chinchilla
from raysc.scaling.coord_check import coord_check, write
from raysc.scaling.probe import at_width
from raysc.scaling.transfer import format_sweep, lr_sweep
from raysc.train.optim import build_optimizer

SMALL = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)


# ---- Chinchilla ----


def test_parse_count_accepts_suffixes_and_names_the_flag_on_errors():
    assert chinchilla.parse_count("7B") == 7e9
    assert chinchilla.parse_count("1.3e9") == 1.3e9
    assert chinchilla.parse_count("350M") == 350e6
    assert chinchilla.parse_count("1.4T") == 1.4e12
    assert chinchilla.parse_count("1e21") == 1e21
    assert chinchilla.parse_count(" 2k ") == 2000
    for bad in ("seven", "7X", "", "-1", "0", "inf"):
        with pytest.raises(ValueError, match="--params"):
            chinchilla.parse_count(bad, "--params")


def test_compute_optimal_matches_the_chinchilla_table():
    # Chinchilla itself: 70B parameters on 1.4T tokens, C = 6·N·D ≈ 5.9e23 FLOPs (Hoffmann et al. 2022)
    c = chinchilla.compute_optimal(compute=5.9e23)
    assert c["params"] == pytest.approx(70e9, rel=0.10)
    assert c["tokens"] == pytest.approx(1.4e12, rel=0.10)
    assert c["compute"] == pytest.approx(5.9e23, rel=1e-12)
    # Table 3 (approach 1): 1B -> 1.21e20 FLOPs, 20.2B tokens; 10B -> 1.23e22 FLOPs, 205.1B tokens
    assert chinchilla.compute_optimal(params=1e9)["compute"] == pytest.approx(1.21e20, rel=0.05)
    assert chinchilla.compute_optimal(params="10B")["tokens"] == pytest.approx(205.1e9, rel=0.05)
    # 1e21 FLOPs: N = sqrt(1e21/120) ≈ 2.9B, D ≈ 58B; the three entry points agree
    c21 = chinchilla.compute_optimal(compute="1e21")
    assert c21["params"] == pytest.approx(2.887e9, rel=1e-3)
    assert chinchilla.compute_optimal(tokens=c21["tokens"])["params"] == pytest.approx(c21["params"])
    assert chinchilla.compute_optimal(params=c21["params"])["compute"] == pytest.approx(1e21)
    with pytest.raises(ValueError, match="exactly one"):
        chinchilla.compute_optimal(params=1e9, tokens=2e10)
    with pytest.raises(ValueError, match="exactly one"):
        chinchilla.compute_optimal()


@pytest.mark.parametrize("target,vocab", [(70e9, 32000), (7e9, 32000), (1.3e9, 50257), (125e6, 50257)])
def test_suggested_shapes_are_exact_counts_near_n(target, vocab):
    base = ModelConfig(vocab_size=vocab, n_heads=8, n_kv_heads=8)
    shapes = chinchilla.suggest_shapes(target, base)
    assert 3 <= len(shapes) <= 5
    for s in shapes:
        assert s["params"] == pytest.approx(target, rel=0.15)
        assert s["dim"] % 128 == 0 and s["head_dim"] in (64, 128) and s["dim"] == s["n_heads"] * s["head_dim"]
        assert chinchilla.ASPECT_BAND[0] <= s["dim"] / s["n_layers"] <= chinchilla.ASPECT_BAND[1]
        cfg = chinchilla.shape_config(base, s["n_layers"], s["dim"], s["head_dim"])
        assert s["params"] == param_count(cfg)["total"]  # the model's own count, embeddings included
    assert [abs(s["rel_diff"]) for s in shapes] == sorted(abs(s["rel_diff"]) for s in shapes)


def test_loss_law_is_finite_and_decreasing_in_n_and_d():
    for fit in chinchilla.FITS:
        grid = [[fit.loss(n, d) for d in (1e9, 1e10, 1e11, 1e12)] for n in (1e8, 1e9, 1e10, 1e11)]
        assert all(math.isfinite(x) and x > fit.E for row in grid for x in row)
        assert all(a > b for row in grid for a, b in zip(row, row[1:]))  # more data: lower loss
        assert all(a > b for col in zip(*grid) for a, b in zip(col, col[1:]))  # more parameters: lower loss
    hoffmann = chinchilla.FITS[0]
    assert hoffmann.loss(70e9, 1.4e12) == pytest.approx(1.69 + 406.4 / 70e9**0.34 + 410.7 / 1.4e12**0.28)


def test_plan_steps_and_scale_cli(capsys):
    p = chinchilla.plan(tokens="1.4T", model=ModelConfig(vocab_size=32000), global_batch_tokens="4M", seq_len=2048)
    assert p["steps"] == math.ceil(1.4e12 / 4e6)
    assert all(s["steps"] == math.ceil(s["tokens"] / 4e6) for s in p["shapes"])
    assert set(p["loss"]) == {"hoffmann2022", "besiroglu2024"}
    text = chinchilla.format_plan(p)
    assert "70B" in text and "350,000" in text and "besiroglu2024" in text
    # a shape just under a unit reads in the next one (`raysc scale --params 1e9` printed "1e+03M")
    assert [chinchilla._si(x) for x in (999.6e6, 999.4e6, 1234, 12)] == ["1B", "999M", "1.23K", "12"]

    assert (
        main(
            ["scale", "--compute", "5.9e23", "--global-batch-tokens", "4M", "--json", "--set", "model.vocab_size=32000"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == pytest.approx(70e9, rel=0.1) and out["steps"] > 0 and len(out["shapes"]) >= 3
    assert main(["scale", "--params", "7B"]) == 0
    assert "Shapes near N" in capsys.readouterr().out
    assert main(["scale", "--params", "seven"]) == 2
    assert "--params" in capsys.readouterr().err


# ---- μP: parametrisation ----


def _groups_by_param(opt: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): g for g in opt.param_groups for p in g["params"]}


def test_mup_off_keeps_the_two_optimizer_groups():
    model = build_model(SMALL, 32, seed=0)
    optim = OptimConfig()
    opt = build_optimizer(list(model.named_parameters()), optim, SMALL)
    old = build_optimizer(list(model.parameters()), optim)  # the previous call signature
    assert len(opt.param_groups) == len(old.param_groups) == 2
    for new_g, old_g in zip(opt.param_groups, old.param_groups):
        assert [id(p) for p in new_g["params"]] == [id(p) for p in old_g["params"]]
        assert new_g["lr"] == old_g["lr"] == optim.lr
        assert new_g["weight_decay"] == old_g["weight_decay"]
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"])
    # μP at width multiplier 1 initialises exactly like the standard parametrisation
    same = build_model(dataclasses.replace(SMALL, mup=True), 32, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    assert model.logit_mult == same.logit_mult == 1.0


def test_mup_learning_rates_init_and_weight_decay_by_name():
    cfg = dataclasses.replace(SMALL, dim=256, n_heads=16, n_kv_heads=8, mup=True, mup_base_width=64)
    m = cfg.mup_width_mult
    assert m == 4.0
    model = build_model(cfg, 32, seed=0)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    groups = _groups_by_param(build_optimizer(list(model.named_parameters()), optim, cfg))
    for name, p in model.named_parameters():
        g = groups[id(p)]
        if name.endswith(("embed.weight", "output.weight")):
            assert (g["lr"], g["weight_decay"]) == (optim.lr, optim.weight_decay), name
        elif name.endswith("norm.weight"):
            assert (g["lr"], g["weight_decay"]) == (optim.lr, 0.0), name
        else:
            assert mup.is_hidden(name)
            assert g["lr"] == pytest.approx(optim.lr / m) and g["weight_decay"] == pytest.approx(0.1 * m), name
    params = dict(model.named_parameters())
    assert params["embed.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert params["output.weight"].std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert params["layers.0.attn.wq.weight"].std().item() == pytest.approx(cfg.init_std / m**0.5, rel=0.05)
    assert params["layers.1.mlp.w_down.weight"].std().item() == pytest.approx(
        cfg.init_std / math.sqrt(2 * cfg.n_layers) / m**0.5, rel=0.05
    )
    assert model.logit_mult == pytest.approx(1 / m)
    # names decide, wherever they come from: a compiled/wrapped module, a pipeline stage without the ends
    assert mup.param_role("_orig_mod.layers.7.attn.wk.weight") == mup.HIDDEN
    assert mup.param_role("_orig_mod.output.weight") == mup.OUTPUT
    stage = [(n, p) for n, p in model.named_parameters() if n.startswith("layers.")]
    stage_opt = build_optimizer(stage, optim, cfg)
    assert stage_opt.param_groups[0]["lr"] == optim.lr  # group 0 (norms) always carries the base LR
    with pytest.raises(ValueError, match="no rule for parameter 'layers.0.attn.bias'"):
        mup.param_role("layers.0.attn.bias")
    with pytest.raises(ValueError, match="parameter names"):
        build_optimizer(list(model.parameters()), optim, cfg)


def _manual_attention(attn, x: torch.Tensor, rope: Rope, scale: float) -> torch.Tensor:
    b, t, _ = x.shape
    hd = attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, t, -1, hd).transpose(1, 2)
    k = (x @ attn.wk.weight.T).view(b, t, -1, hd).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(b, t, -1, hd).transpose(1, 2)
    cos, sin = rope.tables(t, q.dtype)
    rot = lambda z: torch.cat((-z[..., hd // 2 :], z[..., : hd // 2]), dim=-1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(b, t, -1) @ attn.wo.weight.T


def test_mup_attention_uses_one_over_head_dim_and_logits_one_over_m():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    for on in (False, True):
        cfg = dataclasses.replace(SMALL, mup=on, mup_base_width=32)
        model = build_model(cfg, 32, seed=1)
        attn = model.layers["0"].attn
        rope = Rope(model.rope_cos, model.rope_sin, None)
        hd = cfg.head_dim
        want = _manual_attention(attn, x, rope, 1 / hd if on else 1 / math.sqrt(hd))
        other = _manual_attention(attn, x, rope, 1 / math.sqrt(hd) if on else 1 / hd)
        got = attn(x, rope)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got, other, rtol=1e-3, atol=1e-5)
    # logits: output(h)/m, with m = 64/32 = 2
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        scaled = model(tokens)
        model.logit_mult = 1.0
        plain = model(tokens)
    torch.testing.assert_close(scaled * 2.0, plain, rtol=1e-5, atol=1e-6)


def test_fold_into_weights_exports_a_standard_model_with_the_same_logits():
    cfg = dataclasses.replace(SMALL, dim=128, n_heads=8, n_kv_heads=4, mup=True, mup_base_width=32)
    model = build_model(cfg, 32, seed=2)
    sp_cfg = dataclasses.replace(cfg, mup=False)
    sp = build_model(sp_cfg, 32, seed=3)
    sp.load_state_dict(mup.fold_into_weights(model.state_dict(), cfg))
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(sp(tokens), model(tokens), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="tie_embeddings"):
        mup.fold_into_weights(model.state_dict(), dataclasses.replace(cfg, tie_embeddings=True))


# ---- μP: experiments on the bundled corpus ----


@pytest.fixture
def tiny_rows(make_cfg):
    """A tiny config (vocab 512, 2 layers, head_dim 16, seq 32) and its training rows."""
    cfg = make_cfg("train.seq_len=32", "schedule.warmup_steps=5")
    packed, _, _ = prepare_data(cfg)
    return cfg, packed.train


def test_coord_check_mup_flat_sp_grows(tiny_rows, tmp_path):
    cfg, rows = tiny_rows
    report = coord_check(cfg, rows, widths=[32, 64, 128, 256], steps=5)
    mu, sp = report["mup"], report["sp"]
    print("\ncoord check slopes (log|act| vs log width, step 5):")
    for name in sp["slopes"]:
        print(f"  {name:16} SP {sp['slopes'][name]:+.3f}  μP {mu['slopes'][name]:+.3f}")
    assert report["passed"] and mu["max_slope"] <= 0.25
    assert sp["slopes"]["logits"] > 0.75  # SP logits grow about linearly with the width under Adam
    assert sp["max_slope"] > 1.0 > 0.25 >= mu["max_slope"]
    files = write(report, tmp_path / "cc")
    assert json.loads(open(files["json"]).read())["passed"] is True
    assert open(files["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_mup_coord_check_cli(tmp_path, cache_dir, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(
        f"[model]\nvocab_size = 512\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n"
        f"[train]\nseq_len = 32\nglobal_batch = 8\n"
        f'[data]\nmax_corpus_mb = 1.0\ntokenizer_sample_mb = 0.5\ncache_dir = "{cache_dir}"\n'
        f'[run]\ndir = "{tmp_path / "run"}"\n'
    )
    rc = main(["mup", "coord-check", str(cfg), "--widths", "32,64,128", "--steps", "3", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    # the science (docs/scaling.md): under μP no layer's activations grow with width; under SP with
    # Adam attention/MLP outputs and the logits grow at least linearly after the first update
    assert rc == 0 and "μP PASSES" in out, out
    assert (tmp_path / "o" / "coord_check.png").exists()
    report = json.loads((tmp_path / "o" / "coord_check.json").read_text())
    assert report["mup"]["max_slope"] <= report["bound"] == 0.25
    assert abs(report["mup"]["slopes"]["logits"]) < 0.25 and report["sp"]["slopes"]["logits"] > 0.5
    assert report["sp"]["max_slope"] > 1.0  # the same check fails SP: it can tell the two apart
    assert main(["mup", "coord-check", str(cfg), "--widths", "32,abc"]) == 2
    assert "--widths" in capsys.readouterr().err
    assert main(["mup", "coord-check", str(cfg), "--widths", "30,64"]) == 2  # 30 is not a multiple of head_dim 16
    assert "head_dim" in capsys.readouterr().err


def test_at_width_keeps_head_dim_and_gqa_ratio():
    c = at_width(SMALL, 256, True, 64)
    assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.mup_width_mult) == (256, 16, 8, 16, 4.0)
    with pytest.raises(ValueError, match="head_dim"):
        at_width(SMALL, 72, True, 64)


def _sweep(index: int, cfg, rows, out: str) -> None:
    """One forked process: the LR sweep under SP (index 0) or μP (index 1), written to ``out``."""
    torch.set_num_threads(1)
    lrs = [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]  # 2x grid
    seeds = [cfg.train.seed, cfg.train.seed + 1]
    run = lr_sweep(
        cfg.model,
        cfg.optim,
        cfg.schedule,
        rows,
        [32, 128],
        lrs,
        steps=50,
        batch=16,
        seeds=seeds,
        mup=bool(index),
        tail=10,
    )
    Path(out, f"{index}.json").write_text(json.dumps(run))


def test_lr_transfer_mup_keeps_the_best_lr_sp_does_not(tiny_rows, tmp_path):
    """The issue's CI test: sweep the peak LR at widths 32 and 128 (head_dim 16, 2 layers, 50 steps of
    16×32 tokens, warmup 5 + cosine, clipping 1.0, final loss = mean of the last 10 steps, averaged
    over two seeds). Under μP (base width 32) the best LR stays within one grid step; under SP it
    moves further (SP with Adam wants the LR to fall about like 1/width). SP and μP sweep in two
    forked processes of one thread each, one per core."""
    cfg, rows = tiny_rows
    run_forked(_sweep, (cfg, rows, str(tmp_path)), nprocs=2)
    # JSON keys are strings: back to widths and learning rates
    sp, mu = (
        {
            **r,
            "loss": {int(w): {float(lr): v for lr, v in by.items()} for w, by in r["loss"].items()},
            "best_lr": {int(w): lr for w, lr in r["best_lr"].items()},
        }
        for r in (json.loads((tmp_path / f"{i}.json").read_text()) for i in (0, 1))
    )
    print("\n" + format_sweep(sp) + "\n" + format_sweep(mu))
    assert abs(mu["shift"]) <= 1
    assert abs(sp["shift"]) > abs(mu["shift"])
    # and the wide μP model at its best LR beats the narrow one (wider is better under μP)
    assert min(mu["loss"][128].values()) < min(mu["loss"][32].values())


def test_trainer_builds_mup_groups_from_named_parameters(tiny_rows):
    from raysc.train.trainer import Trainer

    cfg, rows = tiny_rows
    cfg.model.mup, cfg.model.mup_base_width = True, 32  # dim 64: m = 2
    trainer = Trainer(cfg, rows, measure_peak=False)
    groups = _groups_by_param(trainer.optimizer)
    names = dict(trainer.model.named_parameters())
    # the scheduler multiplies every group's own peak (initial_lr) by the same factor
    assert groups[id(names["layers.0.mlp.w_up.weight"])]["initial_lr"] == pytest.approx(cfg.optim.lr / 2)
    assert groups[id(names["embed.weight"])]["initial_lr"] == cfg.optim.lr
    first = trainer.train_step()
    assert first["lr"] == pytest.approx(cfg.optim.lr / cfg.schedule.warmup_steps)  # the base LR's schedule
    assert math.isfinite(trainer.train_step()["loss"])
