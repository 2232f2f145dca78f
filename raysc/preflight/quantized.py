"""Checklist item 7 measured: quantize the probe run's checkpoint with the method
``serve.quantization`` names and compare held-out perplexities with the training precision.

``int8`` is per-channel int8 served as W8A8; ``int4`` is 4-bit GPTQ (the best of the 4-bit methods
``raysc quantize`` offers), with the largest of the group sizes 128, 64, 32 that divides every
layer (else per channel). The precisions vLLM runs without a quantized checkpoint (bf16, fp16,
fp8) are not measured here. The quantized folder is written under the probe's run directory.
"""

from __future__ import annotations

from pathlib import Path

from raysc.config.schema import Config

METHOD_FOR = {"int8": ("int8", None), "int4": ("gptq", 4)}
CALIB_TOKENS = 4096
EVAL_TOKENS = 8192


def fitting_group_size(in_features: list[int]) -> int:
    return next((g for g in (128, 64, 32) if all(n % g == 0 for n in in_features)), -1)


def measure_quantization(
    cfg: Config, probe_run_dir: str | Path, calib_tokens: int = CALIB_TOKENS, eval_tokens: int = EVAL_TOKENS
) -> dict | None:
    """Evidence for item 7, or None when ``serve.quantization`` names no quantized checkpoint."""
    if cfg.serve.quantization not in METHOD_FOR:
        return None
    from raysc.quantize.run import quantize_run

    method, bits = METHOD_FOR[cfg.serve.quantization]
    m = cfg.model
    group = fitting_group_size([m.dim, m.n_heads * m.head_dim, m.hidden_ffn_dim])
    man = quantize_run(
        probe_run_dir,
        method,
        bits=bits,
        group_size=group,
        calib_tokens=calib_tokens,
        eval_tokens=eval_tokens,
        out=Path(probe_run_dir) / "quantized" / method,
    )
    q = man["quality"]
    return {
        "method": method,
        "bits": man["bits"],
        "group_size": man["group_size"],
        "step": man["source"]["step"],
        "perplexity_training_precision": q["perplexity_before"],
        "perplexity_quantized": q["perplexity_after"],
        "relative_increase": q["relative_increase"],
        "heldout_tokens": q["tokens"],
        "bytes": man["bytes"],
        "full_precision_bytes": man["full_precision_bytes"],
        "folder": man["out"],
    }
