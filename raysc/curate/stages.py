"""The curation stages other than dedup (``raysc.curate.dedup``): read, quality (the rules, and the
reference model's perplexity from ``raysc.curate.perplexity``), write. Each
takes a Ray Dataset (and its row count) and returns the next Dataset with its
stats, so ``raysc.curate.pipeline`` reads as the list of stages. Also the stages' shared
Ray Data helpers: per-value counts (``count_by``, ``totals_by``) and the check of Ray Data's
"no available CPUs" warning (``cpu_alarms_checked``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from raysc.config.schema import CurateConfig, QualityConfig
from raysc.curate.inputs import normalise_batch, parse_file_table
from raysc.curate.output import arrow_fs, clear_outputs
from raysc.curate.perplexity import judge_perplexity, report_fragment, score_documents, thresholds
from raysc.curate.quality import QualityRules

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

HIST_FIELDS = (
    "q_words",
    "q_avg_word_len",
    "q_alpha_words_ratio",
    "q_stop_words",
    "q_dup_line_frac",
    "q_top_2gram_frac",
    "q_dup_5gram_frac",
    "q_fw_line_punct_ratio",
    "q_fw_short_line_ratio",
    "q_c4_sentences",
)
HIST_SAMPLE = 200_000  # documents whose scores go into the report's histograms


def count_by(ds: Dataset, key: str, weight: str | None = None) -> dict:
    """{value of ``key``: rows} of a Dataset, or the sum of column ``weight`` per value (``totals_by``)."""
    return {k: v[1 if weight else 0] for k, v in totals_by(ds, key, weight).items()}


def totals_by(ds: Dataset, key: str, weight: str | None = None) -> dict[str, tuple[int, int]]:
    """{value of ``key``: (rows, sum of column ``weight`` or 0)} of a Dataset, in one pass. Per-block
    partial counts summed here (a few values): a Ray Data aggregate would start a hash shuffle,
    seconds of fixed cost for a handful of numbers."""
    import pyarrow as pa

    def partial(t: pa.Table) -> pa.Table:
        g = t.group_by(key).aggregate([(key, "count")] + ([(weight, "sum")] if weight else []))
        return pa.table(
            {
                "k": g[key].cast(pa.string()),
                "n": g[f"{key}_count"].cast(pa.int64()),
                "w": g[f"{weight}_sum"].cast(pa.int64()) if weight else pa.nulls(len(g), pa.int64()),
            }
        )

    totals: dict = {}
    for row in ds.map_batches(partial, batch_format="pyarrow", batch_size=None).take_all():
        n, w = totals.get(row["k"], (0, 0))
        totals[row["k"]] = (n + row["n"], w + (row["w"] or 0))
    return totals


def _cpu_shows_free(timeout_s: float) -> bool:
    """Whether Ray shows a free CPU within ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s
    while not ray.available_resources().get("CPU"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class _FalseCpuAlarm(logging.Filter):
    """Drops Ray Data's warning that "the Ray cluster currently does not have any available CPUs" (the
    job "will hang") when a CPU shows free within 2 s. Ray's view of its free resources lags tasks that
    just ended by a report period, and Ray Data checks it as an execution starts: on 2 cores, right after
    a stage that kept both busy (the read, the write), it warned of a hang that never came. A real
    shortage (actors holding every CPU) outlasts the wait and is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not have any available CPUs" not in record.getMessage() or not _cpu_shows_free(2.0)


@contextmanager
def cpu_alarms_checked() -> Iterator[None]:
    """Within: Ray Data's "no available CPUs" warning only when it is true (``_FalseCpuAlarm``)."""
    logger, check = logging.getLogger("ray.data.dataset"), _FalseCpuAlarm()
    logger.addFilter(check)
    try:
        yield
    finally:
        logger.removeFilter(check)


# ---- read ----
def _read_files(batch: pa.Table, args: tuple, derive: Callable[[pa.Table], pa.Table] | None) -> pa.Table:
    """The files of a batch of URIs parsed (``inputs.parse_file_table``), normalised
    (``inputs.normalise_batch``) and given ``derive``'s columns, in one task."""
    import pyarrow as pa

    docs = normalise_batch(pa.concat_tables([parse_file_table(uri, *args) for uri in batch["uri"].to_pylist()]))
    return derive(docs) if derive else docs


@dataclass(frozen=True)
class ReadStats:
    """After reading: good documents, bad input records, bad records per reason and a sample."""

    documents: int
    bad: int
    bad_by_reason: dict[str, int]
    bad_samples: list[dict]


def read_documents(
    files: list[str],
    options: dict,
    c: CurateConfig,
    log: Callable[[str], None] = print,
    derive: Callable[[pa.Table], pa.Table] | None = None,
) -> tuple[Dataset, ReadStats]:
    """Parsed and normalised documents of ``files`` (one task per file) and the read stats; bad
    records are counted, sampled (``curate.bad_samples``) and left out. ``derive`` adds columns to each
    batch of normalised documents in the same task (the dedup keys: ``raysc.curate.dedup.keyer``)."""
    import ray
    from ray.data.expressions import col

    files_ds = ray.data.from_items([{"uri": f} for f in files], override_num_blocks=min(len(files), 64))
    # Ray Data's per-operator reservations ran the write's and the counts' tasks one at a time on 2 CPUs
    # (0.46 s against 0.22 for 20 blocks); every Dataset derived from this one inherits the setting, this
    # process's other Datasets do not. The perplexity scorer's actor pool turns it back on for itself.
    files_ds.context.op_resource_reservation_enabled = False
    args = (options, c.text_field, c.id_field, c.domain_field, c.url_field)
    parsed = files_ds.map_batches(
        _read_files, fn_args=(args, derive), batch_format="pyarrow", batch_size=1
    ).materialize()
    by_reason = count_by(parsed, "bad")  # "" counts the good documents
    n_good = by_reason.pop("", 0)
    n_bad = sum(by_reason.values())
    if n_bad:  # Arrow kernels, not a Python call per row
        docs = parsed.filter(expr=col("bad") == "").drop_columns(["bad", "sample"]).materialize()
        samples = parsed.filter(expr=col("bad") != "").take(c.bad_samples)
    else:  # no pass over the documents to filter nothing out (0.5-0.8 s at 100k documents)
        docs, samples = parsed.drop_columns(["bad", "sample"]), []
    stats = ReadStats(n_good, n_bad, by_reason, samples)
    log(f"curate: {stats.documents} documents, {n_bad} bad input record(s) skipped")
    return docs, stats


# ---- quality ----
@dataclass(frozen=True)
class QualityStats:
    """After the quality verdict: whether it filters, dropped documents per rule, score histograms."""

    enabled: bool
    dropped_by_rule: dict[str, int]
    histograms: dict[str, dict]
    perplexity: dict | None = None  # the reference model and the per-domain percentiles, when scored
    note: str = ""  # why nothing was measured, when nothing was


QUALITY_SKIPPED = (
    "quality.enabled = false and no quality.reference_run: no measurement computed, no q_* "
    "columns, no histograms (set quality.enabled = true to measure, and filter)"
)


def judge_batch(batch: dict, rules: QualityRules, enabled: bool, ppl_limits: dict | None = None) -> dict:
    """The batch with every measurement as a ``q_`` column, ``q_keep`` and ``q_reason``; with the
    filter off every document is kept (the scores are still reported). With ``ppl_limits`` (a scored
    batch, ``perplexity.thresholds``) also the perplexity bucket and verdict."""
    verdicts = rules.judge_batch(list(batch["text"]), list(batch["domain"]))
    out = dict(batch)
    for key in verdicts[0]:
        out["q_" + key] = np.array([v[key] for v in verdicts])
    if not enabled:
        out["q_keep"] = np.ones(len(verdicts), dtype=bool)
        out["q_reason"] = np.array([""] * len(verdicts), dtype=object)
    if ppl_limits is not None:
        judge_perplexity(out, ppl_limits)
    return out


def quality_filter(
    docs: Dataset, count: int, q: QualityConfig, log: Callable[[str], None] = print
) -> tuple[Dataset, Dataset | None, QualityStats]:
    """(kept, dropped or None, stats): the Gopher, C4 and FineWeb verdict on every document, and
    with ``quality.reference_run`` the reference model's perplexity (``raysc.curate.perplexity``)."""
    rules = QualityRules.from_config(q)
    if not count:
        return docs, None, QualityStats(q.enabled, {}, {})
    if not q.enabled and not q.reference_run:  # no rule and no score asked for: measure nothing
        return docs, None, QualityStats(False, {}, {}, note=QUALITY_SKIPPED)
    limits, scored_by = None, None
    if q.reference_run:
        docs, ref = score_documents(docs, q, log)
        limits = thresholds(docs, count, q)
        scored_by = report_fragment(ref, q, limits)
    judged = docs.map_batches(
        judge_batch, batch_format="numpy", fn_kwargs={"rules": rules, "enabled": q.enabled, "ppl_limits": limits}
    ).materialize()
    from ray.data.expressions import col

    kept = judged.filter(expr=col("q_keep"))  # Arrow kernels, not a Python call per row
    dropped = judged.filter(expr=~col("q_keep"))
    reasons = count_by(dropped, "q_reason") if dropped.count() else {}
    fields = HIST_FIELDS + (("q_ppl",) if limits is not None else ())
    return kept, dropped, QualityStats(q.enabled, reasons, histograms(judged, count, fields), scored_by)


def histograms(judged: Dataset, count: int, fields: tuple[str, ...] = HIST_FIELDS) -> dict[str, dict]:
    """20-bin histograms of the ``fields`` scores over the first ``HIST_SAMPLE`` documents (finite values)."""
    sample = judged.select_columns(list(fields)).take_batch(min(count, HIST_SAMPLE), batch_format="numpy")
    hists = {}
    for f in fields:
        values = np.asarray(sample[f], dtype=np.float64)
        counts, edges = np.histogram(values[np.isfinite(values)], bins=20)
        hists[f[2:]] = {"counts": counts.tolist(), "edges": [round(float(x), 4) for x in edges]}
    return hists


# ---- write ----
@dataclass(frozen=True)
class WriteStats:
    """What was written: kept documents, per domain, and their bytes."""

    kept: int
    domains: dict[str, int]
    kept_bytes: int


def write_documents(kept: Dataset, dropped: Dataset | None, out_uri: str, options: dict) -> WriteStats:
    """Replace ``documents/`` (and ``dropped/``, with the reason) under ``out_uri`` by Parquet."""
    kept = kept.drop_columns(["node"])  # not materialized: the write and the totals each filter again (cheap)
    clear_outputs(out_uri, options)
    kept.write_parquet(f"{out_uri}/documents", filesystem=arrow_fs(out_uri, options))
    if dropped is not None and dropped.count():
        dropped.drop_columns(["node"]).write_parquet(f"{out_uri}/dropped", filesystem=arrow_fs(out_uri, options))
    totals = totals_by(kept, "domain", "bytes")  # one pass: documents and bytes per domain
    return WriteStats(
        sum(n for n, _ in totals.values()), {d: n for d, (n, _) in totals.items()}, sum(b for _, b in totals.values())
    )
