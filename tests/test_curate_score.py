"""Model-based quality scores (``raysc.curate.perplexity``, CCNet's recipe): the perplexity the actor
pool writes is the reference model's own, the per-domain percentile filter drops degraded text and
keeps what reads like the reference, and the settings fail early with the fix."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from conftest import TINY
from raysc.config import load_config
from raysc.config.checks import ConfigError
from raysc.curate.perplexity import document_perplexities, judge_perplexity


def test_document_perplexity_is_the_models_mean_next_token_loss():
    """Length-sorted, padded micro-batches give each document exactly its own unpadded score."""
    import torch
    import torch.nn.functional as F

    from raysc.config.schema import ModelConfig
    from raysc.curate import perplexity
    from raysc.data.tokenizer import EOS_ID
    from raysc.model.llama import build_model

    model = build_model(ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=2, n_kv_heads=1), 64, seed=0).eval()
    rng = random.Random(0)
    docs = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 40))] for _ in range(perplexity.MICRO_BATCH + 7)]
    docs.insert(5, [])
    got = document_perplexities(model, docs)
    assert math.isinf(got[5])
    for i, d in enumerate(docs):
        if not d:
            continue
        x = torch.tensor([[EOS_ID, *d[:-1]]])
        with torch.no_grad():
            want = math.exp(F.cross_entropy(model(x)[0], torch.tensor(d)).item())
        assert got[i] == pytest.approx(want, rel=1e-4), i


def test_the_perplexity_verdict_buckets_per_domain_and_keeps_rule_reasons():
    limits = {
        "prose": {"p33": 10.0, "p67": 20.0, "keep_at_or_below": 15.0},
        "code": {"p33": 3.0, "p67": 5.0, "keep_at_or_below": None},
    }
    batch = {
        "domain": np.array(["prose", "prose", "prose", "prose", "code"], dtype=object),
        "q_ppl": np.array([5.0, 12.0, 30.0, 30.0, 900.0]),
        "q_keep": np.array([True, True, True, False, True]),
        "q_reason": np.array(["", "", "", "gopher_min_words", ""], dtype=object),
    }
    judge_perplexity(batch, limits)
    assert batch["q_ppl_bucket"].tolist() == ["head", "middle", "tail", "tail", "tail"]
    assert batch["q_keep"].tolist() == [True, True, False, False, True]  # code has no limit
    assert batch["q_reason"].tolist() == ["", "", "perplexity", "gopher_min_words", ""]


def test_a_perplexity_filter_without_a_reference_model_is_refused():
    with pytest.raises(ConfigError, match="quality.reference_run is empty"):
        load_config(None, [*TINY, "quality.keep_top_percent=50"])
    with pytest.raises(ConfigError, match="must be <= 100|must be > 0"):
        load_config(None, [*TINY, 'quality.reference_run="x"', "quality.keep_top_percent=0"])


def _noisy(text: str, rng: random.Random) -> str:
    """Web-page junk: a third of the words replaced by random letter strings."""
    letters = "bcdfghjklmnpqrstvwxz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(len(w))) if rng.random() < 0.35 else w for w in text.split()
    )


def test_curate_scores_with_a_pool_of_reference_models_and_filters_by_percentile(ray_session, make_cfg, tmp_path):
    """A reference run trained on the bundled corpus scores a mix of its kind of text and noisy
    copies of other documents: the percentile filter drops the noisy ones with the reason
    ``perplexity``, the column equals the reference model's own score, and the report holds the
    per-domain percentiles. A missing reference run, or scorers on GPUs the cluster has none of, fail
    before any work."""
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from raysc.cluster.fit import ClusterTooSmall
    from raysc.curate.perplexity import load_reference
    from raysc.curate.pipeline import curate
    from raysc.data.corpus import iter_documents
    from raysc.export.restore import load_run
    from raysc.fleet.driver import train

    ref_cfg = make_cfg("train.steps=200", "checkpoint.every_steps=200", run="reference")
    train(ref_cfg, progress=False)
    prose = [d["text"] for d in iter_documents(1.0) if d["domain"] == "prose" and len(d["text"].split()) > 120]
    rng = random.Random(0)
    clean = [{"id": f"clean{i:02d}", "text": t, "domain": "prose"} for i, t in enumerate(prose[:20])]
    noisy = [{"id": f"noisy{i:02d}", "text": _noisy(t, rng), "domain": "prose"} for i, t in enumerate(prose[20:40])]
    src = tmp_path / "in"
    src.mkdir()
    (src / "part-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clean + noisy))

    missing = make_cfg(
        f'curate.input="{src}"', f'curate.output="{tmp_path / "x"}"', f'quality.reference_run="{tmp_path / "nope"}"'
    )
    with pytest.raises(FileNotFoundError, match="quality.reference_run.*train a reference model"):
        curate(missing, log=lambda *_: None)
    assert not (tmp_path / "x").exists()
    # scorers on GPUs the session's Ray (started by this process) will never have: refused before any work
    gpus = make_cfg(
        f'curate.input="{src}"',
        f'curate.output="{tmp_path / "x"}"',
        "quality.score_gpus=1",
        f'quality.reference_run="{ref_cfg.run.dir}"',
        "quality.keep_top_percent=50",
    )
    with pytest.raises(
        ClusterTooSmall, match=r"the perplexity scoring needs 1 actor\(s\) of 1 GPU.*quality.score_gpus=0"
    ):
        curate(gpus, log=lambda *_: None)
    assert not (tmp_path / "x").exists()

    cfg = make_cfg(
        f'curate.input="{src}"',
        f'curate.output="{tmp_path / "out"}"',
        "quality.enabled=false",
        f'quality.reference_run="{ref_cfg.run.dir}"',
        "quality.keep_top_percent=50",
        "quality.score_actors=2",
    )
    report = curate(cfg, log=lambda *_: None)
    kept = pq.read_table(tmp_path / "out" / "documents").to_pydict()
    dropped = pq.read_table(tmp_path / "out" / "dropped").to_pydict()
    assert len(kept["id"]) == 20 and set(dropped["q_reason"]) == {"perplexity"}
    assert sum(i.startswith("noisy") for i in dropped["id"]) >= 18, sorted(dropped["id"])
    assert set(kept["q_ppl_bucket"]) <= {"head", "middle"} and set(dropped["q_ppl_bucket"]) <= {"middle", "tail"}
    ppl = report["quality"]["perplexity"]
    assert ppl["reference_step"] == 200 and ppl["per_domain"]["prose"]["documents"] == 40
    assert report["removed"]["quality"] == 20 and "ppl" in report["quality"]["histograms"]
    # the column is the reference model's perplexity of the document's first score_tokens tokens
    run = load_run(ref_cfg.run.dir)
    tok = Tokenizer.from_file(str(run.tokenizer_path))
    n = min(cfg.quality.score_tokens, run.model.max_seq_len)
    ids = [tok.encode(t).ids[:n] for t in kept["text"][:4]]
    assert np.allclose(document_perplexities(run.model.eval(), ids), kept["q_ppl"][:4], rtol=1e-4)
    assert load_reference(ref_cfg.run.dir).step == 200
