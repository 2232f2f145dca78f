"""GGUF export, run by llama.cpp itself (``llama-cpp-python``): every type loads, llama.cpp tokenizes
like raysc, the F32 file continues prompts exactly as raysc does, Q8_0 keeps F32's perplexity.

One small model trained in this process serves the whole module; its files are written through
``raysc export --format gguf`` (the run directory's loading is ``load_run``'s own tests' concern)."""

from __future__ import annotations

import json
import math
import time
from contextlib import closing

import llama_cpp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TINY
from raysc.config import load_config
from raysc.data.prepare import prepare_data
from raysc.data.tokenizer import load_tokenizer
from raysc.export.restore import RunModel
from raysc.model.generate import generate
from raysc.train.trainer import Trainer

TYPES = ("f32", "f16", "q8_0", "q4_0")
STEPS = 150
SEQ = 128  # train.seq_len: the GGUF's context length
VAL_ROWS = 16
CALIB_TOKENS = 4096
# contractions, digit runs, repeated and trailing spaces, tabs, newlines before letters, non-ASCII:
# the places where pre-tokenizers differ (llama.cpp's "llama-bpe" splits digits in threes, "default"
# splits punctuation off)
PROMPTS = [
    "The history of the city",
    "def fibonacci(n):\n    return",
    "It's 12345 miles, isn't it?  They'll say   so",
    "\tindented\n\nnext paragraph ",
    "Once upon a time, there was",
    "naïve café — 3.14159 and 2,000,000",
    "In 1999 the committee's report",
    "x = [1, 2, 3]\nprint(x)",
]


@pytest.fixture(scope="module")
def exported(cache_dir, tmp_path_factory):
    """A model trained for STEPS steps, its held-out rows and its four GGUF files."""
    from raysc import cli
    from raysc.export import restore

    root = tmp_path_factory.mktemp("gguf")
    cfg = load_config(
        None,
        [
            *TINY,
            f'data.cache_dir="{cache_dir}"',
            f'run.dir="{root / "run"}"',
            f"train.seq_len={SEQ}",
            f"train.steps={STEPS}",
        ],
    )
    packed, tok_path, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, measure_peak=False)
    for _ in range(STEPS):
        trainer.train_step()
    model = trainer.model.eval()
    files = {}
    with pytest.MonkeyPatch.context() as mp:  # the CLI on this model instead of a checkpoint
        mp.setattr(restore, "load_run", lambda run_dir, step: RunModel(model, cfg, tok_path, "memory", STEPS))
        for t in TYPES:
            files[t] = root / f"model-{t}.gguf"
            assert cli.main(["export", str(root / "run"), "--format", "gguf", "--type", t, "--out", str(files[t])]) == 0
        files["q4_0-gptq"] = root / "model-q4_0-gptq.gguf"
        assert (
            cli.main(
                [
                    "export",
                    str(root / "run"),
                    "--format",
                    "gguf",
                    "--type",
                    "q4_0",
                    "--method",
                    "gptq",
                    "--calib-tokens",
                    str(CALIB_TOKENS),
                    "--out",
                    str(files["q4_0-gptq"]),
                ]
            )
            == 0
        )
    return model, tok_path, packed.val[:VAL_ROWS], files


def _llama(path, f32_cache: bool = False):
    kv = {"type_k": 0, "type_v": 0} if f32_cache else {}  # GGML_TYPE_F32: no F16 rounding in the KV cache
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=SEQ, n_batch=SEQ, n_threads=2, logits_all=True, seed=0, verbose=False, **kv
    )


def _nll(llm, row: np.ndarray) -> float:
    """Summed negative log-likelihood of row[1:] given its prefix, by llama.cpp."""
    llm.reset()
    llm.eval(row[:-1].tolist())
    logits = torch.from_numpy(np.array(llm.scores[: len(row) - 1], dtype=np.float32))
    return F.cross_entropy(logits, torch.from_numpy(row[1:].astype(np.int64)), reduction="sum").item()


def test_every_type_loads_and_tokenizes_like_raysc(exported):
    model, tok_path, _, files = exported
    tok = load_tokenizer(tok_path)
    sizes = {}
    for t in TYPES:
        with closing(_llama(files[t])) as llm:
            _check_loaded(llm, model, tok)
        sizes[t] = files[t].stat().st_size
    assert sizes["f32"] > sizes["f16"] > sizes["q8_0"] > sizes["q4_0"]


def _check_loaded(llm, model, tok) -> None:
    assert llm.n_vocab() == model.cfg.vocab_size
    assert llm.metadata["general.architecture"] == "llama"
    assert llm.metadata["tokenizer.ggml.pre"] == "gpt-2"
    for p in PROMPTS:
        ids = tok.encode(p).ids
        assert llm.tokenize(p.encode(), add_bos=False, special=False) == ids, p
        assert llm.detokenize(ids).decode() == p
    assert llm.token_eos() == 0 and llm.token_bos() == 0


def test_f32_greedy_continuation_equals_raysc(exported):
    model, tok_path, _, files = exported
    tok = load_tokenizer(tok_path)
    with closing(_llama(files["f32"], f32_cache=True)) as llm:
        for p in PROMPTS:
            ids = tok.encode(p).ids
            llm.reset()
            llm.eval(ids)
            with torch.no_grad():  # the logits themselves, not only their argmax
                logits = model(torch.tensor([ids]))[0]
            assert np.abs(llm.scores[: len(ids)] - logits.numpy()).max() < 1e-4, p
            theirs = []
            for _ in range(32):
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                theirs.append(nxt)
                llm.eval([nxt])
            assert theirs == generate(model, ids, 32), p


def test_q8_0_perplexity_within_1pct_of_f32(exported, capsys):
    """On held-out rows raysc never trained on: llama.cpp's F32 perplexity is raysc's own, Q8_0's is
    within 1% of it (the figures for docs/serving.md are printed)."""
    model, _, val, files = exported
    tokens = val.shape[0] * (val.shape[1] - 1)
    with torch.no_grad():
        x = torch.from_numpy(val.astype(np.int64))
        ours = math.exp(F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).item())
    ppl = {}
    for t in TYPES:
        with closing(_llama(files[t], f32_cache=t == "f32")) as llm:
            start = time.perf_counter()
            ppl[t] = math.exp(sum(_nll(llm, row) for row in val) / tokens)
            ppl[t + "_s"] = time.perf_counter() - start
    with capsys.disabled():
        print(
            "\nGGUF perplexity on",
            tokens,
            "held-out tokens:",
            json.dumps(
                {
                    "raysc": round(ours, 4),
                    **{k: round(v, 4) for k, v in ppl.items()},
                    **{f"{t}_bytes": files[t].stat().st_size for t in TYPES},
                }
            ),
        )
    assert abs(ppl["f32"] / ours - 1) < 1e-3
    assert abs(ppl["q8_0"] / ppl["f32"] - 1) < 0.01
    assert ppl["q4_0"] > ppl["q8_0"]


def test_q4_0_gptq_beats_llama_cpp_q4_0(exported, tmp_path, capsys):
    """GPTQ's roundings on the Q4_0 grid against llama.cpp's own Q4_0 of the F32 file
    (``llama_model_quantize``), both run by llama.cpp on the same held-out rows."""
    _, _, val, files = exported
    theirs = tmp_path / "llama-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(files["f32"]).encode(), str(theirs).encode(), params) == 0
    tokens = val.shape[0] * (val.shape[1] - 1)
    ppl = {}
    for name, path in (
        ("llama.cpp q4_0", theirs),
        ("raysc q4_0 rtn", files["q4_0"]),
        ("raysc q4_0 gptq", files["q4_0-gptq"]),
    ):
        with closing(_llama(path)) as llm:
            ppl[name] = math.exp(sum(_nll(llm, row) for row in val) / tokens)
    with capsys.disabled():
        print(
            "\nQ4_0 perplexity:",
            json.dumps({k: round(v, 4) for k, v in ppl.items()}),
            "bytes:",
            theirs.stat().st_size,
            files["q4_0-gptq"].stat().st_size,
        )
    assert ppl["raysc q4_0 gptq"] < ppl["llama.cpp q4_0"]
