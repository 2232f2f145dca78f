"""Document masking (``train.document_mask``): packed documents do not see each other.

A block-causal forward over a packed row equals each document's own forward (positions continuing
along the row, or restarting per document with ``train.document_positions``); the document ids come
from the EOS tokens the run packed with, and a run through Ray masks at that token. Parity of every
parallel layout with masking on is in tests/test_parallel.py (``DOC_CASES``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raysc.config import load_config
from raysc.config.checks import ConfigError
from raysc.model.documents import (
    BLOCK,
    QueryBlocks,
    block_causal_mask,
    document_ids,
    document_mask,
    positions_in_document,
)
from raysc.model.llama import build_model

SMALL = ["model.vocab_size=300", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"]


def test_document_ids_count_the_eos_tokens_before_each_position():
    eos = 9
    rows = torch.tensor(
        [
            [1, 2, 9, 3, 9, 9, 4, 5],  # an EOS ends its own document; an empty one between two EOS
            [1, 2, 3, 4, 5, 6, 7, 8],  # one document fragment
            [9, 1, 2, 3, 4, 5, 6, 9],
        ]
    )  # begins at an EOS (the end of the previous row's document)
    assert document_ids(rows, eos).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8, [0, 1, 1, 1, 1, 1, 1, 1]]
    assert positions_in_document(document_ids(rows, eos)).tolist() == [
        [0, 1, 2, 0, 1, 0, 0, 1],
        list(range(8)),
        [0, 0, 1, 2, 3, 4, 5, 6],
    ]
    mask = block_causal_mask(document_ids(rows[:1], eos), torch.arange(8))
    assert mask.shape == (1, 1, 8, 8)
    assert mask[0, 0, 3].tolist() == [False, False, False, True, False, False, False, False]
    assert mask[0, 0, 7].tolist() == [False] * 6 + [True, True]
    # a subset of queries (a context-parallel rank's chunks) against the whole row
    assert block_causal_mask(document_ids(rows[:1], eos), torch.tensor([2, 7]))[0, 0].tolist() == [
        [True, True, True] + [False] * 5,
        [False] * 6 + [True, True],
    ]


def test_long_rows_attend_by_query_blocks_exactly_as_under_the_whole_mask():
    """Rows of several blocks take ``QueryBlocks`` (the keys a block may see, not the whole row): the same
    outputs and gradients as the whole mask; a batch without boundaries takes plain causal attention."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    seq = 2 * BLOCK + 88
    rows = torch.randint(1, 300, (3, seq))
    rows[0, [40, 300, 301, 555]] = 0  # a boundary inside a block, one at a block's end, two in a row
    rows[1, BLOCK - 1] = 0
    docs = document_ids(rows, 0)  # row 2: no boundary
    # a block's keys start at the earliest document start of its queries in any row of the batch
    assert [b[:3] for b in QueryBlocks(docs[:2]).blocks] == [
        (0, BLOCK, 0),
        (BLOCK, 2 * BLOCK, 41),
        (2 * BLOCK, seq, BLOCK),
    ]
    blocks = document_mask(docs, None)
    assert isinstance(blocks, QueryBlocks) and [b[2] for b in blocks.blocks] == [0, 0, 0]
    for part in (docs[:2], docs):  # keys skipped before the blocks' documents; a batch that skips none
        whole = block_causal_mask(part, torch.arange(seq))
        q, k, v = (torch.randn(len(part), 2, seq, 8, requires_grad=True) for _ in range(3))
        got = QueryBlocks(part).attend(q, k, v, None)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=whole)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
        g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert document_mask(docs[2:], None) is None  # no boundary: is_causal, the kernel's cheapest form
    assert document_mask(docs[:, :100], None).shape == (3, 1, 100, 100)  # short rows: the whole mask
    assert document_mask(docs[2:], torch.tensor([5, 9])).shape == (1, 1, 2, seq)  # a CP rank's queries


@pytest.mark.parametrize("restart", [False, True])
def test_a_masked_row_is_each_document_on_its_own(restart):
    cfg = load_config(None, SMALL)
    model = build_model(cfg.model, 64, seed=1)
    model.restart_positions = restart
    torch.manual_seed(0)
    rows = torch.randint(1, 300, (2, 24))
    rows[0, 5] = rows[0, 15] = rows[1, 10] = 0
    docs = document_ids(rows, 0)
    got = model(rows, documents=docs)
    plain = model(rows)
    for b in range(2):
        cuts = [0, *[i + 1 for i in range(24) if rows[b, i] == 0], 24]
        for start, end in zip(cuts, cuts[1:]):
            alone = model(rows[b : b + 1, start:end], positions=None if restart else torch.arange(start, end))
            torch.testing.assert_close(got[b, start:end], alone[0], rtol=1e-5, atol=1e-5)
            if start > 0:  # unmasked, a later document sees the ones before it
                assert (plain[b, start:end] - alone[0]).abs().max() > 1e-3
    torch.testing.assert_close(got[:, :6], plain[:, :6])  # the first document sees nothing else either way


def test_document_positions_need_the_mask_and_a_trainer_needs_the_eos():
    from raysc.train.trainer import Trainer

    with pytest.raises(ConfigError, match="train.document_mask=true too"):
        load_config(None, [*SMALL, "train.document_positions=true"])
    cfg = load_config(None, [*SMALL, "train.seq_len=16", "train.global_batch=2", "train.document_mask=true"])
    with pytest.raises(ValueError, match="EOS id"):
        Trainer(cfg, torch.zeros(4, 17, dtype=torch.int64).numpy(), None, measure_peak=False)


def test_a_run_masks_documents_at_the_eos_it_packed_with(ray_session, make_cfg):
    """Through Ray: the supervisor hands the ranks the EOS id of the run's tokenizer (here a newline,
    ``data.eos_token``, so that the first batch holds many documents), and the run's first loss is a
    masked Trainer's at that id, not an unmasked one's."""
    from raysc.data.prepare import prepare_data
    from raysc.fleet.driver import train
    from raysc.fleet.records import read_jsonl
    from raysc.train.trainer import Trainer

    cfg = make_cfg("train.steps=1", "train.document_mask=true", "train.document_positions=true", 'data.eos_token="Ċ"')
    train(cfg, progress=False)
    loss = [m for m in read_jsonl(Path(cfg.run.dir) / "metrics.jsonl") if m.get("step") == 1][0]["loss"]
    packed, _, info = prepare_data(cfg)
    eos = info["special_tokens"]["eos_id"]
    assert info["special_tokens"]["eos"] == "Ċ" and eos != 0  # not raysc's own <|endoftext|>
    masked = Trainer(cfg, packed.train, packed.val, measure_peak=False, eos_id=eos).train_step()["loss"]
    plain_cfg = make_cfg("train.steps=1", 'data.eos_token="Ċ"')
    plain = Trainer(plain_cfg, packed.train, packed.val, measure_peak=False).train_step()["loss"]
    assert loss == pytest.approx(masked, rel=1e-6)
    assert abs(masked - plain) > 1e-4, "the first batch holds no document boundary: the test shows nothing"
