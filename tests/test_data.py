"""Bundled corpus, tokenizer, packing and the deterministic loader."""

import json

import numpy as np
import pytest

from raysc.data.corpus import build_bundled_corpus, corpus_meta, iter_documents, read_documents
from raysc.data.loader import BatchLoader
from raysc.data.packing import pack_tokens, split_rows
from raysc.data.prepare import prepare_data
from raysc.data.tokenizer import EOS, EOS_ID, load_tokenizer, sample_texts, train_tokenizer


def test_bundled_corpus_is_deterministic_with_both_domains(tmp_path):
    a = build_bundled_corpus(tmp_path / "a", 0.6)
    b = build_bundled_corpus(tmp_path / "b", 0.6)
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text().splitlines()]
    assert {d["domain"] for d in docs} == {"prose", "code"}
    assert all(set(d) == {"id", "text", "domain", "source"} for d in docs)
    assert len({d["id"] for d in docs}) == len(docs)
    meta = corpus_meta(a)
    assert meta["domains"]["code"]["bytes"] <= 0.3e6 + 200_000  # the cap allows one file of overshoot
    assert any(d["source"].startswith("pydoc_data.topics:") for d in docs)
    assert any("def " in d["text"] for d in docs if d["domain"] == "code")


def test_tokenizer_round_trip_and_determinism():
    texts = [d["text"] for d in iter_documents(0.4)]
    sample = sample_texts(texts, 0.3, seed=7)
    tok = train_tokenizer(sample, 512)
    assert tok.get_vocab_size() == 512 and tok.token_to_id(EOS) == EOS_ID
    assert train_tokenizer(sample_texts(texts, 0.3, seed=7), 512).to_str() == tok.to_str()
    for s in ["def f(x):\n    return x ** 2  # square\n", "Ünïcödé — naïve café ✓ 日本語", "\t\n  spaces  "]:
        assert tok.decode(tok.encode(s).ids) == s


def test_pack_and_split():
    stream = np.arange(101, dtype=np.uint16)
    rows = pack_tokens(stream, 10)
    assert rows.shape == (10, 11)
    assert (rows[1:, 0] == rows[:-1, -1]).all()  # rows share one boundary token
    train, val = split_rows(rows, 0.25)
    assert len(train) + len(val) == 10 and len(val) == 2
    with pytest.raises(ValueError, match="too few"):
        pack_tokens(np.arange(5, dtype=np.uint16), 10)


def test_loader_is_a_function_of_seed_and_cursor_not_dp_size():
    rows = np.arange(50 * 5).reshape(50, 5)
    single = BatchLoader(rows, seed=3, global_batch=8)
    batches = [single.next_batch() for _ in range(15)]  # crosses two epoch boundaries
    for dp in (2, 4):
        loaders = [BatchLoader(rows, seed=3, global_batch=8, dp_rank=r, dp_size=dp) for r in range(dp)]
        for b in batches:
            assert np.array_equal(np.concatenate([ld.next_batch() for ld in loaders]), b)
    resumed = BatchLoader(rows, seed=3, global_batch=8)
    resumed.load_state_dict({"cursor": 8 * 9, "seed": 3, "global_batch": 8})
    assert np.array_equal(resumed.next_batch(), batches[9])
    # every row appears exactly once per epoch
    first_epoch = BatchLoader(rows, seed=3, global_batch=10)
    seen = np.concatenate([first_epoch.next_batch()[:, 0] for _ in range(5)])
    assert sorted(seen.tolist()) == sorted(rows[:, 0].tolist())


def test_prepare_data_from_jsonl_and_bad_input(make_cfg, tmp_path):
    src = tmp_path / "docs.jsonl"
    docs = [{"text": d["text"]} for d in iter_documents(0.3)]
    src.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    packed, tok_path, info = prepare_data(make_cfg(f'data.source="{src}"'))
    assert info["documents"] == len(docs) and packed.train.shape[1] == 65
    assert load_tokenizer(tok_path).get_vocab_size() == 512
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: each record needs a string field 'text'"):
        list(read_documents(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(read_documents(tmp_path / "missing.jsonl"))


def test_a_compressed_jsonl_corpus_trains_like_the_plain_one_and_a_damaged_file_stops_it(make_cfg, tmp_path):
    """data.source as dumps ship: a directory of .jsonl, .jsonl.gz and .jsonl.zst files reads the same
    documents as the plain files, in name order, and its corpus hash follows every file (a changed .gz
    file is a new corpus, not a cached one); a truncated .zst file stops the run naming the file."""
    import gzip

    import zstandard

    from raysc.data.corpus import jsonl_files
    from raysc.data.special_tokens import RAYSC
    from raysc.data.text_cache import cache_key

    docs = [{"text": d["text"]} for d in iter_documents(0.3)]
    lines = [json.dumps(d).encode() + b"\n" for d in docs]
    third = len(lines) // 3
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    for i, part in enumerate([lines[:third], lines[third : 2 * third], lines[2 * third :]]):
        (plain / f"part-{i}.jsonl").write_bytes(b"".join(part))
    (packed / "part-0.jsonl").write_bytes(b"".join(lines[:third]))
    (packed / "part-1.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[third : 2 * third])))
    (packed / "part-2.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[2 * third :])))
    assert list(read_documents(packed)) == list(read_documents(plain)) == docs
    before = cache_key(jsonl_files(packed), "", "{}", RAYSC)
    (packed / "part-1.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[third : 2 * third - 1])))
    assert cache_key(jsonl_files(packed), "", "{}", RAYSC) != before
    cut = zstandard.ZstdCompressor().compress(b"".join(lines[2 * third :]))
    (packed / "part-2.jsonl.zst").write_bytes(cut[: len(cut) // 2])
    with pytest.raises(ValueError, match=r"part-2.jsonl.zst': corrupt or truncated zstd file .*fetch it again"):
        prepare_data(make_cfg(f'data.source="{packed}"'))
