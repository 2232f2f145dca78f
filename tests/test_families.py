"""The public families round trip with their real vocabularies: Llama 3 (llama3 rope scaling, Llama 3's
byte-level BPE, BOS added), Llama 2 (its SentencePiece vocabulary, BOS added), Qwen2 (q/k/v biases,
Qwen2's vocabulary, no BOS) and Qwen3 (q/k norms, 64-wide heads on a 64-wide model of 2 heads).

For each: a tiny random-weight transformers model of the family with the real vocabulary size and the
tokenizer folder as the model ships it (tests/llama_vocab.py) -> ``model.init_from`` in raysc, whose
logits are transformers' (one process, and the first step's loss under ``dp_shard=2 × tp=2`` in 4 forked
gloo ranks equal to one process's) -> two training steps -> ``raysc export`` (config.json and
generation_config.json with the source's ids, the tokenizer files as they came) -> transformers loads
the export with raysc's logits -> vLLM (CPU, one engine after another in one process) serves it with
transformers' greedy tokens from the prompt ids the export's tokenizer makes (BOS where the family adds
one) -> the GGUF F32 export generates transformers' greedy tokens in llama.cpp."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from forked import run_forked
from greedy_check import forced_mismatches
from raysc.cluster.ports import free_port
from raysc.config import load_config
from raysc.data.special_tokens import read_special_tokens
from raysc.export.hf import export_hf
from raysc.fleet.parity import layout_overrides
from raysc.parallel.dims import build_mesh
from raysc.train.trainer import Trainer

HERE = Path(__file__).resolve().parent
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
BASE = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.norm_eps=1e-6",
    "model.max_seq_len=128",
    "train.seq_len=32",
    "train.global_batch=8",
    "train.seed=3",
]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# name: (transformers config class, vocabulary folder, vocabulary size, its config.json extras, raysc's keys)
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        "llama-bpe",
        128256,
        {"rope_parameters": LLAMA3_ROPE},
        [
            "model.rope_theta=500000.0",
            "model.rope_scaling=llama3",
            "model.rope_factor=4.0",
            "model.rope_original_max_position=16",
        ],
    ),
    "llama2": ("LlamaConfig", "llama-spm", 32000, {}, []),
    "qwen2": (
        "Qwen2Config",
        "qwen2",
        151936,
        {"use_sliding_window": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        ["model.attention_bias=true", "model.rope_theta=1000000.0"],
    ),
    "qwen3": (
        "Qwen3Config",
        "qwen2",
        151936,
        {"head_dim": 64, "use_sliding_window": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        ["model.qk_norm=true", "model.head_dim=64", "model.rope_theta=1000000.0"],
    ),
}
ADDS_BOS = {"llama3": 128000, "llama2": 1}
ROWS = np.random.default_rng(1).integers(0, 32000, size=(16, 33))
PROMPTS = ["Hello world", "def f(x):\n    return", "Äpfel und Birnen 3333"]
NEW = 8


def _overrides(name: str, source: Path) -> list[str]:
    return [*BASE, f"model.vocab_size={FAMILIES[name][2]}", *FAMILIES[name][4], f'model.init_from="{source}"']


def _source(name: str, vocab_folder: Path, out: Path):
    """A transformers model of family ``name`` with random weights (biases and q/k norms away from their
    zero / one init), saved with the tokenizer folder beside it; the model and the folder."""
    import transformers

    cls, _, vocab, extra, _ = FAMILIES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(vocab_size=vocab, **SHAPE, **extra))
    with torch.no_grad():
        for k, p in hf.named_parameters():
            if k.endswith(("_proj.bias", "q_norm.weight", "k_norm.weight")):
                p.normal_(1.0 if k.endswith("norm.weight") else 0.0, 0.3)
    hf.save_pretrained(out)
    for f in vocab_folder.iterdir():
        shutil.copy(f, out / f.name)
    return hf.eval(), out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-5 of ``b``'s largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item() <= 1e-5


@pytest.fixture(scope="module")
def families(hf_folders, tmp_path_factory) -> dict[str, dict]:
    """Per family: the source's step-0 logits check, the first loss in one process, the trained raysc
    model and its export."""
    root = tmp_path_factory.mktemp("families")
    ids = torch.from_numpy(ROWS[:2, :32])
    out = {}
    for name, (_, vocab_name, *_rest) in FAMILIES.items():
        hf, src = _source(name, hf_folders[vocab_name], root / f"{name}-hf")
        trainer = Trainer(load_config(None, _overrides(name, src)), ROWS, measure_peak=False)
        with torch.no_grad():
            theirs, ours = hf(ids).logits, trainer.model.eval()(ids)
        step0 = _close(ours, theirs)
        trainer.model.train()
        first = trainer.train_step()["loss"]
        trainer.train_step()
        model = trainer.model.eval()
        special = read_special_tokens(src / "tokenizer.json")
        export = export_hf(model, src / "tokenizer.json", root / f"{name}-export", special=special)
        out[name] = {
            "source": src,
            "step0_equal": step0,
            "first_loss": first,
            "model": model,
            "export": export,
            "special": special,
        }
    return out


def _rank(rank: int, port: int, cases: dict[str, tuple[str, float]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=120)
    )
    errors = []
    for name, (source, want) in cases.items():
        cfg = load_config(None, [*_overrides(name, Path(source)), *layout_overrides("dp_shard=2,tp=2")])
        trainer = Trainer(cfg, ROWS, rank=rank, mesh=build_mesh(cfg.parallel.dims, "cpu"), measure_peak=False)
        loss = trainer.train_step()["loss"]
        if abs(loss - want) > 1e-5 * want:
            errors.append(f"rank {rank} {name}: first loss {loss} under dp_shard=2 x tp=2, {want} in one process")
    dist.destroy_process_group()
    assert not errors, "\n".join(errors)


def test_each_family_imports_with_transformers_logits_under_fsdp_and_tp(families):
    assert {n: f["step0_equal"] for n, f in families.items()} == {n: True for n in FAMILIES}
    cases = {n: (str(f["source"]), f["first_loss"]) for n, f in families.items()}
    run_forked(_rank, (free_port(), cases), nprocs=4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_export_loads_in_transformers_and_llama_cpp_with_raysc_outputs(families, tmp_path, name):
    import llama_cpp
    import transformers

    from raysc.export.gguf import export_gguf
    from raysc.model.hf_names import ARCHITECTURES, model_type

    fam = families[name]
    config = json.loads((fam["export"] / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[model_type(fam["model"].cfg)]]
    assert config["eos_token_id"] == fam["special"].eos_id
    if name in ADDS_BOS:
        assert config["bos_token_id"] == ADDS_BOS[name]
    back = transformers.AutoModelForCausalLM.from_pretrained(fam["export"], dtype=torch.float32).eval()
    ids = torch.from_numpy(ROWS[:2, :32])
    with torch.no_grad():
        assert _close(back(ids).logits, fam["model"](ids))
    tok = transformers.AutoTokenizer.from_pretrained(fam["export"])
    prompts = [tok(p).input_ids for p in PROMPTS]
    bare = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    assert prompts == [[ADDS_BOS[name], *b] if name in ADDS_BOS else b for b in bare]  # BOS once, or never
    gguf = export_gguf(
        fam["model"], fam["export"] / "tokenizer.json", tmp_path / f"{name}.gguf", special=fam["special"]
    )
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=64, n_batch=64, logits_all=True, verbose=False)
    assert llm.metadata["general.architecture"] == {"qwen2": "qwen2", "qwen3": "qwen3"}.get(name, "llama")
    generated = []
    for p in PROMPTS:  # llama.cpp's own tokenizer, BOS as the GGUF says: the same ids as transformers'
        assert llm.tokenize(p.encode(), add_bos=True, special=False) == prompts[len(generated)]
        llm.reset()
        llm.eval(prompts[len(generated)])
        out = []
        for _ in range(NEW):
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([out[-1]])
        generated.append(out)
    assert not forced_mismatches(lambda x, back=back: back(x).logits[0], prompts, generated)


def test_vllm_serves_each_family_export_with_transformers_greedy_tokens(families):
    import transformers

    exports = [str(families[n]["export"]) for n in FAMILIES]
    run = subprocess.run(
        [sys.executable, str(HERE / "vllm_greedy.py"), json.dumps(PROMPTS), str(NEW), *exports],
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = {
        json.loads(line[7:])["path"]: json.loads(line[7:])
        for line in run.stdout.splitlines()
        if line.startswith("RESULT ")
    }
    assert run.returncode == 0 and len(results) == len(exports), run.stderr[-4000:]
    for name in FAMILIES:
        export = families[name]["export"]
        got = results[str(export)]
        tok = transformers.AutoTokenizer.from_pretrained(export)
        assert got["prompt_ids"] == [tok(p).input_ids for p in PROMPTS], name
        back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        assert all(len(ids) == NEW for ids in got["ids"]), name
        assert not forced_mismatches(lambda x, back=back: back(x).logits[0], got["prompt_ids"], got["ids"]), name
