"""Near-dedup speed and accuracy: raysc's MinHash-LSH against datasketch (and datatrove where it installs).

One corpus for everyone: the bundled stdlib corpus (``--corpus-mb``) plus rewritten copies of
seeded documents at known shingle Jaccard similarities (``raysc.curate.audit.inject_pairs``,
0.3 … 1.0). Everyone uses the same shingles (``words()`` 5-grams), 112 hashes as 14 bands × 8
rows, and the same decision: an LSH candidate pair is a duplicate when its signatures agree on
at least ``dedup.threshold`` (0.7) of the hashes; clusters are connected components; the
smallest id of a cluster survives. Measured, each on this machine, one after the other:

- ``raysc``: the near-dedup stage of ``raysc curate`` (Ray Data: signatures, band buckets,
  verified pairs, hash-to-min connected components, anti-join) from its report's stage timing;
  end-to-end pipeline seconds are printed too.
- ``raysc_kernel``: the same MinHasher / band keys / verification in one process with numpy
  (what each Ray Data task runs), for a like-for-like single-process comparison.
- ``datasketch``: ``MinHash.update_batch`` per document + ``MinHashLSH(params=(14, 8))`` insert
  and query, then the same verification and union-find.
- ``datatrove``: its four MinHash stages (signature, buckets, cluster, filter) with a
  ``LocalPipelineExecutor``, its word tokenizer replaced by ours so the shingles match (it
  also simplifies the text first) and 64-bit sha1 shingle hashes. It does not verify
  candidates: any shared band makes a duplicate, by its design.

Documents/s of each, the ratios ours/theirs (target ≥ 3× datasketch), recall on pairs with
similarity ≥ 0.85 and false removals at ≤ 0.5 (precision) of each. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysc.curate.audit import inject_pairs, pair_detected  # noqa: E402
from raysc.curate.minhash import MinHasher, words  # noqa: E402

THRESHOLD, SHINGLE, BANDS, ROWS = 0.7, 5, 14, 8


def corpus(max_mb: float, cache: str, per_target: int) -> tuple[list[dict], list[dict]]:
    from raysc.data.corpus import build_bundled_corpus, read_documents

    docs = [{"id": d["id"], "text": d["text"], "domain": d["domain"]}
            for d in read_documents(build_bundled_corpus(cache, max_mb))]
    pairs, copies = inject_pairs(docs, SHINGLE, seed=0, per_target=per_target)
    return docs + copies, pairs


def survivors_from_edges(ids: list[str], edges: list[tuple[int, int]]) -> set[str]:
    """Union-find over document indices; the smallest id of each component survives."""
    parent = list(range(len(ids)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb, key=lambda r: ids[r])] = min(ra, rb, key=lambda r: ids[r])
    return {ids[i] for i in range(len(ids)) if find(i) == i}


def run_kernel(docs: list[dict]) -> set[str]:
    """raysc's near-dedup math in one process: signatures, band keys, candidates per bucket, verification."""
    hasher = MinHasher(BANDS * ROWS, BANDS, ROWS, SHINGLE, 1)
    ids = [d["id"] for d in docs]
    sig = np.concatenate([hasher.signatures([d["text"] for d in docs[i:i + 512]]) for i in range(0, len(docs), 512)])
    keys = hasher.band_keys(sig)
    edges = set()
    for band in range(BANDS):
        order = np.argsort(keys[:, band], kind="stable")
        k = keys[order, band]
        bounds = np.flatnonzero(np.diff(k)) + 1
        for group in np.split(order, bounds):
            if len(group) < 2:
                continue
            est = (sig[group][:, None, :] == sig[group][None, :, :]).mean(axis=2)
            i, j = np.nonzero(np.triu(est >= THRESHOLD, k=1))
            edges.update((int(group[a]), int(group[b])) for a, b in zip(i, j))
    return survivors_from_edges(ids, sorted(edges))


def run_datasketch(docs: list[dict]) -> set[str]:
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=BANDS * ROWS, params=(BANDS, ROWS))
    sigs = []
    for i, d in enumerate(docs):
        w = words(d["text"])
        grams = [" ".join(w[k:k + SHINGLE]).encode() for k in range(max(1, len(w) - SHINGLE + 1))]
        m = MinHash(num_perm=BANDS * ROWS, seed=1)
        m.update_batch(grams)
        lsh.insert(i, m)
        sigs.append(m)
    edges = set()
    for i, m in enumerate(sigs):
        for j in lsh.query(m):
            if j > i and m.jaccard(sigs[j]) >= THRESHOLD:
                edges.add((i, j))
    return survivors_from_edges([d["id"] for d in docs], sorted(edges))


def run_datatrove(docs: list[dict], workdir: Path) -> set[str]:
    """datatrove's 4-stage MinHash dedup, in this process (workers=1), with our word splitting."""
    import datatrove.pipeline.dedup.minhash as dm
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.utils.word_tokenizers import WordTokenizer

    class OurWords(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return words(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    dm.load_word_tokenizer = lambda language: OurWords()
    from datatrove.utils.hashing import HashConfig

    # sha1 shingle hashes: its xxhash path passes str to xxhash, which current xxhash releases reject
    config = dm.MinhashConfig(n_grams=SHINGLE, num_buckets=BANDS, hashes_per_bucket=ROWS, seed=1,
                              hash_config=HashConfig(precision=64, hash_fc="sha1"))

    def reader(data, rank: int = 0, world_size: int = 1):
        for d in docs:
            yield Document(text=d["text"], id=d["id"])

    kept: list[str] = []

    def collect(data, rank: int = 0, world_size: int = 1):
        for doc in data:
            kept.append(doc.id)
            yield doc

    stages = [
        ([reader, dm.MinhashDedupSignature(output_folder=str(workdir / "sigs"), config=config)], 1),
        ([dm.MinhashDedupBuckets(input_folder=str(workdir / "sigs"), output_folder=str(workdir / "buckets"),
                                 config=config)], BANDS),
        ([dm.MinhashDedupCluster(input_folder=str(workdir / "buckets"), output_folder=str(workdir / "remove"),
                                 config=config)], 1),
        ([reader, dm.MinhashDedupFilter(input_folder=str(workdir / "remove")), collect], 1),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(workdir / f"logs{i}"),
                              skip_completed=False).run()
    return set(kept)


def run_raysc(docs: list[dict], workdir: Path) -> tuple[set[str], dict]:
    import pyarrow.parquet as pq

    from raysc.config import load_config
    from raysc.curate.pipeline import curate
    from raysc.driver import ensure_ray

    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "input.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = load_config(None, [f'curate.input="{src}"', f'curate.output="{workdir / "out"}"', "quality.enabled=false",
                             "dedup.exact=false", f"dedup.threshold={THRESHOLD}", f'run.dir="{workdir / "run"}"'])
    ensure_ray()
    report = curate(cfg, log=lambda *_: None)
    kept = set(pq.read_table(workdir / "out" / "documents").column("id").to_pylist())
    return kept, report


def accuracy(pairs: list[dict], kept: set[str]) -> dict:
    high = [p for p in pairs if p["jaccard"] >= 0.85]
    low = [p for p in pairs if p["jaccard"] <= 0.5]
    removed = [p for p in pairs if pair_detected(p, kept)]
    false = [p for p in removed if p["jaccard"] <= 0.5]
    return {"recall_ge_0.85": round(sum(pair_detected(p, kept) for p in high) / max(1, len(high)), 3),
            "removed_le_0.5": len(false), "pairs_le_0.5": len(low),
            "precision": round(1 - len(false) / len(removed), 3) if removed else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--pairs-per-target", type=int, default=20)
    ap.add_argument("--cache", default=".cache/raysc")
    args = ap.parse_args()
    docs, pairs = corpus(args.corpus_mb, args.cache, args.pairs_per_target)
    n, mb = len(docs), sum(len(d["text"]) for d in docs) / 1e6
    print(f"corpus: {n} documents ({mb:.1f} MB) incl. {len(pairs)} rewritten copies", flush=True)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        runs = [("raysc_kernel", lambda: run_kernel(docs)), ("datasketch", lambda: run_datasketch(docs))]
        try:
            import datatrove  # noqa: F401

            runs.append(("datatrove", lambda: run_datatrove(docs, tmp_path / "datatrove")))
        except ImportError as e:
            results["datatrove"] = {"skipped": f"not installed ({e.name}); pip install -e '.[bench]'"}
        for name, fn in runs:
            t0 = time.perf_counter()
            kept = fn()
            dt = time.perf_counter() - t0
            results[name] = {"seconds": round(dt, 2), "docs_per_s": round(n / dt, 1), **accuracy(pairs, kept)}
            print(f"{name}: {results[name]}", flush=True)
        # twice: the first run also starts Ray's worker processes and imports; the second is reported
        run_raysc(docs, tmp_path / "raysc-warmup")
        kept, report = run_raysc(docs, tmp_path / "raysc")
        dt = report["seconds"]["near_dedup"]
        results["raysc"] = {"seconds": dt, "docs_per_s": round(n / dt, 1),
                            "pipeline_seconds": report["seconds_total"], **accuracy(pairs, kept)}
        print(f"raysc (Ray Data, {os.cpu_count()} cores): {results['raysc']}", flush=True)
    theirs = results["datasketch"]["docs_per_s"]
    out = {"documents": n, "megabytes": round(mb, 2), "cores": os.cpu_count(),
           "shingle": SHINGLE, "num_perm": BANDS * ROWS, "bands": BANDS, "rows": ROWS, "threshold": THRESHOLD,
           **results,
           "ratio_raysc_vs_datasketch": round(results["raysc"]["docs_per_s"] / theirs, 2),
           "ratio_kernel_vs_datasketch": round(results["raysc_kernel"]["docs_per_s"] / theirs, 2)}
    if "docs_per_s" in results.get("datatrove", {}):
        out["ratio_raysc_vs_datatrove"] = round(results["raysc"]["docs_per_s"] / results["datatrove"]["docs_per_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
