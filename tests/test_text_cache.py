"""A plain-text data.source is tokenized once by Ray tasks into token files that ranks read in place
(raysc.data.text_cache): the same rows, in the same order, as packing it in memory gave; the process that
prepares the data tokenizes nothing and holds none of it; the cache is reused until a file changes."""

from __future__ import annotations

import gzip
import json
import pickle

import numpy as np
import pytest

from raysc.data import text_cache
from raysc.data.corpus import iter_documents, jsonl_files, read_documents
from raysc.data.loader import BatchLoader
from raysc.data.packing import encode_corpus, pack_tokens, split_rows
from raysc.data.prepare import prepare_data, special_tokens
from raysc.data.tokenizer import load_tokenizer


def _corpus(root):
    """A directory of one plain JSONL file (cut into several chunks below) and one gzipped one."""
    docs = [{"text": d["text"]} for d in iter_documents(0.3)]
    lines = [json.dumps(d) + "\n" for d in docs]
    root.mkdir()
    (root / "a.jsonl").write_text("".join(lines[: len(lines) // 2]) + "\n")  # a blank line too
    (root / "b.jsonl.gz").write_bytes(gzip.compress("".join(lines[len(lines) // 2 :]).encode()))
    return docs


def test_chunks_cut_at_line_ends_and_read_every_document_once(tmp_path):
    """Byte-range chunks of a plain JSONL file (lines longer than a chunk included) hold every document
    exactly once, in order; a compressed file is one chunk."""
    rng = np.random.default_rng(0)
    docs = [{"text": "x" * int(n)} for n in rng.integers(1, 3000, size=200)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"text": "zipped"}\n'))
    files = jsonl_files(tmp_path)
    cut = text_cache.chunks(files, 1000)
    assert len(cut) > 100 and cut[-1].end == -1
    texts = [t for c in cut for t in text_cache.chunk_texts(c)]
    assert texts == [d["text"] for d in read_documents(tmp_path)]


def test_a_bad_line_inside_a_later_chunk_names_the_files_own_line_number(tmp_path):
    lines = [json.dumps({"text": f"doc {i} " * 20}) for i in range(300)]
    lines[250] = '{"txt": "no text"}'
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    cut = text_cache.chunks(jsonl_files(tmp_path), 4096)
    with pytest.raises(ValueError, match=r"c.jsonl:251: each record needs a string field 'text'"):
        [text_cache.chunk_texts(c) for c in cut]


def test_ray_tasks_tokenize_a_plain_corpus_into_the_rows_and_order_of_packing_it_in_memory(
    ray_session, make_cfg, tmp_path, monkeypatch
):
    """Ray tasks (not this process: its encode_corpus refuses) tokenize the corpus, chunk by chunk, into
    files; the rows read from them and the loader's batches equal packing the corpus in memory (the data
    order every plain-text run had); what reaches the ranks is a description of a few KB. A second
    prepare reuses the cache without a task; a changed file is a new cache."""
    import raysc.data.packing as packing

    docs = _corpus(tmp_path / "corpus")
    monkeypatch.setattr(text_cache, "CHUNK_BYTES", 4 << 10)  # several tasks for the plain file
    cfg = make_cfg(f'data.source="{tmp_path / "corpus"}"', f'data.cache_dir="{tmp_path / "cache"}"')

    def refuse(*_a, **_k):
        raise AssertionError("the process preparing the data tokenized the corpus")

    with monkeypatch.context() as m:
        m.setattr(packing, "encode_corpus", refuse)
        packed, tok_path, info = prepare_data(cfg)
    parts = sorted((tmp_path / "cache" / "text" / info["key"]).glob("part-*.npy"))
    assert len(parts) > 4 and info["documents"] == len(docs)
    assert len(pickle.dumps(packed.train)) < 20_000 and not isinstance(packed.train, np.ndarray)

    tok = load_tokenizer(tok_path)
    stream = encode_corpus([d["text"] for d in docs], tok, tok.get_vocab_size(), special_tokens(cfg, tok_path))
    train, val = split_rows(pack_tokens(stream, cfg.train.seq_len), cfg.data.val_fraction)
    assert np.array_equal(np.asarray(packed.train), train) and np.array_equal(np.asarray(packed.val), val)
    in_memory, read = BatchLoader(train, 7, 8), BatchLoader(packed.train, 7, 8)
    for _ in range(2 * len(train) // 8 + 3):  # past an epoch's end
        assert np.array_equal(in_memory.next_batch(), read.next_batch())

    monkeypatch.setattr(text_cache, "_run", refuse)
    again = prepare_data(cfg)[2]
    assert again["key"] == info["key"]
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps(docs[0]) + "\n")
    with pytest.raises(AssertionError, match="tokenized"):  # a new cache: tasks asked for
        prepare_data(cfg)


def test_a_node_that_cannot_see_the_cache_gets_the_same_rows_through_the_object_store(make_cfg, tmp_path, monkeypatch):
    """A node-local data.cache_dir on a cluster of several machines: the rows travel in memory, the same
    rows in the same order; a corpus too large for that is refused, naming the fix."""
    _corpus(tmp_path / "corpus")
    cfg = make_cfg(f'data.source="{tmp_path / "corpus"}"', f'data.cache_dir="{tmp_path / "cache"}"')
    read, _, _ = prepare_data(cfg)
    monkeypatch.setattr(text_cache, "unseen_by", lambda path, timeout_s=60.0: ["another-node"])
    shipped, _, info = prepare_data(cfg)
    assert isinstance(shipped.train, np.ndarray) and not info["streamed"]
    assert np.array_equal(shipped.train, np.asarray(read.train)) and np.array_equal(shipped.val, np.asarray(read.val))
    import raysc.data.prepare as prepare

    monkeypatch.setattr(prepare, "SHIP_BYTES", 100_000)
    with pytest.raises(ValueError, match="other nodes of the cluster do not see.*set data.cache_dir to a path every"):
        prepare_data(cfg)


def test_a_parquet_source_reads_its_text_column_and_names_a_file_without_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i} " * (i + 1) for i in range(50)]
    pq.write_table(pa.table({"id": list(range(50)), "text": texts}), tmp_path / "docs.parquet", row_group_size=16)
    (tmp_path / "later.jsonl").write_text(json.dumps({"text": "after"}) + "\n")
    cut = text_cache.chunks(jsonl_files(tmp_path))
    assert [t for c in cut for t in text_cache.chunk_texts(c)] == [*texts, "after"]
    pq.write_table(pa.table({"body": texts}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other.parquet: a Parquet data.source needs a string column 'text'"):
        text_cache.chunk_texts(text_cache.chunks([tmp_path / "other.parquet"])[0])
