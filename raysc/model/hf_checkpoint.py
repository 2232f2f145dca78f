"""Read a Hugging Face Llama checkpoint as raysc parameters, one block of one tensor at a time.

``HFCheckpoint`` opens a directory in the layout ``raysc export`` writes and public Llama-family
checkpoints use: ``config.json`` and ``model.safetensors``, or shards listed by
``model.safetensors.index.json``. It maps names back through ``raysc.model.hf_names``, compares
``config.json`` and every tensor's shape with the run's ``[model]`` config (``problems`` lists every
difference, naming the tensor and both shapes; a missing or an unexpected tensor is one too), and
``read`` returns any block of a tensor through safetensors' ``get_slice``: the file is memory-mapped
and only the requested rows are read, so a rank reading its shard never holds the full tensor. A
mixture of experts' routed experts are read from one tensor per expert (stacked on the expert dim) or
from transformers 5's fused tensors (a half of ``gate_up_proj`` for each of the gate and up weights):
``Source`` says which, and either way a rank reads only its experts' rows.

Under μP, export folds the logit multiplier 1/m into ``lm_head`` and the 1/head_dim attention scale
into ``q_proj`` (``raysc.model.mup.fold_into_weights``); ``read`` multiplies them back out. That is
exact only when sqrt(head_dim) and m are powers of two (a multiplication by 2^k only changes the
exponent); otherwise ``problems`` refuses μP and says what to set.

Ours, not transformers' loader: that builds the whole model in one process, while each raysc rank
needs only its slices. safetensors does the file format; the index is a plain JSON ``weight_map``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from raysc.config.schema import ModelConfig
from raysc.hashing import file_sha256
from raysc.model.hf_names import ARCHITECTURES, EXPERT_PROJ, FUSED_EXPERTS, expert_key, hf_name, raysc_name
from raysc.model.llama import Llama

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
CHUNK_ELEMS = 1 << 22  # values per block read: 16 MiB in fp32
MAX_LISTED = 12  # problems shown in one error
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed buffers some older checkpoints carry


@dataclass(frozen=True)
class Source:
    """Where one raysc parameter lies in the checkpoint: one tensor (with ``part``, its rows
    ``[start, start + size)`` of dim 1: a fused ``gate_up_proj``'s half), or, ``stacked``, one tensor per
    expert in expert order (the parameter's dim 0)."""

    tensors: tuple[str, ...]
    stacked: bool = False
    part: tuple[int, int] | None = None


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the run's model config (the message lists every difference)."""


def weight_map(directory: Path) -> dict[str, str]:
    """Hugging Face tensor name -> the safetensors file (in ``directory``) holding it."""
    if (directory / INDEX).is_file():
        return dict(json.loads((directory / INDEX).read_text())["weight_map"])
    if (directory / WEIGHTS).is_file():
        with safe_open(str(directory / WEIGHTS), framework="pt") as f:
            return {k: WEIGHTS for k in f.keys()}
    raise FileNotFoundError(
        f"model.init_from {str(directory)!r} holds neither {WEIGHTS} nor {INDEX}: point it at "
        f"a Hugging Face Llama checkpoint directory (what `raysc export` writes)"
    )


def files_read(directory: Path) -> list[str]:
    """The files an import reads, sorted: config, index, weight files, tokenizer when present."""
    names = {CONFIG, *weight_map(directory).values()}
    names |= {n for n in (INDEX, TOKENIZER) if (directory / n).is_file()}
    return sorted(names)


def content_sha256(directory: str | Path) -> str:
    """One SHA-256 over the name and SHA-256 of every file the import reads (the run records it)."""
    d = Path(directory)
    h = hashlib.sha256()
    for name in files_read(d):
        h.update(f"{name} {file_sha256(d / name)}\n".encode())
    return h.hexdigest()


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


# llama3 rope scaling: config.json's key -> raysc's model key
LLAMA3_ROPE_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_position",
}


def _rope(hf: dict) -> tuple[float | None, str, dict]:
    """rope_theta, the rope type and its parameters, from either the old keys (``rope_theta``,
    ``rope_scaling``) or transformers 5's ``rope_parameters``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, kind, {**scaling, **params}


def family_settings(hf: dict) -> dict:
    """``ModelConfig`` rotary and family fields from a config.json (theta and, for llama3, its scaling;
    q/k/v biases for qwen2; a head size that is not hidden_size / num_attention_heads)."""
    theta, kind, rope = _rope(hf)
    out = {"rope_theta": float(theta)} if theta is not None else {}
    out["attention_bias"] = hf.get("model_type") == "qwen2" or bool(hf.get("attention_bias"))
    out["qk_norm"] = hf.get("model_type") in ("qwen3", "qwen3_moe")
    heads = hf.get("num_attention_heads")
    if hf.get("head_dim") and heads and hf["head_dim"] != hf.get("hidden_size", 0) // heads:
        out["attn_head_dim"] = hf["head_dim"]
    if kind == "llama3":
        out["rope_scaling"] = "llama3"
        out.update(
            {
                ours: type_(rope[key])
                for key, ours in LLAMA3_ROPE_KEYS.items()
                if key in rope
                for type_ in [int if ours == "rope_original_max_position" else float]
            }
        )
    return out


class HFCheckpoint:
    """A Hugging Face Llama checkpoint directory read against a raysc ``ModelConfig``."""

    def __init__(self, directory: str | Path, cfg: ModelConfig) -> None:
        self.dir = Path(directory)
        self.cfg = cfg
        if not self.dir.is_dir():
            raise FileNotFoundError(
                f"model.init_from {str(self.dir)!r} is not a directory; point it at a Hugging "
                f"Face Llama checkpoint directory or URL (what `raysc export` writes)"
            )
        if not (self.dir / CONFIG).is_file():
            raise FileNotFoundError(
                f"model.init_from {str(self.dir)!r} has no {CONFIG}: point it at a Hugging "
                f"Face Llama checkpoint directory (what `raysc export` writes)"
            )
        self.hf_config: dict = json.loads((self.dir / CONFIG).read_text())
        self.files = weight_map(self.dir)
        self._open: dict[str, safe_open] = {}
        self.sources: dict[str, Source] = {}  # raysc name -> where its values are
        self.unexpected: list[str] = []
        self.layout_problems: list[str] = []  # experts missing from a per-expert layout, or in two layouts
        per_expert: dict[str, dict[int, str]] = {}  # raysc expert weight -> {expert: HF name}
        for hf in self.files:
            ours = raysc_name(hf)
            key = expert_key(hf) if ours is None else None
            if ours is not None:
                self.sources[ours] = Source((hf,))
            elif key is not None and key[1] is None:
                self._add_fused(key[0], key[2], hf)
            elif key is not None:
                per_expert.setdefault(f"layers.{key[0]}.mlp.experts.{key[2]}", {})[key[1]] = hf
            elif not hf.endswith(_IGNORED_SUFFIXES):
                self.unexpected.append(hf)
        for name, by_expert in per_expert.items():
            ids = sorted(by_expert)  # numerically: expert 10 after expert 2
            if ids != list(range(len(ids))):
                missing = sorted(set(range(ids[-1] + 1)) - set(ids))
                self.layout_problems.append(f"{name}: the checkpoint has no tensor for expert(s) {missing}")
            if name in self.sources:
                self.layout_problems.append(f"{name}: the checkpoint holds it both fused and per expert")
            self.sources[name] = Source(tuple(by_expert[e] for e in ids), stacked=True)
        self.names = {ours: src.tensors[0] for ours, src in self.sources.items()}  # the HF name messages show
        self.tied = bool(self.hf_config.get("tie_word_embeddings", False))
        self.scales = self._unfold_scales()

    def _add_fused(self, layer: int, key: str, hf: str) -> None:
        """The raysc expert weights a fused tensor holds: ``gate_up_proj``'s halves, or all of ``down_proj``."""
        weights = FUSED_EXPERTS[key]
        rows = self._slice(hf).get_shape()[1] // len(weights)
        for i, w in enumerate(weights):
            part = (i * rows, rows) if len(weights) > 1 else None
            self.sources[f"layers.{layer}.mlp.experts.{w}"] = Source((hf,), part=part)

    def _unfold_scales(self) -> dict[str, float]:
        """Factors that undo ``fold_into_weights``: sqrt(head_dim) on wq, m on an untied output."""
        if not self.cfg.mup:
            return {}
        out = {"attn.wq.weight": math.sqrt(self.cfg.head_dim)}
        if not self.cfg.tie_embeddings:
            out["output.weight"] = self.cfg.mup_width_mult
        return out

    def _scale(self, name: str) -> float:
        for suffix, f in self.scales.items():
            if name.endswith(suffix):
                return f
        return 1.0

    def _slice(self, hf: str):
        """safetensors' lazy view of the checkpoint tensor ``hf`` (headers only until indexed)."""
        file = self.files[hf]
        if file not in self._open:
            self._open[file] = safe_open(str(self.dir / file), framework="pt")
        return self._open[file].get_slice(hf)

    def shape(self, name: str) -> tuple[int, ...]:
        src = self.sources[name]
        shape = list(self._slice(src.tensors[0]).get_shape())
        if src.part is not None:
            shape[1] = src.part[1]
        return (len(src.tensors), *shape) if src.stacked else tuple(shape)

    def _config_problems(self) -> list[str]:
        c, hf = self.cfg, self.hf_config
        out = []
        model_type = hf.get("model_type", "llama")
        if model_type not in ARCHITECTURES:
            out.append(
                f"config.json: model_type {model_type!r} is not one raysc reads ({', '.join(ARCHITECTURES)}: "
                f"{', '.join(ARCHITECTURES.values())})"
            )
        biased = model_type == "qwen2" or bool(hf.get("attention_bias"))  # Qwen2 always has q/k/v biases
        if biased != c.attention_bias:
            out.append(
                f"config.json: {'q/k/v biases' if biased else 'no attention biases'} ({model_type}) but "
                f"model.attention_bias = {str(c.attention_bias).lower()}; set "
                f"model.attention_bias={str(biased).lower()}"
            )
        qk_norm = model_type in ("qwen3", "qwen3_moe")  # Qwen3 always normalises q and k per head
        if qk_norm != c.qk_norm:
            out.append(
                f"config.json: {'q/k norms' if qk_norm else 'no q/k norms'} ({model_type}) but "
                f"model.qk_norm = {str(c.qk_norm).lower()}; set model.qk_norm={str(qk_norm).lower()}"
            )
        if hf.get("use_sliding_window") or (
            model_type not in ("qwen2", "qwen3", "qwen3_moe") and hf.get("sliding_window")
        ):
            out.append(
                f"config.json: sliding-window attention (sliding_window = {hf.get('sliding_window')}); "
                f"raysc's attention is full causal attention"
            )
        heads = hf.get("num_attention_heads")
        theta, rope_type, rope = _rope(hf)
        want = {  # config.json key: (its value, ours, the raysc key)
            "hidden_size": (hf.get("hidden_size"), c.dim, "model.dim"),
            "num_hidden_layers": (hf.get("num_hidden_layers"), c.n_layers, "model.n_layers"),
            "num_attention_heads": (heads, c.n_heads, "model.n_heads"),
            "num_key_value_heads": (hf.get("num_key_value_heads", heads), c.n_kv_heads, "model.n_kv_heads"),
            # an MoE's dense MLP size matters only where a layer is dense
            "intermediate_size": (
                hf.get("intermediate_size") if any(not c.is_moe_layer(i) for i in range(c.n_layers)) else None,
                c.hidden_ffn_dim,
                "model.ffn_dim",
            ),
            "vocab_size": (hf.get("vocab_size"), c.vocab_size, "model.vocab_size"),
            "rms_norm_eps": (hf.get("rms_norm_eps"), c.norm_eps, "model.norm_eps"),
            "rope_theta": (theta, c.rope_theta, "model.rope_theta"),
            "tie_word_embeddings": (self.tied, c.tie_embeddings, "model.tie_embeddings"),
        }
        for key, (theirs, ours, ours_key) in want.items():
            if theirs is not None and theirs != ours:
                value = str(theirs).lower() if isinstance(theirs, bool) else theirs
                out.append(f"config.json: {key} = {theirs} but {ours_key} = {ours}; set {ours_key}={value}")
        head_dim = hf.get("head_dim") or (hf.get("hidden_size", 0) // heads if heads else None)
        if head_dim is not None and head_dim != c.head_dim:
            out.append(
                f"config.json: head_dim = {head_dim} but the config's heads are {c.head_dim} wide; set "
                f"model.head_dim={head_dim}"
            )
        ours = "default" if c.rope_scaling == "none" else c.rope_scaling
        if rope_type not in ("default", "llama3"):
            out.append(f"config.json: rope type {rope_type!r}; raysc's rotary embedding scales as llama3 or not at all")
        elif rope_type != ours:
            value = "none" if rope_type == "default" else rope_type
            out.append(
                f"config.json: rope type {rope_type!r} but model.rope_scaling = {c.rope_scaling!r}; set "
                f"model.rope_scaling={value}"
            )
        if rope_type == "llama3":
            for key, ours_key in LLAMA3_ROPE_KEYS.items():
                theirs, mine = rope.get(key), getattr(c, ours_key)
                if theirs is not None and float(theirs) != float(mine):
                    out.append(
                        f"config.json: rope {key} = {theirs} but model.{ours_key} = {mine}; set "
                        f"model.{ours_key}={theirs}"
                    )
        if hf.get("hidden_act", "silu") != "silu":
            out.append(f"config.json: hidden_act {hf.get('hidden_act')!r}; raysc's MLP is SwiGLU (silu)")
        if hf.get("mlp_bias"):
            out.append("config.json: mlp_bias is true; raysc's MLP has no biases")
        return out

    def _moe_problems(self) -> list[str]:
        """config.json's mixture of experts against ``[model]``'s (Qwen3-MoE's keys)."""
        c, hf = self.cfg, self.hf_config
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # transformers 5 writes the latter
        if bool(experts) != bool(c.moe_experts):
            return [
                f"config.json: {f'a mixture of {experts} experts' if experts else 'a dense model'} but "
                f"model.moe_experts = {c.moe_experts}; set model.moe_experts={experts}"
            ]
        if not experts:
            return []
        out = []
        want = {  # config.json key: (its value, ours, the raysc key)
            "num_experts": (experts, c.moe_experts, "model.moe_experts"),  # or num_local_experts
            "num_experts_per_tok": (hf.get("num_experts_per_tok"), c.moe_top_k, "model.moe_top_k"),
            "moe_intermediate_size": (hf.get("moe_intermediate_size"), c.moe_hidden_dim, "model.moe_ffn_dim"),
            "norm_topk_prob": (hf.get("norm_topk_prob"), c.moe_norm_topk_prob, "model.moe_norm_topk_prob"),
            "decoder_sparse_step": (hf.get("decoder_sparse_step"), c.moe_every_n_layers, "model.moe_every_n_layers"),
        }
        for key, (theirs, ours, ours_key) in want.items():
            if theirs is not None and theirs != ours:
                value = str(theirs).lower() if isinstance(theirs, bool) else theirs
                out.append(f"config.json: {key} = {theirs} but {ours_key} = {ours}; set {ours_key}={value}")
        dense = sorted(hf.get("mlp_only_layers") or [])
        if dense != list(range(len(dense))):
            out.append(
                f"config.json: mlp_only_layers = {dense}; raysc's dense layers of a mixture of experts are the "
                f"first model.moe_first_dense_layers ones"
            )
        elif len(dense) != c.moe_first_dense_layers:
            out.append(
                f"config.json: mlp_only_layers = {dense} but model.moe_first_dense_layers = "
                f"{c.moe_first_dense_layers}; set model.moe_first_dense_layers={len(dense)}"
            )
        if c.moe_shared_experts or c.moe_score_func != "softmax":
            out.append(
                f"config.json: {hf.get('model_type')} routes by softmax with no shared expert but model.moe_score_func"
                f" = {c.moe_score_func!r}, model.moe_shared_experts = {c.moe_shared_experts}; set "
                f"model.moe_score_func=softmax and model.moe_shared_experts=0"
            )
        return out

    def _mup_problems(self) -> list[str]:
        c = self.cfg
        if not c.mup:
            return []
        m = c.mup_width_mult
        if c.tie_embeddings and m != 1.0:
            return [
                f"model.mup with tie_embeddings and width multiplier {m:g}: the checkpoint's tied embedding "
                f"cannot take back the 1/m logit multiplier without changing the input side; set model.mup=false "
                f"(continue in the standard parametrisation the checkpoint is in)"
            ]
        bad = [f"sqrt(head_dim) = {math.sqrt(c.head_dim):g}"] if not _power_of_two(math.sqrt(c.head_dim)) else []
        if not c.tie_embeddings and not _power_of_two(m):
            bad.append(f"the width multiplier m = {m:g}")
        if bad:
            return [
                f"model.mup: the checkpoint has μP's scales folded into q_proj (1/sqrt(head_dim)) and lm_head "
                f"(1/m); multiplying them back out is exact only for powers of two, and {' and '.join(bad)} "
                f"is not; set model.mup=false to continue in the standard parametrisation the checkpoint is "
                f"in, or use a head_dim that is a power of 4 and a model.mup_base_width with dim/base a power of 2"
            ]
        return []

    def problems(self, expected: list[tuple[str, torch.Size, torch.dtype]]) -> list[str]:
        """Every difference between the checkpoint and the model of ``expected`` (``init_order``)."""
        out = self._config_problems() + self._moe_problems() + self._mup_problems() + self.layout_problems
        want = {name: tuple(shape) for name, shape, _ in expected}
        for name, shape in want.items():
            if name not in self.names:
                where = INDEX if (self.dir / INDEX).is_file() else WEIGHTS
                hint = (
                    " (config.json says the embeddings are tied; set model.tie_embeddings=true)"
                    if (name == "output.weight" and self.tied)
                    else ""
                )
                out.append(f"missing tensor {_expected_hf_name(name)} ({name}): not in {where}{hint}")
                continue
            got = self.shape(name)
            src = self.sources[name]
            if src.stacked:
                odd = [
                    t for t in src.tensors[1:] if self._slice(t).get_shape() != self._slice(src.tensors[0]).get_shape()
                ]
                if odd:
                    out.append(f"{name}: expert tensors of different shapes ({src.tensors[0]} against {odd[0]})")
            if got != shape:
                out.append(
                    f"tensor {self.names[name]} ({name}): checkpoint shape {list(got)}, the config's "
                    f"model needs {list(shape)}"
                )
        extra = [
            hf
            for ours, hf in self.names.items()
            if ours not in want and not (ours == "output.weight" and self.cfg.tie_embeddings and self.tied)
        ]
        extra += self.unexpected
        if extra:
            out.append(
                f"{len(extra)} tensor(s) the config's model has no place for: {', '.join(sorted(extra)[:5])}"
                f"{', ...' if len(extra) > 5 else ''}"
            )
        return out

    def check(self, expected: list[tuple[str, torch.Size, torch.dtype]]) -> None:
        """Raise ``CheckpointMismatch`` listing every problem (before any weight is read)."""
        found = self.problems(expected)
        if found:
            shown = found[:MAX_LISTED] + (
                [f"... and {len(found) - MAX_LISTED} more"] if len(found) > MAX_LISTED else []
            )
            raise CheckpointMismatch(
                f"model.init_from {str(self.dir)!r} does not fit the [model] config:\n  - " + "\n  - ".join(shown)
            )

    @torch.no_grad()
    def read(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The block of parameter ``name`` starting at ``offset`` with ``shape``, as ``dtype`` (μP unfolded)."""
        if 0 in shape:
            return torch.empty(shape, dtype=dtype)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        src = self.sources[name]
        if src.stacked:  # one tensor per expert: this block's experts, each sliced alike
            block = torch.stack([self._slice(t)[index[1:]] for t in src.tensors[index[0]]]).to(dtype)
        else:
            if src.part is not None:
                start = src.part[0]
                index = (index[0], slice(index[1].start + start, index[1].stop + start), *index[2:])
            block = self._slice(src.tensors[0])[index].to(dtype)
        scale = self._scale(name)
        return block if scale == 1.0 else block.mul_(scale)

    def copy_into(self, name: str, local: torch.Tensor, offset: tuple[int, ...]) -> None:
        """Fill ``local`` (the block of ``name`` at ``offset``) in row blocks of at most ``CHUNK_ELEMS``."""
        shape = tuple(local.shape)
        rows = max(1, CHUNK_ELEMS // max(1, math.prod(shape[1:])))
        for start in range(0, shape[0], rows):
            n = min(rows, shape[0] - start)
            part = self.read(name, (offset[0] + start, *offset[1:]), (n, *shape[1:]), local.dtype)
            local[start : start + n].copy_(part)


def _expected_hf_name(name: str) -> str:
    """The checkpoint key a missing raysc parameter was looked for under (both layouts for experts)."""
    parts = name.split(".")
    if len(parts) == 5 and parts[2:4] == ["mlp", "experts"]:
        fused = next(k for k, ws in FUSED_EXPERTS.items() if parts[4] in ws)
        prefix = f"model.layers.{parts[1]}.mlp.experts"
        return f"{prefix}.{{0..E-1}}.{EXPERT_PROJ[parts[4]]}.weight or {prefix}.{fused}"
    return hf_name(name)


def check_init_from(directory: str | Path, cfg: ModelConfig) -> dict:
    """Check the checkpoint in ``directory`` against ``cfg`` (headers only, no weights read) and
    describe it: tensor count, bytes of weights, tokenizer when present."""
    with torch.device("meta"):
        expected = [(n, p.shape, p.dtype) for n, p in Llama(cfg, 1).named_parameters()]
    ckpt = HFCheckpoint(directory, cfg)
    ckpt.check(expected)
    d = Path(directory)
    return {
        "tensors": len(expected),
        "bytes": sum((d / f).stat().st_size for f in set(ckpt.files.values())),
        "tokenizer": str(d / TOKENIZER) if (d / TOKENIZER).is_file() else None,
    }
