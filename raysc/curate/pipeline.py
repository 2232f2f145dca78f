"""``raysc curate``: a Ray Data pipeline from raw documents to curated Parquet and a report.

Stages (each a Ray Data transform, so it scales with the cluster; each takes a Dataset and
returns the next one with its stats):

1. read (``stages.read_documents``, parsing in ``inputs``): JSONL, Parquet or plain-text files
   from any fsspec URI, one task per file; a malformed JSON line, non-UTF-8 bytes, a missing field
   or an empty document is counted, sampled into the report and skipped; the text is normalised
   (Unicode NFC, whitespace), hashed, given the input id (or the hash) and the domain from the
   input's field or tagged by rules (code / prose); in the same task, the document's dedup keys
   (``dedup.keyer``);
2. dedup (``dedup``): exact copies (same content hash) and near duplicates (MinHash signatures
   and LSH band keys, ``raysc.curate.minhash``) gathered in one task up to ``dedup.GATHER_MAX_DOCS``
   documents, else in one hash shuffle of small key rows, verified pairs reduced to a forest by a
   union-find per partition, clusters by connected components
   (``graph.components``: one union-find task up to ``GATHER_MAX_EDGES`` forest edges, else
   hash-to-min rounds), one survivor per cluster (smallest id), the rest removed by a broadcast
   filter;
3. quality (``stages.quality_filter``): Gopher, C4 and FineWeb measurements on every document and
   a keep/drop verdict with the failing rule (``raysc.curate.quality``); with
   ``quality.reference_run``, first each document's perplexity under a reference model by a pool of
   scorer actors, its head/middle/tail bucket per domain and an optional percentile filter
   (``raysc.curate.perplexity``, CCNet's recipe); with ``quality.enabled = false`` and no reference,
   nothing is measured (the report says so under ``quality.skipped``);
4. write (``stages.write_documents``, ``output``): Parquet of the kept documents
   (``documents/``), of the dropped ones with their reason (``dropped/``), and ``report.json`` +
   PNG charts.

A run makes no shuffle up to ``dedup.GATHER_MAX_DOCS`` documents, else one, of the dedup key rows
(``report.json``: ``near_dedup.shuffles``, with the ones a huge graph would add), never one of the text; stats are per-block partial counts. Progress: Ray
Data's own progress bars for every operator, and one log line per stage with its seconds;
``report.json`` ends with the per-stage table (``stages``: seconds and documents after it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raysc.cluster.fit import require_fit
from raysc.config.schema import Config
from raysc.curate.dedup import DedupStats, dedup, keyer
from raysc.curate.inputs import list_inputs
from raysc.curate.output import write_report
from raysc.curate.perplexity import check_reference
from raysc.curate.stages import (
    QualityStats,
    ReadStats,
    WriteStats,
    cpu_alarms_checked,
    quality_filter,
    read_documents,
    write_documents,
)


class Stopwatch:
    """Seconds per stage: each ``lap`` records the time since the previous one and the documents
    left after the stage, and logs them."""

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.table: list[dict] = []
        self.log = log

    def lap(self, name: str, documents: int) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.last, 3)
        self.table.append({"stage": name, "seconds": self.laps[name], "documents": documents})
        self.log(f"curate: stage {name} done in {self.laps[name]:.1f} s, {documents} document(s) left")
        self.last = now

    def total(self) -> float:
        return round(time.perf_counter() - self.start, 3)


def curate(cfg: Config, log: Callable[[str], None] = print) -> dict:
    """Run every stage over ``curate.input``; write Parquet and the report under ``curate.output``.
    Returns the report. Needs a running Ray (``ray.init()`` or a cluster)."""
    out_uri = cfg.curated_uri
    if cfg.quality.reference_run:
        check_reference(cfg.quality.reference_run)  # before any work, not after read and dedup
        q = cfg.quality  # the scorer pool (raysc.curate.perplexity): raysc.cluster.fit's rule, before any work
        require_fit(
            "the perplexity scoring",
            {"GPU": q.score_gpus} if q.score_gpus else {"CPU": 1.0},
            q.score_actors,
            [f"lower quality.score_actors (now {q.score_actors})"]
            + (["set quality.score_gpus=0 to score on CPUs"] if q.score_gpus else []),
            log,
        )
    with cpu_alarms_checked():
        return _stages(cfg, out_uri, log)


def _stages(cfg: Config, out_uri: str, log: Callable[[str], None]) -> dict:
    """``curate``'s stages, in order; the report."""
    c = cfg.curate
    clock = Stopwatch(log)
    _, options, files = list_inputs(cfg)
    log(f"curate: {len(files)} input file(s) from {c.input}")
    docs, read = read_documents(files, options, c, log, derive=keyer(cfg.dedup))
    clock.lap("read_normalise", read.documents)
    docs, near = dedup(docs, read.documents, cfg.dedup, log)
    clock.lap("dedup", near.documents)
    kept, dropped, quality = quality_filter(docs, near.documents, cfg.quality, log)
    clock.lap("quality", near.documents - sum(quality.dropped_by_rule.values()))
    written = write_documents(kept, dropped, out_uri, options)
    clock.lap("write", written.kept)
    report = build_report(cfg, out_uri, len(files), read, near, quality, written, clock)
    write_report(report, out_uri, options)
    n_read = read.documents + read.bad
    log(f"curate: kept {written.kept} of {n_read} documents ({written.kept_bytes / 1e6:.2f} MB) -> {out_uri}")
    return report


def build_report(
    cfg: Config,
    out_uri: str,
    files: int,
    read: ReadStats,
    near: DedupStats,
    quality: QualityStats,
    written: WriteStats,
    clock: Stopwatch,
) -> dict:
    """The ``report.json`` of a run from the stats of its stages."""
    d = cfg.dedup
    return {
        "input": cfg.curate.input,
        "output": out_uri,
        "files": files,
        "documents": {
            "read": read.documents + read.bad,
            "bad_input": read.bad,
            "after_exact_dedup": read.documents - near.exact_removed,
            "after_near_dedup": near.documents,
            "kept": written.kept,
        },
        "removed": {
            "bad_input": read.bad,
            "exact_duplicates": near.exact_removed,
            "near_duplicates": near.near_removed,
            "quality": near.documents - written.kept,
        },
        "bad_input": {
            "by_reason": read.bad_by_reason,
            "samples": [{"where": r["source"], "reason": r["bad"], "sample": r["sample"]} for r in read.bad_samples],
        },
        "near_dedup": {
            "clusters": near.clusters,
            "cc_rounds": near.rounds,
            "shuffles": near.shuffles,
            "minhash": d.minhash,
            "num_perm": d.num_perm,
            "bands": d.bands,
            "rows": d.rows,
            "shingle": d.shingle,
        },
        "quality": {
            "enabled": quality.enabled,
            "dropped_by_rule": quality.dropped_by_rule,
            "histograms": quality.histograms,
            "perplexity": quality.perplexity,
            **({"skipped": quality.note} if quality.note else {}),
        },
        "domains": written.domains,
        "kept_bytes": written.kept_bytes,
        "seconds": clock.laps,
        "seconds_total": clock.total(),
        "stages": clock.table,
    }
