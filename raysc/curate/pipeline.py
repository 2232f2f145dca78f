"""``raysc curate``: a Ray Data pipeline from raw documents to curated Parquet and a report.

Stages (each a Ray Data transform, so it scales with the cluster):

1. read: JSONL, Parquet or plain-text files from any fsspec URI, one task per file; a
   malformed JSON line, non-UTF-8 bytes, a missing field or an empty document is counted,
   sampled into the report and skipped;
2. normalise: Unicode NFC, whitespace, a content hash, the input id kept (or the hash),
   the domain from the input's field or tagged by rules (code / prose);
3. exact dedup: group by content hash, one survivor (smallest id);
4. near dedup: MinHash signatures and LSH band keys (``raysc.curate.minhash``), buckets by
   group-by on the band key, candidate edges, clusters by connected components
   (``connected_components``: the hash-to-min algorithm, all group-bys, no single process
   holds the graph), one survivor per cluster (smallest id), the rest removed by an anti-join;
5. quality: Gopher, C4 and FineWeb measurements on every document and a keep/drop verdict
   with the failing rule (``raysc.curate.quality``);
6. write: Parquet of the kept documents (``documents/``), of the dropped ones with their reason
   (``dropped/``), and ``report.json`` + PNG charts.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import unicodedata
from pathlib import Path

import numpy as np

from raysc.config.schema import Config
from raysc.curate.minhash import MinHasher
from raysc.curate.quality import QualityRules

TEXT_SUFFIXES = (".txt", ".md", ".text")
_SPACES = re.compile(r"[ \t\f\v\u00a0\u2000-\u200b\u3000]+")
_BLANKS = re.compile(r"\n{3,}")
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|#include|"
                        r"[{}]$|.*;$|@\w+)")
HIST_FIELDS = ("q_words", "q_avg_word_len", "q_alpha_words_ratio", "q_stop_words", "q_dup_line_frac",
               "q_top_2gram_frac", "q_dup_5gram_frac", "q_fw_line_punct_ratio", "q_fw_short_line_ratio",
               "q_c4_sentences")


class CurateError(RuntimeError):
    """The curation input or output cannot be used; the message says why and what to do."""


# ---- inputs ----
def list_inputs(cfg: Config) -> tuple[str, dict, list[str]]:
    """(URI prefix, fsspec options, files) of ``curate.input``."""
    import fsspec

    c = cfg.curate
    if c.input == "bundled":
        from raysc.data.corpus import build_bundled_corpus

        return "", {}, [str(build_bundled_corpus(cfg.data.cache_dir, cfg.data.max_corpus_mb))]
    fs, path = fsspec.core.url_to_fs(c.input, **c.storage_options)
    protocol = fsspec.utils.get_protocol(c.input)
    prefix = "" if protocol in ("file", "local") else f"{protocol}://"
    if any(ch in path for ch in "*?["):
        files = sorted(fs.glob(path))
    elif fs.isdir(path):
        files = sorted(f for f in fs.find(path) if f.endswith((".jsonl", ".json", ".parquet", *TEXT_SUFFIXES)))
    elif fs.exists(path):
        files = [path]
    else:
        raise CurateError(f"curate.input {c.input!r} does not exist; give a file, a directory or a glob "
                          f"of .jsonl / .parquet / .txt files (or 'bundled').")
    if not files:
        raise CurateError(f"curate.input {c.input!r} holds no .jsonl, .parquet or text files.")
    return prefix, dict(c.storage_options), [f"{prefix}{f}" for f in files]


def _bad(where: str, reason: str, sample: str) -> dict:
    return {"id": "", "text": "", "domain": "", "source": where, "bad": reason, "sample": sample[:200]}


def parse_file(uri: str, options: dict, text_field: str, id_field: str, domain_field: str) -> list[dict]:
    """Every record of one input file; bad ones as rows with ``bad`` set to the reason."""
    import fsspec

    with fsspec.open(uri, "rb", **options) as f:
        data = f.read()
    rows: list[dict] = []
    name = uri.rsplit("/", 1)[-1]
    if uri.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        if text_field not in table.column_names:
            return [_bad(uri, f"missing field '{text_field}'", ", ".join(table.column_names))]
        cols = table.to_pydict()
        for i, text in enumerate(cols[text_field]):
            where = f"{name}:{i}"
            if not isinstance(text, str):
                rows.append(_bad(where, f"field '{text_field}' is not a string", repr(text)))
                continue
            rows.append({"id": str(cols[id_field][i]) if id_field in cols and cols[id_field][i] is not None else "",
                         "text": text, "domain": str(cols.get(domain_field, [""] * (i + 1))[i] or ""),
                         "source": where, "bad": "", "sample": ""})
        return rows
    if uri.endswith(TEXT_SUFFIXES):
        try:
            return [{"id": "", "text": data.decode("utf-8"), "domain": "", "source": name, "bad": "",
                     "sample": ""}]
        except UnicodeDecodeError as e:
            return [_bad(name, f"not UTF-8 ({e.reason} at byte {e.start})", data[:200].decode("utf-8", "replace"))]
    for n, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            rec = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            rows.append(_bad(where, f"not UTF-8 ({e.reason} at byte {e.start})", line.decode("utf-8", "replace")))
            continue
        except json.JSONDecodeError as e:
            rows.append(_bad(where, f"malformed JSON ({e.msg})", line.decode("utf-8", "replace")))
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
            rows.append(_bad(where, f"missing or non-string field '{text_field}'", line.decode("utf-8", "replace")))
            continue
        rows.append({"id": str(rec.get(id_field) or ""), "text": rec[text_field],
                     "domain": str(rec.get(domain_field) or ""), "source": where, "bad": "", "sample": ""})
    return rows


# ---- normalisation and tagging ----
def normalise(text: str) -> str:
    """NFC, runs of spaces (including non-breaking and ideographic ones) to one, trailing spaces
    dropped, at most one blank line in a row, no leading or trailing blank lines."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(_SPACES.sub(" ", line).rstrip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


def tag_domain(text: str) -> str:
    """'code' when at least 30% of the non-blank lines look like source code, else 'prose'."""
    lines = [ln for ln in text.split("\n") if ln.strip()]
    if not lines:
        return "prose"
    return "code" if sum(bool(_CODE_LINE.match(ln)) for ln in lines) / len(lines) >= 0.3 else "prose"


def _normalise_batch(batch: dict) -> dict:
    texts, ids, domains, bad = [], [], [], []
    hashes = []
    for text, doc_id, domain, reason in zip(batch["text"], batch["id"], batch["domain"], batch["bad"]):
        t = normalise(text) if not reason else ""
        if not reason and not t:
            reason = "empty document"
        h = hashlib.sha1(t.encode()).hexdigest()
        texts.append(t)
        hashes.append(h)
        ids.append(str(doc_id) or h[:16])
        domains.append(str(domain) or (tag_domain(t) if t else ""))
        bad.append(reason)
    out = dict(batch)
    out.update(text=np.array(texts, dtype=object), id=np.array(ids, dtype=object),
               domain=np.array(domains, dtype=object), bad=np.array(bad, dtype=object),
               hash=np.array(hashes, dtype=object),
               node=np.array([f"{i}\x00{h[:16]}" for i, h in zip(ids, hashes)], dtype=object),
               bytes=np.array([len(t.encode()) for t in texts], dtype=np.int64))
    return out


# ---- connected components (hash-to-min) ----
def shuffle_partitions(rows: int) -> int:
    """Partitions of a group-by: about 2,000 rows each, at most 200 (Ray Data's default), so small
    inputs do not pay for hundreds of nearly empty shuffle tasks."""
    return max(1, min(200, rows // 2000))


def connected_components(edges, max_rounds: int, log=print):
    """Clusters of an undirected graph given as a Ray Dataset of (a, b) rows.

    Hash-to-min (Rastogi et al., "Finding connected components in map-reduce in logarithmic
    rounds", ICDE 2013): every node keeps a set C holding itself and the nodes it knows; each
    round it sends C to min(C) and min(C) to every other member; the sets are merged by a
    group-by. At the fixed point, min(C) of every node is the smallest node of its component.
    Returns a Dataset of (node, root) and the rounds used."""
    import pyarrow as pa

    def init(batch: dict) -> dict:
        a, b = batch["a"], batch["b"]
        return {"node": np.concatenate([a, b, a, b]), "member": np.concatenate([b, a, a, b])}

    def merge(group) -> "pa.Table":
        members = sorted(set(group["member"].to_pylist()))
        return pa.table({"node": [group["node"][0].as_py()], "members": [members]})

    def send(batch: dict) -> dict:
        nodes, members = [], []
        for node, c in zip(batch["node"], batch["members"]):
            c = list(c)
            m = c[0]  # sorted: the minimum
            nodes += [m] * len(c)
            members += c  # C(node) -> min(C)
            for y in c[1:]:
                nodes.append(y)
                members.append(m)  # min(C) -> every other member
            if node != m:
                nodes.append(node)
                members.append(m)  # and to the node itself, so no node drops out of the graph
        return {"node": np.array(nodes, dtype=object), "member": np.array(members, dtype=object)}

    def fingerprint(batch: dict) -> dict:
        return {"fp": np.array([int(hashlib.blake2b(f"{n}\x00{'|'.join(c)}".encode(), digest_size=6).hexdigest(), 16)
                                for n, c in zip(batch["node"], batch["members"])], dtype=np.int64)}

    parts = shuffle_partitions(4 * edges.count())
    state = edges.map_batches(init, batch_format="numpy").groupby("node", num_partitions=parts).map_groups(
        merge, batch_format="pyarrow").materialize()
    previous = None
    for rounds in range(1, max_rounds + 1):
        state = state.map_batches(send, batch_format="numpy").groupby("node", num_partitions=parts).map_groups(
            merge, batch_format="pyarrow").materialize()
        fp = state.map_batches(fingerprint, batch_format="numpy").sum("fp")
        log(f"  connected components: round {rounds}, {state.count()} nodes")
        if fp == previous:
            break
        previous = fp
    else:
        raise CurateError(f"connected components did not converge in dedup.max_rounds={max_rounds} rounds")
    roots = state.map_batches(lambda b: {"node": b["node"], "root": np.array([c[0] for c in b["members"]],
                                                                               dtype=object)},
                              batch_format="numpy")
    return roots, rounds


BROADCAST_MAX_IDS = 1_000_000  # up to this many removed ids are broadcast as a set, not shuffled


def drop_nodes(docs, losers, count: int):
    """``docs`` without the rows whose ``node`` is in ``losers``. Near duplicates are a small share
    of a corpus: up to ``BROADCAST_MAX_IDS`` ids go to every task as one object (a filter, no
    shuffle); beyond that, the shuffle-based ``anti_join``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    if count > BROADCAST_MAX_IDS:
        return anti_join(docs, losers, "node")
    ids_ref = ray.put(pa.concat_tables(ray.get(losers.to_arrow_refs()))["node"].combine_chunks())

    def keep(t: pa.Table) -> pa.Table:
        return t.filter(pc.invert(pc.is_in(t["node"], value_set=ray.get(ids_ref))))

    return docs.map_batches(keep, batch_format="pyarrow")


def anti_join(left, right, key: str):
    """Rows of ``left`` whose ``key`` is not in ``right`` (a Dataset with that one column), as a
    group-by over the union of both (Ray Data's own join needs polars, which we do not ship)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = left.schema().base_schema  # both sides need one schema for the shuffle

    def mark_left(t: pa.Table) -> pa.Table:
        return t.select(schema.names).append_column("_drop", pa.array([False] * len(t)))

    def mark_right(t: pa.Table) -> pa.Table:
        cols = {f.name: t[key].cast(f.type) if f.name == key else pa.nulls(len(t), f.type) for f in schema}
        return pa.table(cols, schema=schema).append_column("_drop", pa.array([True] * len(t)))

    marked_left = left.map_batches(mark_left, batch_format="pyarrow")
    marked_right = right.map_batches(mark_right, batch_format="pyarrow")

    def keep(group: pa.Table) -> pa.Table:
        if pc.any(group["_drop"]).as_py():
            return group.slice(0, 0).drop_columns(["_drop"])
        return group.drop_columns(["_drop"])

    parts = shuffle_partitions(left.count())
    return marked_left.union(marked_right).groupby(key, num_partitions=parts).map_groups(
        keep, batch_format="pyarrow")


# ---- the pipeline ----
def curate(cfg: Config, log=print) -> dict:
    """Run every stage over ``curate.input``; write Parquet and the report under ``curate.output``.
    Returns the report. Needs a running Ray (``ray.init()`` or a cluster)."""
    import ray

    c, d = cfg.curate, cfg.dedup
    out_uri = (c.output or f"{cfg.run_dir}/curated").rstrip("/")
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def stage(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 3)
        return now

    prefix, options, files = list_inputs(cfg)
    log(f"curate: {len(files)} input file(s) from {c.input}")
    files_ds = ray.data.from_items([{"uri": f} for f in files], override_num_blocks=min(len(files), 64))
    args = (options, c.text_field, c.id_field, c.domain_field)
    parsed = files_ds.flat_map(lambda r: parse_file(r["uri"], *args)).map_batches(
        _normalise_batch, batch_format="numpy").materialize()
    t = stage("read_normalise", t0)
    bad = parsed.filter(lambda r: bool(r["bad"]))
    docs = parsed.filter(lambda r: not r["bad"]).drop_columns(["bad", "sample"]).materialize()
    n_bad = bad.count()
    bad_rows = bad.take(c.bad_samples) if n_bad else []
    bad_reasons: dict[str, int] = {}
    if n_bad:
        for row in bad.groupby("bad", num_partitions=1).count().take_all():
            bad_reasons[row["bad"]] = row["count()"]
    n_in = docs.count()
    log(f"curate: {n_in} documents, {n_bad} bad input record(s) skipped")

    # exact dedup: one survivor per content hash (the smallest node key: id first)
    if d.exact and n_in:
        import pyarrow as pa
        import pyarrow.compute as pc

        def first(group: pa.Table) -> pa.Table:
            return group.take([int(pc.index(group["node"], pc.min(group["node"])).as_py())])

        docs = docs.groupby("hash", num_partitions=shuffle_partitions(n_in)).map_groups(
            first, batch_format="pyarrow").materialize()
    n_exact = docs.count()
    t = stage("exact_dedup", t)
    log(f"curate: exact dedup removed {n_in - n_exact}")

    # near dedup: MinHash-LSH candidates, connected components, one survivor per cluster
    clusters, rounds, removed_near = 0, 0, 0
    if d.near and n_exact > 1:
        hasher = MinHasher(d.num_perm, d.bands, d.rows, d.shingle, d.seed)

        def band_rows(batch: dict) -> dict:
            sig = hasher.signatures(list(batch["text"]))
            keys = hasher.band_keys(sig)
            return {"bucket": keys.ravel().view(np.int64),
                    "node": np.repeat(np.asarray(batch["node"], dtype=object), hasher.bands),
                    "sig": np.repeat(np.array([s.tobytes() for s in sig], dtype=object), hasher.bands)}

        threshold = d.threshold

        def bucket_edges(group) -> "pa.Table":
            """Candidate pairs of one LSH bucket, kept when their signatures agree on at least
            dedup.threshold of the hash functions (the estimated Jaccard similarity)."""
            import pyarrow as pa

            empty = pa.table({"a": pa.array([], pa.string()), "b": pa.array([], pa.string())})
            if group.num_rows < 2:  # most buckets: checked before any conversion
                return empty
            by_node = dict(zip(group["node"].to_pylist(), group["sig"].to_pylist()))
            nodes = sorted(by_node)
            if len(nodes) < 2:
                return empty
            sig = np.stack([np.frombuffer(by_node[n], dtype=np.uint32) for n in nodes])
            if len(nodes) <= 2048:  # every pair of the bucket
                est = (sig[:, None, :] == sig[None, :, :]).mean(axis=2)
                i, j = np.nonzero(np.triu(est >= threshold, k=1))
            else:  # a huge bucket: pairs with its smallest member only
                est = (sig[1:] == sig[0]).mean(axis=1)
                j = np.nonzero(est >= threshold)[0] + 1
                i = np.zeros_like(j)
            return pa.table({"a": [nodes[x] for x in i], "b": [nodes[x] for x in j]})

        parts = shuffle_partitions(n_exact * d.bands)
        edges = docs.map_batches(band_rows, batch_format="numpy").groupby("bucket", num_partitions=parts).map_groups(
            bucket_edges, batch_format="pyarrow").materialize()
        n_edges = edges.count()
        log(f"curate: near dedup: {n_edges} candidate pair(s) above dedup.threshold={d.threshold}")
        if n_edges:
            # a pair found in several bands repeats; connected components merges sets, so repeats are harmless
            roots, rounds = connected_components(edges, d.max_rounds, log)
            roots = roots.materialize()
            losers = roots.filter(lambda r: r["node"] != r["root"]).select_columns(["node"]).materialize()
            clusters = roots.filter(lambda r: r["node"] == r["root"]).count()
            removed_near = losers.count()
            if removed_near:
                docs = drop_nodes(docs, losers, removed_near).materialize()
    n_near = docs.count()
    t = stage("near_dedup", t)
    log(f"curate: near dedup removed {removed_near} in {clusters} cluster(s) ({rounds} rounds)")

    # quality
    rules = QualityRules.from_config(cfg.quality)
    enabled = cfg.quality.enabled

    def judge(batch: dict) -> dict:
        verdicts = [rules.judge(text, dom) for text, dom in zip(batch["text"], batch["domain"])]
        out = dict(batch)
        for key in verdicts[0]:
            out["q_" + key] = np.array([v[key] for v in verdicts])
        if not enabled:
            out["q_keep"] = np.ones(len(verdicts), dtype=bool)
            out["q_reason"] = np.array([""] * len(verdicts), dtype=object)
        return out

    judged = docs.map_batches(judge, batch_format="numpy").materialize() if n_near else docs
    kept = judged.filter(lambda r: bool(r["q_keep"])) if n_near else docs
    dropped = judged.filter(lambda r: not r["q_keep"]) if n_near else None
    reasons: dict[str, int] = {}
    if dropped is not None and dropped.count():
        for row in dropped.groupby("q_reason", num_partitions=1).count().take_all():
            reasons[row["q_reason"]] = row["count()"]
    t = stage("quality", t)

    kept = kept.drop_columns(["node"]).materialize()
    n_kept = kept.count()
    _clear_outputs(out_uri, options)
    kept.write_parquet(f"{out_uri}/documents", filesystem=_arrow_fs(out_uri, options))
    if dropped is not None and dropped.count():
        dropped.drop_columns(["node"]).write_parquet(f"{out_uri}/dropped", filesystem=_arrow_fs(out_uri, options))
    domains = {r["domain"]: r["count()"] for r in kept.groupby("domain", num_partitions=1).count().take_all()} \
        if n_kept else {}
    kept_bytes = int(kept.sum("bytes")) if n_kept else 0
    t = stage("write", t)

    hists = {}
    if n_near:
        sample = judged.select_columns([f for f in HIST_FIELDS]).take_batch(min(n_near, 200_000), batch_format="numpy")
        for f in HIST_FIELDS:
            counts, edges_ = np.histogram(np.asarray(sample[f], dtype=np.float64), bins=20)
            hists[f[2:]] = {"counts": counts.tolist(), "edges": [round(float(x), 4) for x in edges_]}
    report = {
        "input": c.input, "output": out_uri, "files": len(files),
        "documents": {"read": n_in + n_bad, "bad_input": n_bad, "after_exact_dedup": n_exact,
                      "after_near_dedup": n_near, "kept": n_kept},
        "removed": {"bad_input": n_bad, "exact_duplicates": n_in - n_exact, "near_duplicates": removed_near,
                    "quality": n_near - n_kept},
        "bad_input": {"by_reason": bad_reasons,
                      "samples": [{"where": r["source"], "reason": r["bad"], "sample": r["sample"]} for r in bad_rows]},
        "near_dedup": {"clusters": clusters, "cc_rounds": rounds, "num_perm": d.num_perm, "bands": d.bands,
                       "rows": d.rows, "shingle": d.shingle},
        "quality": {"enabled": enabled, "dropped_by_rule": reasons, "histograms": hists},
        "domains": domains, "kept_bytes": kept_bytes, "seconds": timings,
        "seconds_total": round(time.perf_counter() - t0, 3),
    }
    _write_report(report, out_uri, options)
    log(f"curate: kept {n_kept} of {n_in + n_bad} documents ({kept_bytes / 1e6:.2f} MB) -> {out_uri}")
    return report


def _clear_outputs(out_uri: str, options: dict) -> None:
    """A re-run replaces the previous output (Ray Data adds files to an existing directory)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(out_uri, **options)
    for sub in ("documents", "dropped"):
        if fs.exists(f"{root}/{sub}"):
            fs.rm(f"{root}/{sub}", recursive=True)


def _arrow_fs(uri: str, options: dict):
    """A pyarrow file system over fsspec for Ray Data writes (credentials from ``options``)."""
    import fsspec
    import pyarrow.fs as pafs

    fs, _ = fsspec.core.url_to_fs(uri, **options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def _write_report(report: dict, out_uri: str, options: dict) -> None:
    """``report.json`` and two charts: quality-score histograms and documents removed per stage."""
    import fsspec
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fs, root = fsspec.core.url_to_fs(out_uri, **options)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/report.json", json.dumps(report, indent=1).encode())
    hists = report["quality"]["histograms"]
    if hists:
        fig, axes = plt.subplots(2, (len(hists) + 1) // 2, figsize=(3.2 * ((len(hists) + 1) // 2), 6))
        for ax, (name, h) in zip(axes.ravel(), hists.items()):
            ax.stairs(h["counts"], h["edges"], fill=True)
            ax.set_title(name, fontsize=9)
        _save_png(fig, fs, f"{root}/quality_histograms.png")
    fig, ax = plt.subplots(figsize=(6, 3))
    removed = report["removed"]
    ax.bar(list(removed), list(removed.values()))
    ax.set_ylabel("documents removed")
    _save_png(fig, fs, f"{root}/removed_by_stage.png")


def _save_png(fig, fs, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    fs.pipe_file(path, buf.getvalue())
