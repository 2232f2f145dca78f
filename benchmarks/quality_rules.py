"""The quality stage's rules (Gopher, C4, FineWeb) per document against per batch, side by side.

``python benchmarks/quality_rules.py [--docs 5000] [--batch 1024] [--repeats 3]``: synthetic documents
(``raysc.curate.synth``, the bundled corpus's lines, 2% seeded near-duplicates), judged in this process
(one thread, the same documents) by (a) the per-document path raysc ran before, where the n-gram repetition
measures were a ``Counter`` of word tuples per document and n (``ngrams.ngram_repetition_reference``), and
(b) ``QualityRules.judge_batch`` over batches of ``--batch`` documents, as Ray Data's ``map_batches`` hands
them to the stage. Both give the same verdicts (checked); runs alternate a, b, a, b… and the median of each
counts. Prints microseconds per document of both, and of the n-gram measures alone, and the speed-up, as
JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysc.curate import quality as q  # noqa: E402
from raysc.curate.ngrams import ngram_repetition, ngram_repetition_reference  # noqa: E402
from raysc.curate.synth import Synth, SynthSpec  # noqa: E402
from raysc.curate.words import words  # noqa: E402


def per_document(rules: q.QualityRules, texts: list[str], domains: list[str]) -> list[dict]:
    """The verdicts as raysc computed them before ``judge_batch``: every measure one document at a time."""
    out = []
    for text, domain in zip(texts, domains):
        m = {
            **q.measure_gopher(text),
            **q.measure_line_repetition(text),
            **ngram_repetition_reference(words(text), list(rules.top_ngram_max), list(rules.dup_ngram_max)),
            **q.measure_c4(text, rules),
            **q.measure_fineweb(text, rules),
        }
        reason = rules._first_failure(m, prose=domain not in rules.skip_domains)
        out.append({**m, "keep": not reason, "reason": reason})
    return out


def batched(rules: q.QualityRules, texts: list[str], domains: list[str], batch: int) -> list[dict]:
    return [
        v for i in range(0, len(texts), batch) for v in rules.judge_batch(texts[i : i + batch], domains[i : i + batch])
    ]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=5000)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    docs = [d for d, _ in Synth(SynthSpec(docs=args.docs, near_frac=0.02, exact_frac=0.0, corpus_mb=1.0))]
    texts, domains = [d["text"] for d in docs], [d["domain"] for d in docs]
    rules = q.QualityRules()
    tops, dups = list(rules.top_ngram_max), list(rules.dup_ngram_max)
    split = [words(t) for t in texts]
    times: dict[str, list[float]] = {"per_document": [], "batched": [], "ngrams_per_document": [], "ngrams_batched": []}
    for _ in range(args.repeats):
        t, old = timed(lambda: per_document(rules, texts, domains))
        times["per_document"].append(t)
        t, new = timed(lambda: batched(rules, texts, domains, args.batch))
        times["batched"].append(t)
        times["ngrams_per_document"].append(
            timed(lambda: [ngram_repetition_reference(w, tops, dups) for w in split])[0]
        )
        times["ngrams_batched"].append(
            timed(
                lambda: [
                    ngram_repetition(split[i : i + args.batch], tops, dups) for i in range(0, len(split), args.batch)
                ]
            )[0]
        )
    assert [v["reason"] for v in old] == [v["reason"] for v in new], "the two paths disagree on a verdict"
    us = {k: round(statistics.median(v) / len(texts) * 1e6, 1) for k, v in times.items()}
    result = {
        "docs": len(texts),
        "batch": args.batch,
        "words_per_doc": round(sum(map(len, split)) / len(split), 1),
        "dropped": sum(not v["keep"] for v in new),
        "us_per_doc": us,
        "speedup": round(us["per_document"] / us["batched"], 2),
        "ngram_speedup": round(us["ngrams_per_document"] / us["ngrams_batched"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
