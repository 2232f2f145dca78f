"""Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) both ways, against an independent reader and
writer, megatron-core's own ``IndexedDataset`` / ``IndexedDatasetBuilder``: raysc reads what megatron-core
writes (documents of several sequences, with and without ``--append-eod``'s end token) token for token,
megatron-core reads what raysc writes, and ``data.source`` = a prefix trains on it with the tokenizer's
EOS after every document exactly once; damaged files and a dataset of another tokenizer are refused by
name; a prefix in an object store reads as one on local disk. OLMo / Dolma token files (raw or numpy-format
``.npy``) train the same way."""

from __future__ import annotations

import numpy as np
import pytest

from raysc.data import megatron
from raysc.data.prepare import prepare_data

VOCAB = 512
EOS = 0  # raysc's own tokenizer ends documents with id 0


def _documents(seed: int, n: int, eod: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, VOCAB, size=int(rng.integers(5, 200))) for _ in range(n)]
    return [np.append(d, EOS) if eod else d for d in docs]


def test_raysc_reads_what_megatron_core_writes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = _documents(0, 40, eod=True)
    prefix = tmp_path / "mc_text_document"
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=np.uint16)
    for d in docs:  # a document as two sequences (Megatron's sentence splitting), then as one
        half = len(d) // 2
        builder.add_document(d.astype(np.int64), [half, len(d) - half])
    builder.finalize(str(prefix.with_suffix(".idx")))
    dtype, lengths, _, documents = megatron.read_index(prefix)
    assert dtype == np.uint16 and len(lengths) == 80 and documents.tolist() == list(range(0, 81, 2))
    got = megatron.read_documents(prefix)
    assert len(got) == len(docs) and all(np.array_equal(a, b) for a, b in zip(got, docs))


def test_megatron_core_reads_what_raysc_writes(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for dtype in (np.uint16, np.int32):
        docs = _documents(1, 30, eod=False)
        prefix = tmp_path / f"raysc_{np.dtype(dtype).name}"
        megatron.write_indexed(prefix, docs, dtype)
        theirs = IndexedDataset(str(prefix))
        assert len(theirs) == len(docs) and theirs.index.dtype == dtype
        assert theirs.document_indices.tolist() == list(range(len(docs) + 1))
        assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))


def test_a_megatron_dataset_trains_with_one_eos_per_document_and_bad_ones_are_refused(make_cfg, tmp_path):
    from raysc.data.tokenizer import train_tokenizer

    tok = tmp_path / "tokenizer.json"
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, VOCAB).save(str(tok))
    # made without --append-eod (each document gets one EOS) and with it (read as it stands)
    for eod in (False, True):
        docs = _documents(2, 60, eod=eod)
        prefix = tmp_path / f"corpus{int(eod)}_text_document"
        megatron.write_indexed(prefix, docs, np.uint16)
        for source in (prefix, prefix.with_suffix(".bin"), prefix.with_suffix(".idx")):
            packed, tok_path, info = prepare_data(make_cfg(f'data.source="{source}"', f'data.tokenizer="{tok}"'))
            assert info["documents"] == 60 and tok_path == tok
        stream = np.concatenate([d if eod else np.append(d, EOS) for d in docs])
        rows = np.concatenate([packed.train, packed.val])
        assert int((stream == EOS).sum()) == 60 and info["tokens"] == len(stream)
        seq = packed.seq_len
        assert sorted(map(tuple, rows)) == sorted(
            tuple(stream[i * seq : i * seq + seq + 1]) for i in range((len(stream) - 1) // seq)
        )
    # a dataset that mixes both is refused, naming it: at start when the sampled ends show it...
    mixed = tmp_path / "mixed"
    megatron.write_indexed(
        mixed, [d if i % 2 else np.append(d, EOS) for i, d in enumerate(_documents(2, 59, eod=False))], np.uint16
    )
    with pytest.raises(ValueError, match=r"mixed.bin mixes documents that end with the end-of-document token"):
        prepare_data(make_cfg(f'data.source="{mixed}"', f'data.tokenizer="{tok}"'))
    # ... or when a rank reads the one unsampled document that breaks the rule
    odd = [d[:-1] for d in _documents(2, 60, eod=True)]
    odd[30] = np.append(odd[30], EOS)
    megatron.write_indexed(mixed, odd, np.uint16)
    packed, _, _ = prepare_data(make_cfg(f'data.source="{mixed}"', f'data.tokenizer="{tok}"'))
    with pytest.raises(ValueError, match=r"mixed.bin mixes documents with and without the end-of-document token"):
        np.asarray(packed.train), np.asarray(packed.val)
    with pytest.raises(
        ValueError, match="Megatron indexed dataset: token ids without their tokenizer; set data.tokenizer"
    ):
        prepare_data(make_cfg(f'data.source="{prefix}"'))
    big = tmp_path / "big"
    megatron.write_indexed(big, [np.array([5, VOCAB + 7, 0])], np.uint16)
    with pytest.raises(ValueError, match=f"holds token id {VOCAB + 7} but model.vocab_size is {VOCAB}"):
        prepare_data(make_cfg(f'data.source="{big}"', f'data.tokenizer="{tok}"'))
    cut = tmp_path / "cut"
    megatron.write_indexed(cut, docs, np.uint16)
    cut.with_suffix(".bin").write_bytes(cut.with_suffix(".bin").read_bytes()[:100])
    with pytest.raises(megatron.IndexedDatasetError, match=r"cut.bin is truncated: 50 tokens"):
        prepare_data(make_cfg(f'data.source="{cut}"', f'data.tokenizer="{tok}"'))
    cut.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01" * 25)
    with pytest.raises(megatron.IndexedDatasetError, match=r"cut.idx: version"):
        megatron.read_documents(cut)


def test_raysc_pack_format_megatron_is_read_by_megatron_core_and_trains_in_raysc(packed_corpus, make_cfg):
    """`raysc pack --format megatron` on the curated corpus: each domain's part files are Megatron
    datasets that megatron-core reads, a document per sequence ending with the tokenizer's EOS, holding
    the same tokens as the raysc-format shards of the same documents (those drop each block's tail);
    `data.source` = the output trains through the mixture loader's domains."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from raysc.curate.pack import pack_curated

    root, index = packed_corpus["root"], packed_corpus["index"]
    out = root / "megatron"
    meg = pack_curated(
        str(root / "cur"),
        str(root / "packed" / "tokenizer.json"),
        VOCAB,
        64,
        str(out),
        log=lambda *_: None,
        fmt="megatron",
    )
    assert meg["format"] == "megatron-indexed-v1" and set(meg["domains"]) == set(index["domains"])
    for name, d in meg["domains"].items():
        assert d["documents"] == index["domains"][name]["documents"]
        docs = [np.array(doc) for p in d["shards"] for doc in IndexedDataset(str(out / p))]  # copies: its mmap closes
        assert len(docs) == d["documents"] and all(doc[-1] == EOS and EOS not in doc[:-1] for doc in docs)
        for shard in index["domains"][name]["shards"]:  # raysc's shard-<h>.npy and megatron's part-<h>: same block
            rows = np.load(root / "packed" / shard)
            stream = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])
            part = shard.replace("shard-", "part-").removesuffix(".npy")
            theirs = np.concatenate([np.array(doc) for doc in IndexedDataset(str(out / part))])
            assert np.array_equal(theirs[: len(stream)], stream)
    packed, _, info = prepare_data(make_cfg(f'data.source="{out}"'))
    assert set(packed.train) == set(meg["domains"]) and info["documents"] == sum(
        d["documents"] for d in meg["domains"].values()
    )


def test_olmo_style_token_files_train_raw_or_with_numpy_headers(make_cfg, tmp_path):
    """OLMo / Dolma token files: raw uint16 memmaps (no header: the dtype from the vocabulary size, OLMo's
    rule) and numpy-format uint32 files in one directory, read in name order, documents separated by EOS;
    a raw file of another dtype and ids past the vocabulary are refused by name. The rows are read where the
    files lie (``raysc.data.row_source``): the same rows a stream packed in memory gives."""
    from raysc.data.tokenizer import train_tokenizer

    tok = tmp_path / "tokenizer.json"
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, VOCAB).save(str(tok))
    docs = _documents(3, 40, eod=True)
    stream = np.concatenate(docs)
    half = len(stream) // 2
    src = tmp_path / "olmo"
    src.mkdir()
    np.memmap(src / "part-0-00000.npy", mode="w+", dtype=np.uint16, shape=(half,))[:] = stream[:half]
    np.save(src / "part-1-00000.npy", stream[half:].astype(np.uint32))
    packed, _, info = prepare_data(make_cfg(f'data.source="{src}"', f'data.tokenizer="{tok}"'))
    # described, not read: the documents are not counted (that would read every token at every start)
    assert info["tokens"] == len(stream) and info["documents"] is None and info["streamed"]
    seq = packed.seq_len
    rows = np.concatenate([packed.train, packed.val])
    assert sorted(map(tuple, rows)) == sorted(
        tuple(stream[i * seq : i * seq + seq + 1]) for i in range((len(stream) - 1) // seq)
    )
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="odd.npy has 3 bytes, not a whole number of uint16 ids.*data.token_dtype"):
        prepare_data(make_cfg(f'data.source="{odd}"', f'data.tokenizer="{tok}"'))
    wide = tmp_path / "wide.npy"
    np.memmap(wide, mode="w+", dtype=np.uint32, shape=(4,))[:] = [7, 70000, 3, 0]
    with pytest.raises(
        ValueError, match=f"wide.npy holds token id 70000 but model.vocab_size is {VOCAB}.*set data.token_dtype"
    ):
        prepare_data(make_cfg(f'data.source="{wide}"', f'data.tokenizer="{tok}"', "data.token_dtype=uint32"))


def test_a_megatron_dataset_in_s3_is_read_in_place_as_on_local_disk(s3_server, tmp_path):
    """A prefix in the S3 server, made with and without --append-eod: its rows (EOS added as the rank reads
    where needed, the documents found from the .idx read in place) equal the stream megatron-core's own
    reader gives, through the loader's shuffled blocks and across a pickle (what a rank receives)."""
    import pickle
    import uuid

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from raysc.data.indexed_rows import DocumentRows, indexed_prefix, indexed_rows
    from raysc.data.packing import pack_tokens

    bucket = f"meg-{uuid.uuid4().hex[:8]}"
    s3_server["client"].create_bucket(Bucket=bucket)
    options = {"endpoint_url": s3_server["endpoint"], "key": "testing", "secret": "testing-secret"}
    for eod in (False, True):
        prefix = tmp_path / f"d{int(eod)}_text_document"
        megatron.write_indexed(prefix, _documents(7, 300, eod=eod), np.uint16)
        for suffix in (".bin", ".idx"):
            s3_server["client"].upload_file(str(prefix) + suffix, bucket, f"meg/{prefix.name}{suffix}")
        url = f"s3://{bucket}/meg/{prefix.name}"
        assert indexed_prefix(url + ".bin", options) == url and indexed_prefix(url + "x", options) is None
        rows, documents = indexed_rows([url], 32, EOS, VOCAB, options)
        assert documents == 300 and isinstance(rows, DocumentRows) != eod
        theirs = [np.array(d) for d in IndexedDataset(str(prefix))]
        want = pack_tokens(np.concatenate([d if eod else np.append(d, EOS) for d in theirs]), 32)
        rows.read_unit = 16
        rank = pickle.loads(pickle.dumps(rows))
        order = np.random.default_rng(0).permutation(len(want))
        for lo in range(0, len(want), 40):
            assert np.array_equal(rank[order[lo : lo + 40]], want[order[lo : lo + 40]])
