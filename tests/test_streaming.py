"""Token corpora read where they lie (issue 57): each rank reads its own rows from the files, by ranged
reads, on local disk or from an S3-compatible store; the run holds only a description of the files.

- the rows a ``RowSource`` reads are the rows the in-memory packing cut, file boundaries and mixed
  dtypes included, and its train / held-out split is ``split_rows``'s;
- the sample order (``raysc.data.order``) is a bijection per epoch, the same global batches at every
  data-parallel size and across a resume at another size, and a rank reads whole blocks: on the S3
  server at most one GET per MiB delivered and a read amplification of at most 2;
- what the supervisor ships to the ranks is a few KB whatever the corpus, and what it reads at start is
  headers and a bounded sample per file;
- a truncated shard and a file replaced under a run are refused, naming the file;
- a run on token files in the S3 server trains, is killed and heals from its checkpoint bit-exact, its
  metrics recording the step's data wait.
"""

from __future__ import annotations

import hashlib
import pickle
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from raysc.data.loader import BatchLoader
from raysc.data.order import SampleOrder, block_rows
from raysc.data.packing import pack_tokens, split_rows
from raysc.data.ranged import DataSourceError
from raysc.data.row_source import ShardRows, SplitRows
from raysc.data.streamed import HEADER_PROBE, SAMPLE_BYTES, packed_rows, token_rows

VOCAB = 512
SEQ = 64


def _stream(seed: int, tokens: int) -> np.ndarray:
    """Random ids below VOCAB with an EOS (id 0, raysc's tokenizer) every ~50 tokens."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, tokens).astype(np.uint16)
    ids[rng.random(tokens) < 0.02] = 0
    return ids


def _digest(batch: torch.Tensor) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()


def test_token_files_read_in_place_give_the_rows_packing_cuts_in_memory(tmp_path):
    stream = _stream(0, 400_000)
    np.save(tmp_path / "a.npy", stream[:250_001])  # numpy's format, a boundary inside a row
    stream[250_001:].astype(np.uint32).tofile(tmp_path / "b.npy")  # raw uint32 (OLMo's memmaps)
    rows, reader = token_rows([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], SEQ, np.dtype(np.uint32), VOCAB)
    ref = pack_tokens(stream.astype(np.uint32), SEQ)
    assert len(rows) == len(ref) and np.array_equal(np.asarray(rows), ref)
    picks = np.random.default_rng(1).integers(0, len(ref), 500)
    assert np.array_equal(rows[picks], ref[picks]) and np.array_equal(rows[7], ref[7])
    train, val = split_rows(ref, 0.05)
    assert np.array_equal(np.asarray(SplitRows(rows, 20, held=False)), train)
    assert np.array_equal(np.asarray(SplitRows(rows, 20, held=True)), val)
    # what the run learned at start: headers and a bounded sample per file, not the corpus
    assert reader.stats.bytes_fetched <= 2 * (HEADER_PROBE + SAMPLE_BYTES) < stream.nbytes
    assert len(pickle.dumps(SplitRows(rows, 20, held=False))) < 4096


def test_the_order_is_a_bijection_the_same_at_every_dp_size_and_across_a_resume(tmp_path):
    for n, g, b in [(1, 1, 1), (7, 8, 100), (1000, 4, 16), (12_345, 8, 7), (64 * 8 * 3 + 5, 8, 64)]:
        rows = SampleOrder(n, g, b, (3, 0)).rows(np.arange(n))
        assert np.array_equal(np.sort(rows), np.arange(n)), (n, g, b)
    assert not np.array_equal(SampleOrder(500, 8, 16, (3, 0)).rows(np.arange(500)), np.arange(500))
    assert not np.array_equal(
        SampleOrder(500, 8, 16, (3, 0)).rows(np.arange(500)), SampleOrder(500, 8, 16, (3, 1)).rows(np.arange(500))
    )

    stream = _stream(2, 200_000)
    np.save(tmp_path / "c.npy", stream)
    rows, _ = token_rows([str(tmp_path / "c.npy")], SEQ, np.dtype(np.uint16), VOCAB)

    def batches(dp: int, count: int, state: dict | None = None) -> list[str]:
        loaders = [BatchLoader(rows, 5, 8, r, dp, block=16) for r in range(dp)]
        for loader in loaders:
            if state:
                loader.load_state_dict(state)
        return [_digest(torch.cat([loader.next_batch() for loader in loaders])) for _ in range(count)]

    one = batches(1, 450)  # past an epoch: 3,076 rows, 8 a batch
    assert one[:40] == batches(2, 40) == batches(4, 40)
    two = [BatchLoader(rows, 5, 8, r, 2, block=16) for r in range(2)]
    for _ in range(25):
        [loader.next_batch() for loader in two]
    assert batches(4, 30, two[0].state_dict()) == one[25:55]  # resumed at dp 4 after 25 batches at dp 2


def test_s3_token_file_reads_are_whole_blocks_one_get_per_block(s3_server, tmp_path):
    """Rows of 65 uint16 tokens (130 B), 8 a batch, dp = 2, over two shuffle windows of a token file in the S3
    server, blocks of 127 rows (16 KiB: the 1 MiB of data.shuffle_block_kib scaled down so that a window
    is 1,016 rows): each rank fetches each of its blocks whole, once, in one GET, and uses all of it."""
    bucket = f"tok-{uuid.uuid4().hex[:8]}"
    s3_server["client"].create_bucket(Bucket=bucket)
    stream = _stream(3, 700_000)
    np.save(tmp_path / "big.npy", stream)
    s3_server["client"].upload_file(str(tmp_path / "big.npy"), bucket, "corpus/big.npy")
    options = {"endpoint_url": s3_server["endpoint"], "key": "testing", "secret": "testing-secret"}
    remote, _ = token_rows([f"s3://{bucket}/corpus/big.npy"], SEQ, np.dtype(np.uint16), VOCAB, options)
    local, _ = token_rows([str(tmp_path / "big.npy")], SEQ, np.dtype(np.uint16), VOCAB)
    block = block_rows(SEQ, 16)
    remote.read_unit = block  # (build_loader sets it from data.shuffle_block_kib)
    copies = [pickle.loads(pickle.dumps(remote)) for _ in range(2)]  # each rank reads for itself
    ranks = [BatchLoader(copies[r], 0, 8, r, 2, block=block) for r in range(2)]
    mirror = BatchLoader(local, 0, 8, 0, 1, block=block)
    for _ in range(2 * block):  # two whole windows of 8 blocks
        assert torch.equal(torch.cat([loader.next_batch() for loader in ranks]), mirror.next_batch())
    used = 2 * block * 4 * remote.row_bytes  # each rank's rows: 4 of every batch
    for copy in copies:
        stats = copy.reader.stats
        assert stats.requests == 8, stats  # 4 blocks a window, 2 windows
        assert stats.bytes_fetched <= used * 1.01, (stats, used)  # (+ a block's last row's shared token)


def test_a_truncated_shard_and_a_file_replaced_under_a_run_are_refused_by_name(tmp_path):
    shard = tmp_path / "packed" / "prose" / "shard-0.npy"
    shard.parent.mkdir(parents=True)
    np.save(shard, pack_tokens(_stream(4, 20_000), SEQ))
    index = {"format": "raysc-packed-v1", "seq_len": SEQ, "domains": {"prose": {"shards": ["prose/shard-0.npy"]}}}
    domains, _ = packed_rows(str(tmp_path / "packed"), index, SEQ, VOCAB)
    rows = domains["prose"]
    assert isinstance(rows, ShardRows) and len(rows) == (20_000 - 1) // SEQ
    before = rows[[3, 4, 100]]
    shard.write_bytes(shard.read_bytes() + b"\0" * 130)  # replaced: another size (and version)
    fresh = pickle.loads(pickle.dumps(rows))  # a rank's copy opens its own reader
    with pytest.raises(DataSourceError, match=r"shard-0\.npy changed since the run recorded it"):
        fresh[[3]]
    shard.write_bytes(shard.read_bytes()[: 128 + 100 * 130])  # truncated mid-file
    with pytest.raises(DataSourceError, match=r"shard-0\.npy is truncated: .* where its header needs"):
        packed_rows(str(tmp_path / "packed"), index, SEQ, VOCAB)
    assert before.shape == (3, SEQ + 1)


def test_a_run_on_token_files_in_s3_heals_a_kill_bit_exact_and_records_its_data_wait(
    ray_session, s3_server, make_cfg, tmp_path
):
    """``data.source`` = a ``.npy`` token file in the S3 server: a rank SIGKILLed at step 5 (after the
    checkpoint of step 4) is healed from it, and the run ends with the uninterrupted run's parameters bit
    for bit; what went to the ranks through Ray's object store is the description of the file."""
    from raysc.data.tokenizer import train_tokenizer
    from raysc.export.restore import load_run
    from raysc.fleet.driver import train
    from raysc.fleet.records import read_jsonl

    bucket = f"run-{uuid.uuid4().hex[:8]}"
    s3_server["client"].create_bucket(Bucket=bucket)
    np.save(tmp_path / "tokens.npy", _stream(5, 300_000))
    s3_server["client"].upload_file(str(tmp_path / "tokens.npy"), bucket, "tokens.npy")
    tok = tmp_path / "tokenizer.json"
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, VOCAB).save(str(tok))
    sets = [
        f'data.source="s3://{bucket}/tokens.npy"',
        f'data.tokenizer="{tok}"',
        f'data.storage_options={{endpoint_url = "{s3_server["endpoint"]}", key = "testing", '
        f'secret = "testing-secret"}}',
        "train.steps=8",
        "checkpoint.every_steps=4",
        "parallel.dp_replicate=2",
        "supervisor.restart_backoff_s=0.1",
    ]
    ref = make_cfg(*sets, run="ref")
    summary = train(ref, progress=False)
    ready = [e for e in read_jsonl(Path(ref.run_dir) / "events.jsonl") if e["kind"] == "data_ready"][0]
    assert ready["tokens"] == 300_000 and ready["documents"] is None
    metrics = read_jsonl(Path(ref.run_dir) / "metrics.jsonl")
    assert all(m["data_wait_s"] >= 0 for m in metrics) and len(metrics) == 8
    killed = make_cfg(*sets, 'supervisor.inject="kill@5:1/forward"', run="killed")
    healed = train(killed, progress=False)
    assert healed["restarts"] == 1 and summary["steps"] == healed["steps"] == 8
    a, b = (dict(load_run(c.run_dir).model.named_parameters()) for c in (ref, killed))
    assert all(torch.equal(a[k], b[k]) for k in a)
