"""``raysc curate``: a Ray Data pipeline from raw documents to curated Parquet and a report.

Stages (each a Ray Data transform, so it scales with the cluster; each takes a Dataset and
returns the next one with its stats):

1. read (``stages.read_documents``, parsing in ``inputs``): JSONL, Parquet or plain-text files
   from any fsspec URI, one task per file; a malformed JSON line, non-UTF-8 bytes, a missing field
   or an empty document is counted, sampled into the report and skipped; the text is normalised
   (Unicode NFC, whitespace), hashed, given the input id (or the hash) and the domain from the
   input's field or tagged by rules (code / prose);
2. exact dedup (``stages.exact_dedup``): group by content hash, one survivor (smallest id);
3. near dedup (``near_dedup``): MinHash signatures and LSH band keys (``raysc.curate.minhash``),
   buckets by group-by on the band key, candidate pairs, clusters by connected components
   (``graph.connected_components``: the hash-to-min algorithm, all group-bys, no single process
   holds the graph), one survivor per cluster (smallest id), the rest removed;
4. quality (``stages.quality_filter``): Gopher, C4 and FineWeb measurements on every document and
   a keep/drop verdict with the failing rule (``raysc.curate.quality``);
5. write (``stages.write_documents``, ``output``): Parquet of the kept documents
   (``documents/``), of the dropped ones with their reason (``dropped/``), and ``report.json`` +
   PNG charts.
"""

from __future__ import annotations

import time
from typing import Callable

from raysc.config.schema import Config
from raysc.curate.inputs import list_inputs
from raysc.curate.near_dedup import NearStats, near_dedup
from raysc.curate.output import write_report
from raysc.curate.stages import (QualityStats, ReadStats, WriteStats, exact_dedup, quality_filter, read_documents,
                                 write_documents)


class Stopwatch:
    """Seconds per stage: each ``lap`` records the time since the previous one."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.last, 3)
        self.last = now

    def total(self) -> float:
        return round(time.perf_counter() - self.start, 3)


def curate(cfg: Config, log: Callable[[str], None] = print) -> dict:
    """Run every stage over ``curate.input``; write Parquet and the report under ``curate.output``.
    Returns the report. Needs a running Ray (``ray.init()`` or a cluster)."""
    c = cfg.curate
    out_uri = cfg.curated_uri
    clock = Stopwatch()
    _, options, files = list_inputs(cfg)
    log(f"curate: {len(files)} input file(s) from {c.input}")
    docs, read = read_documents(files, options, c, log)
    clock.lap("read_normalise")
    docs, n_exact = exact_dedup(docs, read.documents, cfg.dedup, log)
    clock.lap("exact_dedup")
    docs, near = near_dedup(docs, n_exact, cfg.dedup, log)
    clock.lap("near_dedup")
    kept, dropped, quality = quality_filter(docs, near.documents, cfg.quality)
    clock.lap("quality")
    written = write_documents(kept, dropped, out_uri, options)
    clock.lap("write")
    report = build_report(cfg, out_uri, len(files), read, n_exact, near, quality, written, clock)
    write_report(report, out_uri, options)
    n_read = read.documents + read.bad
    log(f"curate: kept {written.kept} of {n_read} documents ({written.kept_bytes / 1e6:.2f} MB) -> {out_uri}")
    return report


def build_report(cfg: Config, out_uri: str, files: int, read: ReadStats, n_exact: int, near: NearStats,
                 quality: QualityStats, written: WriteStats, clock: Stopwatch) -> dict:
    """The ``report.json`` of a run from the stats of its stages."""
    d = cfg.dedup
    return {
        "input": cfg.curate.input, "output": out_uri, "files": files,
        "documents": {"read": read.documents + read.bad, "bad_input": read.bad, "after_exact_dedup": n_exact,
                      "after_near_dedup": near.documents, "kept": written.kept},
        "removed": {"bad_input": read.bad, "exact_duplicates": read.documents - n_exact,
                    "near_duplicates": near.removed, "quality": near.documents - written.kept},
        "bad_input": {"by_reason": read.bad_by_reason,
                      "samples": [{"where": r["source"], "reason": r["bad"], "sample": r["sample"]}
                                  for r in read.bad_samples]},
        "near_dedup": {"clusters": near.clusters, "cc_rounds": near.rounds, "num_perm": d.num_perm,
                       "bands": d.bands, "rows": d.rows, "shingle": d.shingle},
        "quality": {"enabled": quality.enabled, "dropped_by_rule": quality.dropped_by_rule,
                    "histograms": quality.histograms},
        "domains": written.domains, "kept_bytes": written.kept_bytes, "seconds": clock.laps,
        "seconds_total": clock.total(),
    }
