"""A synthetic curation corpus with known duplicates, for benchmarks and tests.

``python -m raysc.curate.synth OUT --docs N`` writes ``OUT/docs/part-NNNNN.jsonl`` (or
``.parquet``) shards of N documents, ``OUT/truth.jsonl`` (the seeded duplicate pairs) and
``OUT/meta.json``. Nothing is held beyond one shard: document ``i`` is a pure function of
``(seed, i)``, so a copy regenerates its original instead of remembering it, and N may be a
million.

- A *base* document is a run of lines drawn at random from a pool of the distinct lines (at
  least ``MIN_LINE_WORDS`` words) of the bundled corpus (``raysc.data.corpus``: stdlib prose
  and code, shipped with every Python), ``MIN_WORDS``-``MAX_WORDS`` words, domain ``prose`` or
  ``code`` like its lines. With tens of thousands of pool lines, two base documents share
  almost no 5-word shingle, so any pair the truth does not list is a true non-duplicate.
- A *near* copy (share ``near_frac``) is an earlier base document rewritten to a target
  Jaccard similarity (``audit.rewrite``, targets 0.3 … 0.95); the truth records the measured
  shingle Jaccard, not the target.
- An *exact* copy (share ``exact_frac``) is an earlier base document with different
  whitespace: identical once normalised (``inputs.normalise``).

A Parquet corpus (``--format parquet``) has FineWeb's columns as well: ``text``, ``id``, ``dump``,
``url``, ``date``, ``file_path``, ``language``, ``language_score``, ``token_count`` (besides our
``domain``), so it reads like a FineWeb shard; the metadata is made up (a dump name, a URL from the
id, ``token_count`` estimated as UTF-8 bytes / 4, not a tokenizer's count).

Copies have larger indices, so their ids (``syn<seed>-<index>``) sort after their original's
and a correct dedup keeps the original. Several copies may share one original (a star
cluster). No library generates corpora with measured near-duplicate ground truth, hence ours.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from raysc.curate.audit import TARGETS, rewrite
from raysc.curate.minhash import jaccard

MIN_LINE_WORDS = 5
MIN_WORDS, MAX_WORDS = 60, 400
NEAR_TARGETS = tuple(t for t in TARGETS if t < 1.0)


@dataclass(frozen=True)
class SynthSpec:
    """What to generate: documents, seed, shares of copies, and the source text size."""

    docs: int
    seed: int = 0
    near_frac: float = 0.10
    exact_frac: float = 0.05
    shingle: int = 5
    corpus_mb: float = 6.0


def line_pools(corpus_mb: float) -> dict[str, list[str]]:
    """The distinct lines of the bundled corpus with at least ``MIN_LINE_WORDS`` words, per domain."""
    from raysc.data.corpus import iter_documents

    pools: dict[str, dict[str, None]] = {"prose": {}, "code": {}}
    for doc in iter_documents(corpus_mb):
        for line in doc["text"].split("\n"):
            line = line.rstrip()
            if len(line.split()) >= MIN_LINE_WORDS:
                pools[doc["domain"]].setdefault(line)
    return {dom: list(lines) for dom, lines in pools.items()}


class Synth:
    """Documents of a ``SynthSpec``: ``document(i)`` and the truth pair of a copy."""

    def __init__(self, spec: SynthSpec, pools: dict[str, list[str]] | None = None) -> None:
        if spec.near_frac + spec.exact_frac >= 0.9:
            raise ValueError("near_frac + exact_frac must leave base documents (< 0.9)")
        self.spec = spec
        self.pools = pools or line_pools(spec.corpus_mb)

    def _rng(self, i: int) -> random.Random:
        return random.Random(f"{self.spec.seed}:{i}")  # str seeds hash with SHA-512: stable across processes

    def doc_id(self, i: int) -> str:
        return f"syn{self.spec.seed}-{i:09d}"

    def role(self, i: int) -> str:
        """'base', 'near' or 'exact'; the first document is always a base."""
        u = self._rng(i).random()
        if i == 0 or u >= self.spec.near_frac + self.spec.exact_frac:
            return "base"
        return "exact" if u < self.spec.exact_frac else "near"

    def base_text(self, i: int) -> tuple[str, str]:
        """(text, domain) of base document ``i``."""
        rng = self._rng(i)
        rng.random()  # the role draw
        domain = "code" if rng.random() < 0.3 else "prose"
        pool = self.pools[domain]
        want = rng.randint(MIN_WORDS, MAX_WORDS)
        lines, n = [], 0
        while n < want:
            line = pool[rng.randrange(len(pool))]
            lines.append(line)
            n += len(line.split())
        return ("\n" if domain == "code" else " ").join(lines), domain

    def original(self, i: int, rng: random.Random) -> int:
        """A base document before ``i``, drawn with ``rng``."""
        while True:
            j = rng.randrange(i)
            if self.role(j) == "base":
                return j

    def document(self, i: int) -> tuple[dict, dict | None]:
        """Document ``i`` and, for a copy, its truth pair {original, copy, kind, target, jaccard}."""
        role = self.role(i)
        if role == "base":
            text, domain = self.base_text(i)
            return {"id": self.doc_id(i), "text": text, "domain": domain}, None
        rng = self._rng(i)
        rng.random()
        j = self.original(i, rng)
        base, domain = self.base_text(j)
        if role == "exact":
            text = "  " + base.replace(" ", "  ", 3) + " \n\n\n"  # equal after inputs.normalise
            target = sim = 1.0
        else:
            target = rng.choice(NEAR_TARGETS)
            text = rewrite(base, target, self.spec.shingle, rng)
            sim = round(jaccard(base, text, self.spec.shingle), 4)
        doc = {"id": self.doc_id(i), "text": text, "domain": domain}
        return doc, {"original": self.doc_id(j), "copy": doc["id"], "kind": role, "target": target, "jaccard": sim}

    def __iter__(self) -> Iterator[tuple[dict, dict | None]]:
        return (self.document(i) for i in range(self.spec.docs))


FINEWEB_DUMP = "CC-MAIN-2024-10"


def fineweb_row(doc: dict, i: int) -> dict:
    """``doc`` with FineWeb's metadata columns (made up, deterministic in ``i``; see module doc)."""
    return {
        "text": doc["text"],
        "id": doc["id"],
        "dump": FINEWEB_DUMP,
        "url": f"https://{doc['domain']}.example.org/{doc['id']}",
        "date": "2024-02-21T00:00:00Z",
        "file_path": f"s3://commoncrawl/crawl-data/{FINEWEB_DUMP}/segments/{i // 10_000:05d}.warc.gz",
        "language": "en",
        "language_score": round(0.65 + (i * 7919 % 3400) / 10_000, 4),
        "token_count": len(doc["text"].encode()) // 4,
        "domain": doc["domain"],
    }


def write_corpus(spec: SynthSpec, out: str | Path, fmt: str = "jsonl", shard_docs: int = 50_000, log=print) -> dict:
    """Stream the corpus of ``spec`` to ``out`` (shards, truth.jsonl, meta.json); returns the meta."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"format must be jsonl or parquet, not {fmt!r}")
    out = Path(out)
    (out / "docs").mkdir(parents=True, exist_ok=True)
    counts = {"base": 0, "near": 0, "exact": 0}
    n_bytes, shard, rows = 0, 0, []

    def flush() -> None:
        nonlocal shard, rows
        path = out / "docs" / f"part-{shard:05d}.{fmt}"
        if fmt == "jsonl":
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        else:
            pq.write_table(pa.Table.from_pylist(rows), path)
        shard, rows = shard + 1, []

    with open(out / "truth.jsonl", "w", encoding="utf-8") as truth:
        for i, (doc, pair) in enumerate(Synth(spec)):
            rows.append(doc if fmt == "jsonl" else fineweb_row(doc, i))
            n_bytes += len(doc["text"].encode())
            counts[pair["kind"] if pair else "base"] += 1
            if pair:
                truth.write(json.dumps(pair) + "\n")
            if len(rows) == shard_docs:
                flush()
                log(f"synth: {i + 1}/{spec.docs} documents")
    if rows:
        flush()
    meta = {"spec": asdict(spec), "format": fmt, "shards": shard, "bytes": n_bytes, "roles": counts}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def read_truth(out: str | Path) -> list[dict]:
    """The duplicate pairs a corpus directory written by ``write_corpus`` records."""
    with open(Path(out) / "truth.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a synthetic corpus with known duplicates (see module doc).")
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--near-frac", type=float, default=0.10)
    ap.add_argument("--exact-frac", type=float, default=0.05)
    ap.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    ap.add_argument("--shard-docs", type=int, default=50_000)
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    a = ap.parse_args(argv)
    spec = SynthSpec(a.docs, a.seed, a.near_frac, a.exact_frac, corpus_mb=a.corpus_mb)
    print(json.dumps(write_corpus(spec, a.out, a.format, a.shard_docs)))


if __name__ == "__main__":
    main()
