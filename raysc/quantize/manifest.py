"""The record a quantized checkpoint carries: ``quantize_manifest.json`` beside the weights.

It says how the checkpoint was made (method, bits, group size, symmetry, act-order, format, the run
and checkpoint step it came from, the calibration rows' SHA-256, seed and count), every quantized
layer's relative reconstruction error on its calibration inputs next to round-to-nearest's, and
the measured quality: perplexity of the full-precision and the quantized model on the same held-out
rows. GPTQ's act-order permutations are tensors, so they go into ``quantize/act_order.safetensors``
(int32 per layer; a subfolder, where vLLM does not look for weights) with its SHA-256 in the manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from raysc.hashing import file_sha256

MANIFEST = "quantize_manifest.json"
ACT_ORDER = "quantize/act_order.safetensors"


def write_manifest(out_dir: str | Path, manifest: dict, perms: dict[str, torch.Tensor]) -> Path:
    """Write ``manifest`` (plus the permutation file when ``perms``) into ``out_dir``; returns its path."""
    out = Path(out_dir)
    manifest = dict(manifest)
    if perms:
        path = out / ACT_ORDER
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.int32).contiguous() for k, v in perms.items()}, str(path))
        manifest["act_order_permutations"] = {
            "file": ACT_ORDER,
            "sha256": file_sha256(path),
            "meaning": "per layer, input columns in the order GPTQ quantized them",
        }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out / MANIFEST


def read_manifest(out_dir: str | Path) -> dict:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {out_dir} is not the output of `raysc quantize`")
    return json.loads(path.read_text())
