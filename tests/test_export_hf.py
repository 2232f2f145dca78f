"""Hugging Face export: transformers loads it without custom code and computes the same logits."""

import json

import pytest
import torch
import transformers

from raysc.data.prepare import prepare_data
from raysc.export.hf import export_hf
from raysc.train.trainer import Trainer


@pytest.mark.parametrize("tie,mup", [(False, False), (True, False), (False, True)])
def test_export_loads_in_transformers_with_equal_logits(make_cfg, tmp_path, tie, mup):
    """μP (width multiplier 2 here) exports with its logit and attention scales folded into the weights."""
    extra = ["model.mup=true", "model.mup_base_width=32"] if mup else []
    cfg = make_cfg(f"model.tie_embeddings={'true' if tie else 'false'}", *extra)
    packed, tok_path, _ = prepare_data(cfg)
    trainer = Trainer(cfg, packed.train, measure_peak=False)
    for _ in range(3):  # move the weights away from their initialisation
        trainer.train_step()
    model = trainer.model.eval()
    out = export_hf(model, tok_path, tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is tie
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    return'
    ids = tok(prompt, return_tensors="pt").input_ids
    from raysc.data.tokenizer import load_tokenizer

    assert ids[0].tolist() == load_tokenizer(tok_path).encode(prompt).ids
    assert tok.eos_token_id == 0 and tok.decode(ids[0]) == prompt
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    # greedy continuations agree too
    gen = hf.generate(ids, max_new_tokens=8, do_sample=False)
    from raysc.model.generate import generate

    assert gen[0, ids.shape[1] :].tolist() == generate(model, ids[0].tolist(), 8)
