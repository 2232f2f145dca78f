"""Curation end to end: the ``raysc curate`` pipeline against single-process MinHash-LSH tools.

``python benchmarks/dedup.py --docs 10000`` writes (once, cached) a synthetic corpus of N
documents with seeded exact and near duplicates at measured Jaccard similarities
(``raysc.curate.synth``), then runs every implementation the same way: a fresh Python process
each (cold: imports, Ray start-up where used, reading the shards, normalising, exact dedup,
MinHash-LSH, verification, clusters, writing the kept documents as Parquet), timed from process
start to exit by this parent, which also samples the resident memory of the process and of
every process it starts (Ray's workers) every 0.2 s. Same parameters everywhere: ``words()``
5-gram shingles, signatures of 112 values as 14 bands × 8 rows, a candidate pair is a duplicate when
its signatures agree on >= 0.7 of the values, clusters are connected components, the smallest id
survives. raysc computes its signatures by its default scheme (``dedup.minhash = one_permutation``:
one hash per shingle into 112 bins); datasketch and datatrove by 112 hash functions per shingle.

- ``raysc``: ``raysc curate CONFIG`` through the CLI's entry point, as a user runs it (it starts and
  stops a local Ray; quality rules off, so no quality measurement is computed;
  ``seconds_without_quality`` leaves out a quality stage where a report has one).
- ``raysc_rules``: ``raysc curate`` at its default quality rules (Gopher quality and repetition, C4,
  FineWeb), after dedup as the pipeline orders them.
- ``raysc_kernel``: raysc's MinHasher, band keys and verification in one process with numpy.
- ``datasketch``: ``MinHash.update_batch`` + ``MinHashLSH(params=(14, 8))`` insert and query,
  the same verification and union-find.
- ``datatrove`` (when installed, ``pip install -e '.[bench]'``): its four MinHash stages with
  our word splitting; it does not verify candidates (any shared band is a duplicate). It runs as many
  tasks and worker processes as the machine has cores (``--datatrove-workers``), as Ray Data does for
  raysc: the same concurrency.
- ``datatrove_rules``: the same four stages with datatrove's own filters of the same families after
  its dedup filter, each at its published default: ``GopherRepetitionFilter``,
  ``GopherQualityFilter``, ``C4QualityFilter``, ``FineWebQualityFilter`` (their English word and
  sentence splitting is datatrove's default, spaCy's blank English pipeline with its sentencizer:
  what a datatrove user runs). The issue's "MinHash + Gopher" pipeline plus C4 and FineWeb, so both
  sides apply one rule set.

``--format parquet`` makes the corpus FineWeb-like Parquet shards (FineWeb's columns, see
``raysc.curate.synth``) instead of JSONL; every implementation reads the same files.

Recall on truth pairs with Jaccard >= 0.85, removals at <= 0.5, and removals of documents
that no truth pair at > 0.5 explains, for the dedup-only implementations (with rules the quality
verdicts remove documents too: the ``*_rules`` pair reports the documents each kept and the
overlap of the two kept sets). Medians over ``--repeats``; ratios of medians. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THRESHOLD, SHINGLE, BANDS, ROWS = 0.7, 5, 14, 8
IMPLS = ("raysc", "raysc_kernel", "datasketch", "datatrove", "raysc_rules", "datatrove_rules")
DEFAULT_IMPLS = ("raysc", "raysc_kernel", "datasketch", "datatrove")


# ---- the implementations, each run in its own process (``--run NAME``) ----
def load_docs(corpus: Path) -> list[dict]:
    """Every document of the shards, normalised (``inputs.normalise``), one per distinct text
    (the smallest id), sorted by id."""
    import hashlib

    from raysc.curate.inputs import normalise

    best: dict[str, dict] = {}
    for d in read_rows(corpus / "docs"):
        text = normalise(d["text"])
        h = hashlib.sha1(text.encode()).hexdigest()
        if h not in best or d["id"] < best[h]["id"]:
            best[h] = {"id": d["id"], "text": text, "domain": d["domain"]}
    return sorted(best.values(), key=lambda d: d["id"])


def read_rows(docs: Path):
    """Every row (id, text, domain) of the JSONL or Parquet shards in ``docs``, shard by shard."""
    import pyarrow.parquet as pq

    for f in sorted(docs.glob("part-*")):
        if f.suffix == ".parquet":
            yield from pq.read_table(f, columns=["id", "text", "domain"]).to_pylist()
        else:
            with open(f, encoding="utf-8") as fh:
                yield from (json.loads(line) for line in fh)


def survivors(docs: list[dict], edges) -> list[dict]:
    """Union-find over document indices (ids sorted, so the smaller index is the smaller id)."""
    parent = list(range(len(docs)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [d for i, d in enumerate(docs) if find(i) == i]


def write_kept(kept: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (out / "documents").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(kept), out / "documents" / "part-0.parquet")


def kernel_edges(docs: list[dict]) -> set:
    import numpy as np

    from raysc.curate.minhash import MinHasher

    hasher = MinHasher(BANDS * ROWS, BANDS, ROWS, SHINGLE, 1)
    sig = np.concatenate([hasher.signatures([d["text"] for d in docs[i : i + 512]]) for i in range(0, len(docs), 512)])
    keys = hasher.band_keys(sig)
    edges = set()
    for band in range(BANDS):
        order = np.argsort(keys[:, band], kind="stable")
        k = keys[order, band]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        sizes = np.diff(np.r_[starts, len(k)])
        for s, n in zip(starts[sizes > 1], sizes[sizes > 1]):
            group = order[s : s + n]
            est = (sig[group][:, None, :] == sig[group][None, :, :]).mean(axis=2)
            i, j = np.nonzero(np.triu(est >= THRESHOLD, k=1))
            edges.update((int(min(group[a], group[b])), int(max(group[a], group[b]))) for a, b in zip(i, j))
    return edges


def datasketch_edges(docs: list[dict]) -> set:
    from datasketch import MinHash, MinHashLSH

    from raysc.curate.words import words

    lsh = MinHashLSH(num_perm=BANDS * ROWS, params=(BANDS, ROWS))
    sigs = []
    for i, d in enumerate(docs):
        w = words(d["text"])
        m = MinHash(num_perm=BANDS * ROWS, seed=1)
        m.update_batch([" ".join(w[k : k + SHINGLE]).encode() for k in range(max(1, len(w) - SHINGLE + 1))])
        lsh.insert(i, m)
        sigs.append(m)
    return {(i, j) for i, m in enumerate(sigs) for j in lsh.query(m) if j > i and m.jaccard(sigs[j]) >= THRESHOLD}


def datatrove_kept(docs: list[dict], work: Path, rules: bool = False, workers: int = 1) -> list[dict]:
    """datatrove's 4-stage MinHash dedup with our word splitting and 64-bit sha1 shingle hashes (its
    xxhash path passes str, which current xxhash rejects); with ``rules``, its Gopher, C4 and FineWeb
    filters after the dedup filter, at their defaults. ``workers`` > 1: as many tasks and worker
    processes in every stage but the clustering (one task by datatrove's design), the documents split
    by rank the same way in the signature and the filter stage (its removal lists are per rank)."""
    import datatrove.pipeline.dedup.minhash as dm
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.word_tokenizers import WordTokenizer

    from raysc.curate.words import words

    class OurWords(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return words(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    dm.load_word_tokenizer = lambda language: OurWords()  # the MinHash stages only: filters keep theirs
    config = dm.MinhashConfig(
        n_grams=SHINGLE,
        num_buckets=BANDS,
        hashes_per_bucket=ROWS,
        seed=1,
        hash_config=HashConfig(precision=64, hash_fc="sha1"),
    )

    def reader(data, rank: int = 0, world_size: int = 1):
        for d in docs[rank::world_size]:
            yield Document(text=d["text"], id=d["id"])

    kept_dir = work / "kept"
    kept_dir.mkdir(parents=True, exist_ok=True)

    def collect(data, rank: int = 0, world_size: int = 1):  # a file per rank: workers are processes
        with open(kept_dir / f"{rank:05d}.txt", "w") as f:
            for doc in data:
                f.write(doc.id + "\n")
                yield doc

    filters = []
    if rules:
        from datatrove.pipeline.filters import (
            C4QualityFilter,
            FineWebQualityFilter,
            GopherQualityFilter,
            GopherRepetitionFilter,
        )

        filters = [GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(), FineWebQualityFilter()]
    w = str(work)
    stages = [
        ([reader, dm.MinhashDedupSignature(output_folder=f"{w}/sigs", config=config)], workers),
        ([dm.MinhashDedupBuckets(input_folder=f"{w}/sigs", output_folder=f"{w}/buckets", config=config)], BANDS),
        ([dm.MinhashDedupCluster(input_folder=f"{w}/buckets", output_folder=f"{w}/remove", config=config)], 1),
        ([reader, dm.MinhashDedupFilter(input_folder=f"{w}/remove"), *filters, collect], workers),
    ]
    for i, (pipeline, tasks) in enumerate(stages):
        # fork: the workers inherit the documents read once here (forkserver, datatrove's default, would
        # pickle them into every task; a datatrove user's reader opens the files instead)
        LocalPipelineExecutor(
            pipeline=pipeline,
            tasks=tasks,
            workers=min(workers, tasks),
            logging_dir=f"{w}/logs{i}",
            skip_completed=False,
            start_method="fork",
        ).run()
    kept_ids = {line for f in kept_dir.glob("*.txt") for line in f.read_text().splitlines()}
    return [d for d in docs if d["id"] in kept_ids]


def run_one(name: str, corpus: Path, work: Path, datatrove_workers: int = 1) -> dict:
    """One implementation from corpus to Parquet; stage seconds where it reports them."""
    if name in ("raysc", "raysc_rules"):  # what a user runs: `raysc curate CONFIG`, Ray started by the command
        from raysc.cli import main

        config = work / "curate.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f'[curate]\ninput = "{corpus / "docs"}"\noutput = "{work / "out"}"\n'
            f"[quality]\nenabled = {str(name == 'raysc_rules').lower()}\n"
            f"[dedup]\nthreshold = {THRESHOLD}\n"
            f'[run]\ndir = "{work / "run"}"\n[data]\ncache_dir = "{ROOT / ".cache/raysc"}"\n'
        )
        if main(["curate", str(config)]):
            raise RuntimeError("raysc curate failed")
        report = json.loads((work / "out" / "report.json").read_text())
        return {
            "stages": report["seconds"],
            "cc_rounds": report["near_dedup"]["cc_rounds"],
            "shuffles": report["near_dedup"].get("shuffles"),
        }
    t0 = time.perf_counter()
    docs = load_docs(corpus)
    t1 = time.perf_counter()
    if name in ("datatrove", "datatrove_rules"):
        kept = datatrove_kept(docs, work / "datatrove", rules=name == "datatrove_rules", workers=datatrove_workers)
    else:
        kept = survivors(docs, sorted((kernel_edges if name == "raysc_kernel" else datasketch_edges)(docs)))
    t2 = time.perf_counter()
    write_kept(kept, work / "out")
    middle = "near_dedup_and_rules" if name.endswith("_rules") else "near_dedup"
    return {
        "stages": {
            "read_normalise_exact": round(t1 - t0, 3),
            middle: round(t2 - t1, 3),
            "write": round(time.perf_counter() - t2, 3),
        }
    }


# ---- the parent: corpus, processes, memory, accuracy ----
def tree_rss(pid: int, peaks: dict[int, tuple[str, int]], stop: threading.Event) -> None:
    """Peak resident bytes of ``pid`` and every process below it, sampled until ``stop``."""
    import psutil

    root = psutil.Process(pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in procs:
            try:
                rss, name = p.memory_info().rss, (p.name() if p.pid != pid else "driver")
            except psutil.Error:
                continue
            if rss > peaks.get(p.pid, ("", 0))[1]:
                peaks[p.pid] = (name, rss)
        stop.wait(0.2)


def timed_run(name: str, corpus: Path, work: Path, datatrove_workers: int) -> dict:
    """Run ``name`` in a fresh process; wall seconds from start to exit, peak memory, its output."""
    peaks: dict[int, tuple[str, int]] = {}
    stop = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--run",
            name,
            "--corpus",
            str(corpus),
            "--work",
            str(work),
            "--datatrove-workers",
            str(datatrove_workers),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    sampler = threading.Thread(target=tree_rss, args=(proc.pid, peaks, stop), daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{name} exited with {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    workers = sorted(((rss, n) for pid, (n, rss) in peaks.items() if n != "driver"), reverse=True)
    mb = 1 << 20
    return {
        "seconds": round(seconds, 2),
        **result,
        "peak_mb": {
            "driver": round(peaks.get(proc.pid, ("", 0))[1] / mb),
            "processes": 1 + len(workers),
            "largest_other": [round(r / mb) for r, _ in workers[:6]],
            "largest_other_names": [n for _, n in workers[:6]],
        },
    }


def accuracy(truth: list[dict], n: int, seed: int, kept: set[str]) -> dict:
    from raysc.curate.audit import pair_detected
    from raysc.curate.synth import Synth, SynthSpec

    high = [p for p in truth if p["jaccard"] >= 0.85]
    low = [p for p in truth if p["jaccard"] <= 0.5]
    explained = {p["copy"] for p in truth if p["jaccard"] > 0.5}
    ids = Synth(SynthSpec(n, seed), pools={"prose": [""], "code": [""]})
    removed = {ids.doc_id(i) for i in range(n)} - kept
    return {
        "recall_ge_0.85": round(sum(pair_detected(p, kept) for p in high) / max(1, len(high)), 4),
        "removed_le_0.5": sum(pair_detected(p, kept) for p in low),
        "pairs_le_0.5": len(low),
        "unexplained_removals": len(removed - explained),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"comma-separated, of {', '.join(IMPLS)}")
    ap.add_argument(
        "--format",
        choices=("jsonl", "parquet"),
        default="jsonl",
        help="the corpus's shards: JSONL, or FineWeb-like Parquet",
    )
    ap.add_argument("--cache", default=str(ROOT / ".cache/raysc/synth"))
    ap.add_argument(
        "--datatrove-workers",
        type=int,
        default=os.cpu_count() or 1,
        help="datatrove's tasks and worker processes per stage (default: every core, as Ray Data "
        "uses them for raysc; 1 reproduces the single-worker figures)",
    )
    ap.add_argument("--run", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:  # a child: one implementation, its figures as the last line
        print(json.dumps(run_one(a.run, Path(a.corpus), Path(a.work), a.datatrove_workers)))
        return
    import shutil
    import tempfile

    from raysc.curate.synth import SynthSpec, read_truth, write_corpus

    corpus = Path(a.cache) / (f"n{a.docs}-s{a.seed}" + ("-parquet" if a.format == "parquet" else ""))
    if not (corpus / "meta.json").is_file():
        write_corpus(SynthSpec(a.docs, a.seed), corpus, a.format, shard_docs=5_000, log=lambda m: print(m, flush=True))
    meta, truth = json.loads((corpus / "meta.json").read_text()), read_truth(corpus)
    print(f"corpus: {a.docs} documents ({meta['bytes'] / 1e6:.1f} MB), roles {meta['roles']}", flush=True)
    impls = [i for i in a.impls.split(",") if i]
    if any(i.startswith("datatrove") for i in impls):
        try:
            import datatrove  # noqa: F401
        except ImportError:
            impls = [i for i in impls if not i.startswith("datatrove")]
            print("datatrove: not installed, left out (pip install -e '.[bench]')", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in impls}
    kept_ids: dict[str, set[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):  # interleaved, so a load change hits every implementation alike
            for name in impls:
                work = Path(tmp) / f"{name}-{r}"
                res = timed_run(name, corpus, work, a.datatrove_workers)
                import pyarrow.parquet as pq

                kept = set(pq.read_table(work / "out" / "documents", columns=["id"]).column("id").to_pylist())
                res["kept"] = len(kept)
                if not name.endswith("_rules"):
                    res.update(accuracy(truth, a.docs, a.seed, kept))
                kept_ids[name] = kept
                shutil.rmtree(work, ignore_errors=True)
                runs[name].append(res)
                print(f"{name} #{r}: {json.dumps(res)}", flush=True)
    results = {}
    for name, rs in runs.items():
        sec = statistics.median(x["seconds"] for x in rs)
        results[name] = {
            **rs[-1],
            "seconds": sec,
            "seconds_all": [x["seconds"] for x in rs],
            "docs_per_s": round(a.docs / sec, 1),
        }
        if name == "raysc":
            wq = statistics.median(x["seconds"] - x["stages"].get("quality", 0.0) for x in rs)
            results[name]["seconds_without_quality"] = round(wq, 2)
    out = {
        "documents": a.docs,
        "format": a.format,
        "megabytes": round(meta["bytes"] / 1e6, 1),
        "cores": os.cpu_count(),
        "datatrove_workers": a.datatrove_workers,
        "repeats": a.repeats,
        "shingle": SHINGLE,
        "num_perm": BANDS * ROWS,
        "bands": BANDS,
        "rows": ROWS,
        "threshold": THRESHOLD,
        **results,
    }
    for name in impls:
        if name not in ("raysc", "raysc_rules", "datatrove_rules") and "raysc" in results:
            out[f"ratio_raysc_vs_{name}"] = round(results[name]["seconds"] / results["raysc"]["seconds"], 2)
    if {"raysc_rules", "datatrove_rules"} <= set(results):  # the pipelines with rules, against each other
        out["ratio_raysc_rules_vs_datatrove_rules"] = round(
            results["datatrove_rules"]["seconds"] / results["raysc_rules"]["seconds"], 2
        )
        a_, b_ = kept_ids["raysc_rules"], kept_ids["datatrove_rules"]
        out["kept_overlap_rules"] = round(len(a_ & b_) / max(1, len(a_ | b_)), 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
