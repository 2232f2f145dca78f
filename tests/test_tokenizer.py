"""Special tokens are data, read from the tokenizer's folder: real public tokenizers (llama.cpp's
vocabulary-only GGUF files of Llama 3, Llama 2, Qwen2 and GPT-2, from the llama-cpp-python sdist that
`make dev` extracts under .cache/llama-vocab) made into Hugging Face folders as those models ship them,
then packed, exported (Hugging Face and GGUF, read back by transformers and llama.cpp) and trained on.

The folders (tests/llama_vocab.py) are built by transformers from the GGUF files; their
tokenizer_config.json (and the post-processors that add Llama 3's and Llama 2's BOS) are written the way
each model's own repository has them. That
the vocabulary is the real one is checked against llama.cpp's expected token ids (.inp/.out files);
that the ids raysc reads are the right ones is checked against the GGUF's own metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from llama_vocab import BYTE_LEVEL, FOLDERS, expected_ids, gguf_file, metadata
from raysc.data.special_tokens import SpecialTokenError, read_special_tokens

# (BOS id or None, EOS id, adds BOS, PAD id or None) as the GGUF files' metadata and the repositories say
EXPECTED = {
    "llama-bpe": (128000, 128001, True, None),
    "llama-spm": (1, 2, True, None),
    "qwen2": (None, 151643, False, 151643),
    "gpt-2": (50256, 50256, False, None),
}
PRE = {"llama-bpe": "llama-bpe", "qwen2": "qwen2", "gpt-2": "gpt-2", "llama-spm": "default"}
DOCS = ["Hello world", "def f():\n    return 1", "Äpfel und Birnen 3333", " leading space"]


@pytest.mark.parametrize("name", BYTE_LEVEL)
def test_the_folders_hold_the_real_vocabularies(hf_folders, name):
    """Each byte-level folder's tokenizer.json encodes llama.cpp's 47 test texts to llama.cpp's expected
    ids. (Llama 2's SentencePiece vocabulary is used for its special tokens only: transformers' GGUF
    converter does not reproduce its whitespace handling, 15 of the 47 texts differ.)"""
    tok = Tokenizer.from_file(str(hf_folders[name] / "tokenizer.json"))
    cases = [(t, want) for t, want in expected_ids(name) if t]
    assert len(cases) >= 40
    wrong = [
        (t, want, tok.encode(t, add_special_tokens=False).ids)
        for t, want in cases
        if tok.encode(t, add_special_tokens=False).ids != want
    ]
    assert not wrong, wrong[:3]


@pytest.mark.parametrize("name", list(FOLDERS))
def test_special_tokens_come_from_the_folder_and_match_the_gguf_metadata(hf_folders, name):
    special = read_special_tokens(hf_folders[name] / "tokenizer.json")
    bos, eos, adds, pad = EXPECTED[name]
    assert (special.bos_id, special.eos_id, special.add_bos, special.pad_id) == (bos, eos, adds, pad)
    meta = {k.removeprefix("tokenizer.ggml."): v for k, v in metadata(gguf_file(name)).items()}
    assert str(special.eos_id) == meta["eos_token_id"]
    if special.bos_id is not None:
        assert str(special.bos_id) == meta["bos_token_id"]
    if "add_bos_token" in meta:
        assert str(special.add_bos).lower() == meta["add_bos_token"]
    assert special.stops[0] == eos


@pytest.mark.parametrize("name,eos", [("llama-bpe", 128001), ("llama-spm", 2), ("qwen2", 151643), ("gpt-2", 50256)])
def test_a_bare_tokenizer_json_falls_back_to_its_end_of_text_token(hf_folders, tmp_path, name, eos):
    bare = tmp_path / "tokenizer.json"
    bare.write_bytes((hf_folders[name] / "tokenizer.json").read_bytes())
    assert read_special_tokens(bare).eos_id == eos


@pytest.mark.parametrize("name", list(FOLDERS))
def test_packing_puts_eos_after_and_bos_before_every_document_exactly_once(hf_folders, name):
    from raysc.data.packing import encode_corpus

    tok = Tokenizer.from_file(str(hf_folders[name] / "tokenizer.json"))
    special = read_special_tokens(hf_folders[name] / "tokenizer.json", tok=tok)
    # a document that already starts with BOS (or ends with EOS) as text does not get a second one
    docs = DOCS + [(special.bos or "") + "already marked" + special.eos]
    stream = encode_corpus(docs, tok, tok.get_vocab_size(), special).astype(np.int64).tolist()
    expect: list[int] = []
    for d in docs:
        ids = tok.encode(d, add_special_tokens=False).ids
        ids = ids[1:] if special.add_bos and ids[:1] == [special.bos_id] else ids
        ids = ids[:-1] if ids[-1:] == [special.eos_id] else ids
        expect += ([special.bos_id] if special.add_bos else []) + ids + [special.eos_id]
    assert stream == expect
    if name == "llama-bpe":
        assert stream.count(128000) == stream.count(128001) == len(docs)
    plain = encode_corpus(DOCS, tok, tok.get_vocab_size(), special).astype(np.int64)
    assert int((plain == special.eos_id).sum()) == len(DOCS)
    ends = np.flatnonzero(plain == special.eos_id)
    if special.add_bos:  # BOS right after every EOS but the last, and first
        assert plain[0] == special.bos_id and (plain[ends[:-1] + 1] == special.bos_id).all()
        assert int((plain == special.bos_id).sum()) == len(DOCS)


def test_config_keys_override_the_folder_and_bad_ones_name_the_fix(hf_folders, tmp_path):
    path = hf_folders["llama-bpe"] / "tokenizer.json"
    eot = read_special_tokens(path, eos_token="<|eot_id|>", add_bos="false")
    assert (eot.eos, eot.eos_id, eot.add_bos) == ("<|eot_id|>", 128009, False)
    with pytest.raises(SpecialTokenError, match=r"data.eos_token names EOS '<\|nope\|>', which is not in"):
        read_special_tokens(path, eos_token="<|nope|>")
    # a tokenizer with no end-of-text token at all
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(SpecialTokenError, match="has no end-of-text token.*set data.eos_token"):
        read_special_tokens(tmp_path / "tokenizer.json")
    with pytest.raises(SpecialTokenError, match="no BOS token"):
        read_special_tokens(hf_folders["qwen2"] / "tokenizer.json", add_bos="true")


def test_a_tokenizer_larger_than_the_embedding_stops_before_ray(hf_folders, make_cfg):
    from raysc.fleet.driver import check_inputs

    cfg = make_cfg(f'data.tokenizer="{hf_folders["qwen2"] / "tokenizer.json"}"', "model.vocab_size=65536")
    with pytest.raises(
        ValueError, match=r"has 151936 tokens but model.vocab_size is 65536.*model.vocab_size >= 151936"
    ):
        check_inputs(cfg)


def _tiny_model(vocab: int):
    from raysc.config.schema import ModelConfig
    from raysc.model.llama import Llama

    return Llama(ModelConfig(vocab_size=vocab, dim=64, n_layers=1, n_heads=2, n_kv_heads=1), 64)


def test_hugging_face_export_carries_the_source_ids_and_files(hf_folders, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from raysc.export.hf import export_hf

    src = hf_folders["llama-bpe"]
    special = read_special_tokens(src / "tokenizer.json")
    out = export_hf(_tiny_model(128256), src / "tokenizer.json", tmp_path / "export", special=special)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (128000, 128001)
    assert GenerationConfig.from_pretrained(out).eos_token_id == 128001
    assert (out / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id) == (128000, 128001)
    assert tok("Hello").input_ids[0] == 128000  # the export's tokenizer adds BOS as the source's does


@pytest.mark.parametrize("name", [*BYTE_LEVEL, "llama-spm"])
def test_gguf_export_names_the_pre_tokenizer_and_llama_cpp_tokenizes_as_llama_cpp_expects(hf_folders, tmp_path, name):
    """The GGUF export's vocabulary, read by llama.cpp, tokenizes every text of llama.cpp's own test file
    for that vocabulary into the ids llama.cpp expects; Llama 2's (SentencePiece) with scores raysc
    derives from tokenizer.json's merge ranks."""
    import llama_cpp

    from raysc.export.gguf import export_gguf

    src = hf_folders[name] / "tokenizer.json"
    special = read_special_tokens(src)
    vocab = Tokenizer.from_file(str(src)).get_vocab_size()
    path = export_gguf(_tiny_model(vocab), src, tmp_path / f"{name}.gguf", special=special)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    meta = llm.metadata
    assert meta["tokenizer.ggml.pre"] == PRE[name]
    assert meta["tokenizer.ggml.model"] == ("gpt2" if name in BYTE_LEVEL else "llama")
    assert meta["tokenizer.ggml.eos_token_id"] == str(special.eos_id)
    assert meta["tokenizer.ggml.add_bos_token"] == str(special.add_bos).lower()
    assert llm.token_eos() == special.eos_id
    wrong = [
        (t, want)
        for t, want in expected_ids(name)
        if t and llm.tokenize(t.encode(), add_bos=False, special=False) != want
    ]
    assert not wrong, wrong[:3]


def test_gguf_export_refuses_a_tokenizer_it_cannot_write_with_the_way_out(hf_folders, tmp_path):
    from raysc.export.gguf import export_gguf

    spec = json.loads((hf_folders["gpt-2"] / "tokenizer.json").read_text(encoding="utf-8"))
    spec["model"]["type"] = "WordPiece"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="not 'WordPiece'.*convert_hf_to_gguf.py"):
        export_gguf(
            _tiny_model(50257),
            tmp_path / "tokenizer.json",
            tmp_path / "wp.gguf",
            special=read_special_tokens(hf_folders["gpt-2"] / "tokenizer.json"),
        )
    assert not (tmp_path / "wp.gguf").exists()


def test_a_run_trains_on_llama_3s_tokenizer_and_its_export_keeps_the_ids(ray_session, hf_folders, make_cfg):
    """``data.tokenizer`` pointing into a Hugging Face folder: the rows begin documents with
    <|begin_of_text|> and end them with <|end_of_text|>; the run directory keeps the folder's files and
    the special tokens; ``raysc export`` and generation use them."""
    from raysc.cli import main
    from raysc.data.prepare import prepare_data
    from raysc.data.special_tokens import run_special_tokens
    from raysc.export.restore import sample_text
    from raysc.fleet.driver import train

    src = hf_folders["llama-bpe"]
    cfg = make_cfg(
        f'data.tokenizer="{src / "tokenizer.json"}"',
        "model.vocab_size=128256",
        "train.steps=2",
        "model.tie_embeddings=true",
    )
    packed = prepare_data(cfg)[0]
    rows = np.concatenate([packed.train, packed.val]).astype(np.int64)
    assert rows[0, 0] == 128000  # the corpus's first document begins with BOS
    stream = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])  # rows share their boundary token
    ends = np.flatnonzero(stream == 128001)
    assert len(ends) > 10 and (stream[ends[ends + 1 < len(stream)] + 1] == 128000).all()
    assert (stream == 128000).sum() in (len(ends), len(ends) + 1)  # one BOS per document

    summary = train(cfg, progress=False)
    run_dir = Path(cfg.run.dir)
    assert summary["steps"] == 2
    special = run_special_tokens(run_dir)
    assert (special.bos_id, special.eos_id, special.add_bos) == (128000, 128001, True)
    assert (run_dir / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    out = run_dir / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (128000, 128001, 128256)
    assert sample_text(run_dir, "Hello", 4, 0.0, 0, 0).startswith("Hello")


def test_raysc_pack_with_llama_3s_tokenizer_begins_and_ends_every_document(
    ray_session, packed_corpus, hf_folders, tmp_path
):
    """`raysc pack` with a public tokenizer: its index records the special tokens, and in every shard each
    document starts with <|begin_of_text|> right after the previous one's <|end_of_text|>."""
    from raysc.curate.pack import pack_curated

    index = pack_curated(
        str(packed_corpus["root"] / "cur"),
        str(hf_folders["llama-bpe"] / "tokenizer.json"),
        128256,
        64,
        str(tmp_path / "packed"),
        log=lambda *_: None,
    )
    assert index["eos"] == "<|end_of_text|>" and index["special_tokens"]["bos_id"] == 128000
    checked = 0
    for meta in index["domains"].values():
        for shard in meta["shards"]:
            rows = np.load(tmp_path / "packed" / shard).astype(np.int64)
            stream = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])  # rows share their boundary token
            starts = np.load(tmp_path / "packed" / shard.replace(".npy", ".starts.npy"))
            assert (stream[starts] == 128000).all() and (stream[starts[1:] - 1] == 128001).all()
            assert (stream == 128000).sum() == len(starts)  # one BOS per document, none elsewhere
            checked += len(starts)
    assert checked > 50
