"""Model-based quality score: every document's perplexity under a reference model (CCNet's recipe).

CCNet (Wenzek et al. 2020) scores each web document by the perplexity of a language model trained
on text it trusts (a 5-gram KenLM on Wikipedia), then splits every language into head, middle and
tail at the 33rd and 67th percentiles of that score: low perplexity means "reads like the
reference". Here the reference model is a raysc training run on a domain the user trusts
(``quality.reference_run``: its newest verified checkpoint and its tokenizer), and the buckets are
per domain, since code and prose have different perplexities under any model.

- Scoring runs in Ray Data as an actor pool (``map_batches`` with ``PerplexityScorer``, a callable
  class): each actor builds the model once and scores batches; ``quality.score_actors`` actors,
  ``quality.score_gpus`` GPUs each on a cluster. The reference (config, weights as numpy, tokenizer
  JSON) reaches the actors through Ray's object store, so an actor on another node needs neither
  the run directory nor the checkpoint store.
- A document's score is the mean next-token negative log-likelihood of its first
  ``quality.score_tokens`` tokens (at most the model's context), each predicted after the token that
  precedes a document in training (the run's BOS when it adds one, else its EOS), and ``q_ppl`` =
  exp of that. A document of no tokens scores ``inf`` (worst).
- Percentiles per domain (``thresholds``) come from every score (a uniform sample of
  ``PERCENTILE_SAMPLE`` above that): ``q_ppl_bucket`` is head / middle / tail, and with
  ``quality.keep_top_percent`` < 100 a document above its domain's percentile is dropped with the
  reason ``perplexity`` (so is one above ``quality.max_perplexity`` when that is set).

Why our own scorer rather than a library's: the model is raysc's own (no KenLM binary or
Hugging Face model to load), and the score is one batched forward pass of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from raysc.config.schema import QualityConfig

if TYPE_CHECKING:
    from ray.data import Dataset

BUCKETS = ("head", "middle", "tail")
PERCENTILE_SAMPLE = 1_000_000  # scores kept in the driver to set the per-domain percentiles
MICRO_BATCH = 16  # documents per forward pass inside an actor (sorted by length, padded)


@dataclass(frozen=True)
class Reference:
    """What a scorer needs to rebuild the reference model anywhere: model settings, weights, tokenizer."""

    run_dir: str
    step: int
    model: dict
    context: int
    weights: dict[str, np.ndarray]
    tokenizer_json: str
    start_id: int = 0  # what precedes a document in the run's packed rows


def load_reference(run_dir: str) -> Reference:
    """The newest verified checkpoint of the run in ``run_dir`` as a ``Reference``; a clear error when
    there is no such run or checkpoint."""
    from dataclasses import asdict

    from raysc.export.restore import load_run

    check_reference(run_dir)
    run = load_run(run_dir)
    weights = {k: v.detach().float().numpy() for k, v in run.model.state_dict().items()}
    return Reference(
        str(Path(run_dir).resolve()),
        run.step,
        asdict(run.cfg.model),
        run.model.max_seq_len,
        weights,
        Path(run.tokenizer_path).read_text(encoding="utf-8"),
        run.special.bos_id if run.special.add_bos else run.special.eos_id,
    )


class PerplexityScorer:
    """A Ray Data actor: one reference model, ``q_ppl`` for each batch of documents."""

    def __init__(self, reference, score_tokens: int, device: str = "cpu") -> None:
        import ray
        import torch
        from tokenizers import Tokenizer

        from raysc.config.schema import ModelConfig
        from raysc.model.llama import Llama

        ref: Reference = ray.get(reference) if isinstance(reference, ray.ObjectRef) else reference
        self.device = torch.device(device)
        self.model = Llama(ModelConfig(**ref.model), ref.context)
        self.model.load_state_dict(
            {k: torch.tensor(v) for k, v in ref.weights.items()}
        )  # copies: object-store arrays are read-only
        self.model.reset_buffers()
        self.model.to(self.device).eval()
        self.tokenizer = Tokenizer.from_str(ref.tokenizer_json)
        self.tokens = min(score_tokens, ref.context)
        self.start_id = ref.start_id

    def __call__(self, batch: dict) -> dict:
        ids = [e.ids[: self.tokens] for e in self.tokenizer.encode_batch(list(batch["text"]), add_special_tokens=False)]
        out = dict(batch)
        out["q_ppl"] = document_perplexities(self.model, ids, self.device, self.start_id)
        return out


def document_perplexities(model, docs: list[list[int]], device=None, start_id: int = 0) -> np.ndarray:
    """exp(mean next-token NLL) of each token list under ``model``, every list predicted after
    ``start_id`` (the token before a document in training: EOS, or BOS where the run adds one); ``inf``
    for an empty one. Lists are scored in length-sorted micro-batches, padded at the end (a causal model's earlier positions do not see the padding)."""
    import torch
    import torch.nn.functional as F

    out = np.full(len(docs), np.inf)
    order = sorted((i for i, d in enumerate(docs) if d), key=lambda i: len(docs[i]))
    with torch.no_grad():
        for s in range(0, len(order), MICRO_BATCH):
            chunk = order[s : s + MICRO_BATCH]
            width = max(len(docs[i]) for i in chunk)
            x = torch.full((len(chunk), width + 1), start_id, dtype=torch.long)
            y = torch.full((len(chunk), width), -100, dtype=torch.long)
            for r, i in enumerate(chunk):
                n = len(docs[i])
                x[r, 1 : n + 1] = torch.tensor(docs[i])
                y[r, :n] = x[r, 1 : n + 1]
            logits = model(x[:, :-1].to(device)).float()
            nll = F.cross_entropy(logits.transpose(1, 2), y.to(device), ignore_index=-100, reduction="none")
            mean = nll.sum(1) / (y != -100).sum(1).to(nll.device)
            out[chunk] = torch.exp(mean).cpu().numpy()
    return out


def score_documents(docs: Dataset, q: QualityConfig, log: Callable[[str], None] = print) -> tuple[Dataset, Reference]:
    """``docs`` with a ``q_ppl`` column (materialized) and the reference that scored it."""
    import ray
    from ray.data import ActorPoolStrategy

    ref = load_reference(q.reference_run)
    log(f"curate: perplexity under {ref.run_dir} (step {ref.step}), {q.score_actors} scorer actor(s)")
    handle = ray.put(ref)
    docs.context.op_resource_reservation_enabled = True  # an actor pool keeps its share (stages.read_documents)
    scored = docs.map_batches(
        PerplexityScorer,
        batch_format="numpy",
        batch_size=256,
        compute=ActorPoolStrategy(size=q.score_actors),
        fn_constructor_kwargs={
            "reference": handle,
            "score_tokens": q.score_tokens,
            "device": "cuda" if q.score_gpus else "cpu",
        },
        num_cpus=0 if q.score_gpus else 1,
        num_gpus=q.score_gpus or None,
    )
    return scored.materialize(), ref


def thresholds(scored: Dataset, count: int, q: QualityConfig) -> dict[str, dict]:
    """Per domain: documents, the 33rd / 67th percentiles (CCNet's buckets), the median and the keep
    limit (``keep_top_percent``'s percentile, capped by ``max_perplexity``; ``inf`` when neither filters)."""
    cols = scored.select_columns(["domain", "q_ppl"])
    if count > PERCENTILE_SAMPLE:
        cols = cols.random_sample(PERCENTILE_SAMPLE / count, seed=0)
    sample = cols.take_batch(PERCENTILE_SAMPLE + count // 100 + 1, batch_format="numpy")
    domains = np.asarray(sample["domain"]).astype(str)
    ppl = np.asarray(sample["q_ppl"], dtype=np.float64)
    out = {}
    for dom in sorted(set(domains.tolist())):
        s = ppl[domains == dom]
        limit = float(np.percentile(s, q.keep_top_percent)) if q.keep_top_percent < 100 else math.inf
        if q.max_perplexity:
            limit = min(limit, q.max_perplexity)
        p33, p50, p67 = (_finite(np.percentile(s, p)) for p in (33, 50, 67))
        out[dom] = {"documents": int(len(s)), "p33": p33, "median": p50, "p67": p67, "keep_at_or_below": _finite(limit)}
    return out


def report_fragment(ref: Reference, q: QualityConfig, limits: dict[str, dict]) -> dict:
    """``report.json``'s ``quality.perplexity``: what scored, with which settings, and the percentiles."""
    return {
        "reference_run": ref.run_dir,
        "reference_step": ref.step,
        "score_tokens": q.score_tokens,
        "keep_top_percent": q.keep_top_percent,
        "max_perplexity": q.max_perplexity,
        "per_domain": limits,
    }


def _finite(x: float) -> float | None:
    """JSON-safe: None for no limit (or a percentile among documents of no tokens)."""
    return float(x) if math.isfinite(x) else None


def check_reference(run_dir: str) -> None:
    """Fail before any work when ``quality.reference_run`` names no run directory."""
    if not (Path(run_dir) / "config.toml").is_file():
        raise FileNotFoundError(
            f"quality.reference_run = {run_dir!r} is not a raysc run directory (no config.toml); "
            f"train a reference model on text you trust first (`raysc train CONFIG`, data.source "
            f"set to that text) and point quality.reference_run at its run.dir"
        )


def judge_perplexity(out: dict, limits: dict[str, dict]) -> None:
    """Add ``q_ppl_bucket`` to a judged batch (``stages.judge_batch``) and drop, with the reason
    ``perplexity``, a document the rules kept whose score is above its domain's limit."""
    ppl = np.asarray(out["q_ppl"], dtype=np.float64)
    lim = [limits.get(str(d)) or {} for d in out["domain"]]

    def column(key: str) -> np.ndarray:
        return np.array([math.inf if x.get(key) is None else x[key] for x in lim], dtype=np.float64)

    p33, p67, keep_below = column("p33"), column("p67"), column("keep_at_or_below")
    out["q_ppl_bucket"] = np.where(ppl <= p33, BUCKETS[0], np.where(ppl <= p67, BUCKETS[1], BUCKETS[2])).astype(object)
    over = (ppl > keep_below) & np.asarray(out["q_keep"], dtype=bool)
    out["q_keep"] = np.asarray(out["q_keep"], dtype=bool) & ~over
    out["q_reason"] = np.where(over, "perplexity", np.asarray(out["q_reason"], dtype=object)).astype(object)
