"""Tokenizers raysc cannot use are refused by name, with the fix: a public Llama tokenizer (what
``--init-from`` reads from a Hugging Face checkpoint) ends documents with another token, and a
GPT-2-style one has ``<|endoftext|>`` at another id, while packing, export and generation use id 0."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from raysc.data.tokenizer import EOS, load_tokenizer


def _save(tmp_path, vocab: dict[str, int], specials: list[str]) -> str:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(specials)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_a_llama_3_tokenizer_is_refused_naming_its_end_token_and_the_fix(tmp_path):
    vocab = {"<unk>": 0, "hello": 1, "<|begin_of_text|>": 128000, "<|end_of_text|>": 128001}
    path = _save(tmp_path, vocab, ["<|begin_of_text|>", "<|end_of_text|>"])
    with pytest.raises(ValueError) as err:
        load_tokenizer(path)
    msg = str(err.value)
    assert path in msg and f"has no {EOS} token" in msg and "'<|end_of_text|>' (id 128001)" in msg
    assert "--init-from" in msg and "raysc export" in msg


def test_a_llama_2_tokenizer_names_its_end_token(tmp_path):
    path = _save(tmp_path, {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3}, ["<s>", "</s>"])
    with pytest.raises(ValueError, match=r"its end-of-text token is '</s>' \(id 2\)"):
        load_tokenizer(path)


def test_endoftext_at_another_id_is_refused(tmp_path):
    path = _save(tmp_path, {"!": 0, "hello": 1, EOS: 2}, [EOS])
    with pytest.raises(ValueError, match=rf"has {EOS.replace('|', '[|]')} at id 2, not 0"):
        load_tokenizer(path)


def test_endoftext_at_id_0_loads(tmp_path):
    path = _save(tmp_path, {EOS: 0, "<unk>": 1, "hello": 2}, [EOS])
    assert load_tokenizer(path).token_to_id(EOS) == 0
