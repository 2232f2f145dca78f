"""Load a quantized folder in vLLM and generate greedily; compare with the same weights in torch.

``vllm_smoke(path)`` starts vLLM's offline engine (``vllm.LLM``, ``enforce_eager``; the caller sets
``VLLM_CPU_KVCACHE_SPACE`` and must call it under ``if __name__ == "__main__":``, since vLLM starts
worker processes; 4-bit folders need an AVX-512 CPU, see ``w4a16_supported``) and returns its greedy continuations of ``PROMPTS``, the continuations of the
folder's weights read back by ``writer.read_weights`` into the raysc model (int8 activations
simulated for W8A8), and how many tokens agree. ``python -m raysc.quantize.vllm_check DIR...``
prints that as JSON for each folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def w4a16_supported(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether vLLM's CPU build can run 4-bit (W4A16) weights here: its W4A16 kernel
    (``cpu_gemm_wna16``) is compiled into the AVX-512 library only, not the AVX2 one (vllm-cpu 0.32)."""
    try:
        return "avx512f" in Path(cpuinfo).read_text().split()
    except OSError:
        return False


PROMPTS = ["def main():\n    ", "import os\nimport sys\n\n", "class Config:\n    def __init__(self", "    return "]


def torch_greedy(path: str | Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """Greedy token ids from the folder's weights in the raysc model (what vLLM should compute)."""
    import torch

    from raysc.config.schema import ModelConfig
    from raysc.data.special_tokens import read_special_tokens
    from raysc.data.tokenizer import load_tokenizer
    from raysc.export.hf import hf_name
    from raysc.model.generate import generate
    from raysc.model.hf_checkpoint import family_settings
    from raysc.model.llama import Llama
    from raysc.quantize.quality import int8_activations
    from raysc.quantize.run import linear_names
    from raysc.quantize.writer import read_weights

    path = Path(path)
    c = json.loads((path / "config.json").read_text())
    cfg = ModelConfig(
        vocab_size=c["vocab_size"],
        dim=c["hidden_size"],
        n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"],
        n_kv_heads=c["num_key_value_heads"],
        ffn_dim=c["intermediate_size"],
        norm_eps=c["rms_norm_eps"],
        **family_settings(c),
        tie_embeddings=c["tie_word_embeddings"],
    )
    model = Llama(cfg, c["max_position_embeddings"]).eval()
    weights = read_weights(path)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[hf_name(n)])
    tok = load_tokenizer(path / "tokenizer.json")
    special = read_special_tokens(path / "tokenizer.json", tok=tok)  # the export's own files say its EOS
    w8a8 = c["quantization_config"]["format"] == "int-quantized"

    def ids(prompt: str) -> list[int]:
        return special.begin(tok.encode(prompt, add_special_tokens=False).ids)

    out = []
    for prompt in prompts:
        if w8a8:
            with int8_activations(model, linear_names(model)):
                out.append(generate(model, ids(prompt), max_tokens, stop_id=special.stops))
        else:
            out.append(generate(model, ids(prompt), max_tokens, stop_id=special.stops))
    return out


def check_runnable(path: str | Path, cpuinfo: str | Path = "/proc/cpuinfo") -> None:
    """Raise, naming the fix, when vLLM's CPU build on the CPU ``cpuinfo`` describes cannot run the
    quantized folder at ``path`` (before vLLM is started)."""
    quant = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    if quant["format"] == "pack-quantized" and not w4a16_supported(cpuinfo):
        raise RuntimeError(
            f"{path} holds 4-bit (W4A16) weights, which vLLM's CPU build runs only on CPUs with "
            f"AVX-512 (its AVX2 library has no W4A16 kernel); this CPU has none: check it on an "
            f"AVX-512 machine, or quantize with --method int8 (W8A8 runs on AVX2)"
        )


def vllm_smoke(path: str | Path, prompts: list[str] | None = None, max_tokens: int = 24) -> dict:
    """vLLM's greedy continuations of ``prompts`` from the folder at ``path``, torch's from the same
    weights, and the share of tokens on which they agree up to the first difference."""
    check_runnable(path)
    quant = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    from vllm import LLM, SamplingParams

    prompts = prompts or PROMPTS
    llm = LLM(model=str(path), enforce_eager=True, dtype="float32", max_model_len=128, seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    ours = torch_greedy(path, prompts, max_tokens)
    texts, agree, total = [], 0, 0
    for o, mine in zip(outs, ours):
        ids = list(o.outputs[0].token_ids)
        texts.append(o.outputs[0].text)
        same = 0
        for a, b in zip(ids, mine):
            if a != b:
                break
            same += 1
        agree += same
        total += max(len(ids), len(mine))
    return {"path": str(path), "format": quant["format"], "texts": texts, "prefix_agreement": agree / max(total, 1)}


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        print(json.dumps(vllm_smoke(folder)), flush=True)
