"""Reshard on load: a checkpoint written under one layout resumes under another with the same loss.

Every run here trains on a Megatron indexed dataset written by megatron-core's own
``IndexedDatasetBuilder`` (the bundled corpus, tokenized, one ``--append-eod`` end token per
document): so a corpus tokenized for Megatron trains in raysc and resumes exactly at a new DP size
(``test_dp_shard_2_to_4_to_1``) and under every other change of layout here."""

from __future__ import annotations

import pytest

from raysc.fleet.parity import layout_overrides
from raysc.fleet.records import read_jsonl
from test_parallel import PARITY

STEPS = 12


@pytest.fixture(scope="module")
def reshard_env(ray_session, tmp_path_factory, cache_dir):
    from raysc.config import load_config
    from raysc.fleet.driver import train

    work = tmp_path_factory.mktemp("reshard")
    base = [
        *PARITY,
        f'data.cache_dir="{cache_dir}"',
        f"train.steps={STEPS}",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=5",
    ]
    base += _megatron_corpus(load_config(None, base), work / "megatron")

    def run(name: str, layout: str, resume: str | bool = False) -> dict[int, dict]:
        cfg = load_config(None, [*base, *layout_overrides(layout), f'run.dir="{work / name}"'])
        train(cfg, resume=resume, progress=False)
        return {m["step"]: m for m in read_jsonl(work / name / "metrics.jsonl")}

    reference = run("reference", "")
    return work, run, reference


def _megatron_corpus(cfg, root) -> list[str]:
    """The bundled corpus as megatron-core writes it (``IndexedDatasetBuilder``, uint16, the
    tokenizer's EOS after each document); the ``data.*`` settings that train on it."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from raysc.data.corpus import build_bundled_corpus, read_documents
    from raysc.data.prepare import prepare_data, special_tokens
    from raysc.data.tokenizer import load_tokenizer

    _, tok_path, _ = prepare_data(cfg)  # raysc's tokenizer of the bundled corpus
    tok, eos = load_tokenizer(tok_path), special_tokens(cfg, tok_path).eos_id
    root.mkdir(parents=True)
    prefix = root / "bundled_text_document"
    builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=np.uint16)
    for doc in read_documents(build_bundled_corpus(cfg.data.cache_dir, cfg.data.max_corpus_mb)):
        ids = np.array(tok.encode(doc["text"]).ids + [eos], dtype=np.int64)
        builder.add_document(ids, [len(ids)])
    builder.finalize(str(prefix.with_suffix(".idx")))
    return [f'data.source="{prefix}"', f'data.tokenizer="{tok_path}"']


def _same(got: dict[int, dict], ref: dict[int, dict], steps: range) -> None:
    assert sorted(got) == list(steps)
    for s in steps:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4), s
        # the grad norm amplifies reduction order: after 4 steps under tp=2 its step-11 value is 1.07e-4 off the
        # single-process run's (deterministic here, the same at the commit before session 15 with today's
        # install); a checkpoint resharded wrongly is off by far more than 2e-4 from the first step on
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=2e-4), s


@pytest.mark.parametrize("before,after", [("tp=2", ""), ("pp=2", ""), ("", "pp=2"), ("tp=2,pp=2", "dp_shard=4")])
def test_checkpoint_resumes_under_another_layout(reshard_env, before, after):
    work, run, ref = reshard_env
    name = f"{before}->{after or 'single'}".replace("=", "").replace(",", "_")
    written_by = "reference"  # a single-process checkpoint is the reference run's own
    if before:
        written_by = f"{name}-a"
        run(written_by, before)
    got = run(f"{name}-b", after, resume=str(work / written_by / "checkpoints" / "step_00000004"))
    _same(got, ref, range(5, STEPS + 1))


def test_dp_shard_2_to_4_to_1(reshard_env):
    work, run, ref = reshard_env
    run("dp2", "dp_shard=2")
    got4 = run("dp4", "dp_shard=4", resume=str(work / "dp2" / "checkpoints" / "step_00000004"))
    _same(got4, ref, range(5, STEPS + 1))
    got1 = run("dp1", "", resume=str(work / "dp4" / "checkpoints" / "step_00000008"))
    _same(got1, ref, range(9, STEPS + 1))
    events = read_jsonl(work / "dp1" / "events.jsonl")
    resumed = [e for e in events if e["kind"] == "resumed"][0]
    assert resumed["from_layout"]["dp_shard"] == 4 and resumed["step"] == 8
    from raysc.data import megatron  # ... on the megatron-core corpus, every document of it

    ready = [e for e in events if e["kind"] == "data_ready"][0]
    assert ready["documents"] == len(megatron.read_documents(work / "megatron" / "bundled_text_document"))
