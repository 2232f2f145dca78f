"""``raysc quantize``: a run's checkpoint → a quantized Hugging Face folder vLLM loads, with its
manifest.

Restores the model without Ray (``raysc.export.restore``), folds μP's scales into the weights as
the Hugging Face export does, draws calibration rows from the run's training split
(``calibration``), quantizes block by block (``sequential``), measures perplexity before and after
on the validation split (``quality``; 8-bit also quantizes activations per token, as the W8A8
engine does), and writes the folder (``writer``) and ``quantize_manifest.json`` (``manifest``);
an object-store ``out`` (``s3://...``) gets the folder uploaded from a temporary one (``publish``).
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from raysc.config.secrets import REDACTED
from raysc.data.prepare import prepare_data
from raysc.export.hf import hf_name
from raysc.export.restore import RunModel, load_run
from raysc.model.hf_names import require_dense
from raysc.model.llama import Llama
from raysc.model.mup import fold_into_weights
from raysc.quantize.awq import CLIP_GRID, MAX_SHRINK
from raysc.quantize.calibration import calibration, heldout_rows
from raysc.quantize.manifest import write_manifest
from raysc.quantize.publish import is_remote, open_destination, upload_folder
from raysc.quantize.quality import int8_activations, perplexity
from raysc.quantize.rtn import QuantSpec
from raysc.quantize.sequential import GROUPS, METHODS, NO_CLIP, quantize_model
from raysc.quantize.writer import file_bytes, scheme, write_checkpoint


def method_spec(method: str, bits: int | None, group_size: int) -> QuantSpec:
    """The grid of ``method``: int8 is 8-bit per channel; rtn4 is 4-bit; gptq and awq take 4 or 8
    bits (8 = per channel, written as W8A8). AWQ is asymmetric (its paper's zero points), the rest
    symmetric."""
    if method not in METHODS:
        raise ValueError(f"unknown --method {method!r}; choose one of {', '.join(METHODS)}")
    fixed = {"int8": 8, "rtn4": 4}.get(method)
    if fixed is not None and bits not in (None, fixed):
        raise ValueError(f"--method {method} is {fixed}-bit; drop --bits {bits} or pick gptq/awq")
    bits = fixed or bits or 4
    if bits not in (4, 8):
        raise ValueError(f"--bits {bits}: vLLM on CPU runs 4-bit (W4A16) and 8-bit (W8A8) weights; pass 4 or 8")
    if bits == 8:  # vLLM's W8A8 scheme takes per-channel (or per-tensor) weight scales only
        return QuantSpec(8, -1, True)
    return QuantSpec(4, group_size, symmetric=method != "awq")


def plain_model(model: Llama) -> Llama:
    """A standard-parametrisation copy of ``model`` computing the same function (μP folded in)."""
    cfg = dataclasses.replace(model.cfg, mup=False)
    plain = Llama(cfg, model.max_seq_len)
    state = fold_into_weights({k: v.detach() for k, v in model.named_parameters()}, model.cfg)
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or set(missing) - ({"output.weight"} if cfg.tie_embeddings else set()):
        raise RuntimeError(f"cannot rebuild the model: missing {missing}, unexpected {unexpected}")
    return plain.eval()


def linear_names(model: Llama) -> list[str]:
    return [f"layers.{i}.{n}" for i in model.layers for g in GROUPS for n in g]


def quantize_run(
    run_dir: str | Path,
    method: str,
    *,
    bits: int | None = None,
    group_size: int = 128,
    calib_tokens: int = 16384,
    eval_tokens: int = 16384,
    out: str | Path | None = None,
    seed: int | None = None,
    step: int | None = None,
    act_order: bool = True,
) -> dict:
    """Quantize the run in ``run_dir``; returns the manifest (also written to ``out``, a local folder
    or an object-store URI)."""
    spec = method_spec(method, bits, group_size)
    run = load_run(run_dir, step)
    require_dense(run.model.cfg, f"quantized ({method})")
    for n, p in run.model.named_parameters():  # the group size must fit every layer before any work
        if n.startswith("layers.") and p.dim() == 2:
            spec.groups(p.shape[1])
    if out is None or not is_remote(out):
        return _quantize(run, run_dir, method, spec, calib_tokens, eval_tokens, out, seed, act_order)
    options = {k: v for k, v in run.cfg.checkpoint.storage_options.items() if v != REDACTED}
    storage = open_destination(str(out), options)  # before the work: a bad --out fails in seconds
    with tempfile.TemporaryDirectory(prefix="raysc-quantize-") as tmp:
        manifest = _quantize(run, run_dir, method, spec, calib_tokens, eval_tokens, Path(tmp) / "out", seed, act_order)
        upload_folder(manifest["out"], storage)
    manifest["out"] = str(out)
    return manifest


def _quantize(
    run: RunModel,
    run_dir: str | Path,
    method: str,
    spec: QuantSpec,
    calib_tokens: int,
    eval_tokens: int,
    out: str | Path | None,
    seed: int | None,
    act_order: bool,
) -> dict:
    t0 = time.perf_counter()
    cfg = run.cfg
    seed = cfg.train.seed if seed is None else seed
    packed, _, _ = prepare_data(cfg)
    calib = calibration(packed, calib_tokens, seed)
    heldout = heldout_rows(packed, max(1, -(-eval_tokens // packed.seq_len)))
    act_order = act_order and method == "gptq"
    out = Path(out) if out else Path(run_dir) / "quantized" / _default_name(method, spec)

    model = plain_model(run.model)
    reference = copy.deepcopy(model)
    ppl_before = perplexity(reference, heldout)
    torch.manual_seed(seed)
    q = quantize_model(model, calib.tokens, method, spec, act_order=act_order)
    if spec.bits == 8:
        with int8_activations(model, linear_names(model)):
            ppl_after = perplexity(model, heldout)
    else:
        ppl_after = perplexity(model, heldout)
    write_checkpoint(model, q.linears, run.tokenizer_path, out, spec, act_order)
    layers = {}
    for name, r in q.reports.items():
        layers[hf_name(f"{name}.weight").removesuffix(".weight")] = {
            "error": r.error,
            "rtn_error": r.rtn_error,
            **r.extra,
        }
    perms = {
        hf_name(f"{n}.weight").removesuffix(".weight"): ql.perm for n, ql in q.linears.items() if ql.perm is not None
    }
    fmt = scheme(spec, act_order)
    manifest = {
        "method": method,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "symmetric": spec.symmetric,
        "act_order": act_order,
        "format": {
            "name": "compressed-tensors",
            "format": fmt["format"],
            "scheme": "W8A8 (dynamic per-token int8 activations)" if spec.bits == 8 else f"W{spec.bits}A16",
        },
        "source": {"run_dir": str(run_dir), "checkpoint": run.checkpoint, "step": run.step},
        "calibration": {
            "split": "train",
            "data_source": cfg.data.source,
            "seed": seed,
            "rows": len(calib.rows),
            "seq_len": packed.seq_len,
            "tokens": calib.n_tokens,
            "sha256": calib.sha256,
        },
        "quality": {
            "split": "val",
            "rows": int(heldout.shape[0]),
            "tokens": int(heldout[:, 1:].numel()),
            "perplexity_before": ppl_before,
            "perplexity_after": ppl_after,
            "relative_increase": ppl_after / ppl_before - 1.0,
            "max_quality_loss": cfg.serve.max_quality_loss,
            "within_max_quality_loss": ppl_after / ppl_before - 1.0 <= cfg.serve.max_quality_loss,
        },
        "layers": layers,
        **(
            {
                "awq_clip": {
                    "grid": CLIP_GRID,
                    "max_shrink": MAX_SHRINK,
                    "not_clipped": [hf_name(f"layers.0.{n}.weight").split(".")[-2] for n in NO_CLIP],
                    "meaning": "per (output channel, group) range ±r·max|w|, r searched on the calibration "
                    "inputs after AWQ's scaling; layers[...].clip says what it did",
                }
            }
            if method == "awq"
            else {}
        ),
        "bytes": file_bytes(out),
        "full_precision_bytes": 4 * sum(p.numel() for p in reference.parameters()),  # the fp32 export's weights
        "seconds": round(time.perf_counter() - t0, 2),
    }
    write_manifest(out, manifest, perms)
    manifest["out"] = str(out)
    return manifest


def _default_name(method: str, spec: QuantSpec) -> str:
    return f"{method}-w{spec.bits}" + (f"g{spec.group_size}" if spec.group_size != -1 else "")
