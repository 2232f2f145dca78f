"""Dedup at scale, its cheap parts: the synthetic corpus and its ground truth, the per-partition
kernel of the dedup shuffle (exact copies, verified band pairs, forest; vectorised, equal to the per-key
definition), and connected components by one union-find task or by hash-to-min rounds."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raysc.config.schema import DedupConfig
from raysc.curate.audit import pair_detected
from raysc.curate.dedup import bucket_forest, doc_keys, key_rows, similar_pairs
from raysc.curate.graph import forest_edges, union_find
from raysc.curate.inputs import normalise
from raysc.curate.minhash import MinHasher, jaccard
from raysc.curate.synth import Synth, SynthSpec, line_pools, read_truth, write_corpus


def test_synth_corpus_is_deterministic_streamed_and_its_truth_is_measured(tmp_path):
    """Same spec, same documents (jsonl or FineWeb-like parquet, any shard size); copies sort after their original;
    truth similarities are the measured ones; exact copies are equal once normalised; documents
    the truth does not pair share (almost) no shingles."""
    pools = line_pools(1.0)
    spec = SynthSpec(docs=300, seed=7, near_frac=0.2, exact_frac=0.1, corpus_mb=1.0)
    meta = write_corpus(spec, tmp_path / "a", shard_docs=128, log=lambda *_: None)
    write_corpus(spec, tmp_path / "b", fmt="parquet", shard_docs=1000, log=lambda *_: None)
    assert meta["shards"] == 3 and sum(meta["roles"].values()) == 300 and meta["roles"]["exact"] > 10
    a = [json.loads(line) for f in sorted((tmp_path / "a" / "docs").iterdir()) for line in f.open()]
    b = pq.read_table(tmp_path / "b" / "docs" / "part-00000.parquet").to_pylist()
    # the Parquet shards read like FineWeb's: its columns, the same documents
    assert set(b[0]) == {
        "text",
        "id",
        "dump",
        "url",
        "date",
        "file_path",
        "language",
        "language_score",
        "token_count",
        "domain",
    }
    assert b[5]["url"].endswith("/" + b[5]["id"]) and b[5]["token_count"] == len(b[5]["text"].encode()) // 4
    assert (
        a == [{k: d[k] for k in ("id", "text", "domain")} for d in b]
        and (tmp_path / "a" / "truth.jsonl").read_bytes() == (tmp_path / "b" / "truth.jsonl").read_bytes()
    )
    by_id = {d["id"]: d["text"] for d in a}
    truth = read_truth(tmp_path / "a")
    assert len(truth) == meta["roles"]["near"] + meta["roles"]["exact"]
    for p in truth:
        assert p["original"] < p["copy"]
        if p["kind"] == "exact":
            assert by_id[p["copy"]] != by_id[p["original"]]
            assert normalise(by_id[p["copy"]]) == normalise(by_id[p["original"]])
        else:
            assert abs(jaccard(by_id[p["original"]], by_id[p["copy"]]) - p["jaccard"]) < 1e-3
    assert {p["target"] for p in truth if p["kind"] == "near"} >= {0.3, 0.9}
    # one document regenerates alone (a copy re-derives its original: nothing is remembered)
    assert Synth(spec, pools).document(299)[0] == a[299]
    related = {frozenset((p["original"], p["copy"])) for p in truth}
    sig = MinHasher().signatures([normalise(d["text"]) for d in a])
    est = (sig[:, None, :] == sig[None, :, :]).mean(axis=2)
    i, j = np.nonzero(np.triu(est >= 0.3, k=1))
    stray = [(a[x]["id"], a[y]["id"]) for x, y in zip(i, j) if frozenset((a[x]["id"], a[y]["id"])) not in related]
    originals = {p["copy"]: p["original"] for p in truth}  # two copies of one original are related too
    assert all(originals.get(x, x) == originals.get(y, y) for x, y in stray), stray


def test_dedup_kernel_removes_exact_and_near_copies_only():
    """One partition holding every key (what the shuffle guarantees per key): exact copies become
    star edges to the smallest node, band pairs above the threshold a forest; the survivors of
    the union-find keep every original and no copy at similarity >= 0.85 and none at <= 0.5 lost."""
    spec = SynthSpec(docs=400, seed=3, near_frac=0.2, exact_frac=0.1, corpus_mb=1.0)
    docs, truth = [], []
    for doc, pair in Synth(spec, line_pools(1.0)):
        docs.append(doc)
        truth += [pair] if pair else []
    import hashlib

    texts = [normalise(d["text"]) for d in docs]
    batch = pa.table(
        {"text": texts, "node": [d["id"] for d in docs], "hash": [hashlib.sha1(t.encode()).hexdigest() for t in texts]}
    )
    d = DedupConfig()
    table = key_rows(doc_keys(batch, MinHasher(d.num_perm, d.bands, d.rows, d.shingle, d.seed), True, True))
    order = list(range(len(table)))
    random.Random(0).shuffle(order)  # a partition's rows come in any order
    edges = bucket_forest(table.take(order), d.threshold)
    exact = edges.filter(edges["exact"]).to_pydict()
    for part in (table.filter(table["exact"]), table.slice(0, 1)):  # partitions lacking one kind of edge
        assert bucket_forest(part, d.threshold).schema == edges.schema  # blocks of one schema
    first: dict[str, str] = {}
    for doc, t in zip(docs, texts):  # ids ascend: the first of a text is its survivor
        first.setdefault(t, doc["id"])
    copies = {doc["id"] for doc, t in zip(docs, texts) if first[t] != doc["id"]}
    assert sorted(exact["b"]) == sorted(copies) and {p["copy"] for p in truth if p["kind"] == "exact"} <= copies
    roots = union_find(edges["a"].to_pylist(), edges["b"].to_pylist())
    kept = {x["id"] for x in docs} - {n for n, r in roots.items() if n != r}
    high = [p for p in truth if p["jaccard"] >= 0.85]
    assert sum(pair_detected(p, kept) for p in high) / len(high) >= 0.95
    assert not any(pair_detected(p, kept) for p in truth if p["jaccard"] <= 0.5)
    assert {p["original"] for p in truth} <= kept


def bucket_forest_per_key(t: pa.Table, threshold: float) -> set:
    """``bucket_forest``'s definition, one key at a time in Python (what it was before it was vectorised):
    its edges as a set of (a, b, exact)."""
    keys: dict = {}
    for bucket, node, sig, exact in zip(*(t[c].to_pylist() for c in ("bucket", "node", "sig", "exact"))):
        keys.setdefault(bucket, []).append((node, sig, exact))
    near, copies = ([], []), set()
    for rows in keys.values():
        by_node = {n: s for n, s, _ in rows}
        nodes = sorted(by_node)
        if len(nodes) < 2:
            continue
        if rows[0][2]:  # a content hash: every copy pairs with the smallest node
            copies |= {(nodes[0], x, True) for x in nodes[1:]}
            continue
        sig = np.frombuffer(b"".join(by_node[x] for x in nodes), dtype=np.uint32).reshape(len(nodes), -1)
        i, j = similar_pairs(sig, threshold)
        near[0].extend(nodes[x] for x in i)
        near[1].extend(nodes[x] for x in j)
    forest = forest_edges(*near)
    return {(a, b, False) for a, b in zip(forest["a"].to_pylist(), forest["b"].to_pylist())} | copies


def test_the_vectorised_kernel_equals_the_per_key_definition():
    """Keys of two documents (compared at once), of many (one by one), a node twice in a key, exact keys,
    signatures on both sides of the threshold, rows in any order, and nothing to pair."""
    rng = np.random.default_rng(11)
    base = rng.integers(0, 2**32, size=(60, 112), dtype=np.uint64).astype(np.uint32)
    rows = []
    for k in range(400):
        members = rng.choice(60, size=int(rng.choice([1, 2, 2, 2, 3, 5])), replace=False)
        if rng.random() < 0.1:
            members = [*members, members[0]]  # a node twice in one key (two of its bands share a key)
        if rng.random() < 0.2:  # an exact key: empty signatures
            rows += [(10**9 + k, f"d{m:03d}", b"", True) for m in members]
            continue
        for m in members:
            sig = base[members[0]].copy()
            agree = rng.choice([0.5, 0.69, 0.7, 0.72, 0.9, 1.0])
            sig[rng.random(112) >= agree] += 1  # agrees with the key's first member on ~``agree`` of them
            rows.append((k, f"d{m:03d}", (base[m] if m == members[0] else sig).tobytes(), False))
    rows = [rows[i] for i in rng.permutation(len(rows))]
    table = pa.table(
        {
            "bucket": pa.array([r[0] for r in rows], pa.int64()),
            "node": [r[1] for r in rows],
            "sig": pa.array([r[2] for r in rows], pa.binary()),
            "exact": [r[3] for r in rows],
        }
    )
    # one signature per node: a node's rows in different keys carry its own signature (as key_rows makes them)
    sig_of = {}
    for r in rows:
        if r[2]:
            sig_of.setdefault(r[1], r[2])
    table = table.set_column(
        2,
        "sig",
        pa.array(
            [sig_of[n] if s else b"" for n, s in zip(table["node"].to_pylist(), table["sig"].to_pylist())], pa.binary()
        ),
    )
    got = bucket_forest(table, 0.7)
    edges = set(zip(got["a"].to_pylist(), got["b"].to_pylist(), got["exact"].to_pylist()))
    want = bucket_forest_per_key(table, 0.7)
    assert edges == want and len(want) > 50 and any(e[2] for e in want) and any(not e[2] for e in want)
    assert len(bucket_forest(table.slice(0, 0), 0.7)) == 0


def test_components_by_one_task_or_hash_to_min_agree(ray_session, monkeypatch):
    """Clusters of a random forest-like graph: the single union-find task (few edges) and the
    hash-to-min rounds (past GATHER_MAX_EDGES) give every node the smallest node of its component."""
    import raysc.curate.graph as graph

    rng = random.Random(5)
    a = [f"n{rng.randrange(24):02d}" for _ in range(16)]
    b = [f"n{rng.randrange(24):02d}" for _ in range(16)]
    want = union_find(a, b)
    edges = ray_session.data.from_items([{"a": x, "b": y} for x, y in zip(a, b)])
    gathered, rounds, shuffles = graph.components(edges, 16, 40, log=lambda *_: None)
    assert (rounds, shuffles) == (0, 0)
    monkeypatch.setattr(graph, "GATHER_MAX_EDGES", 8)
    spread, rounds, shuffles = graph.components(edges, 16, 40, log=lambda *_: None)
    assert rounds >= 1 and shuffles == rounds + 1
    for roots in (gathered, spread):
        assert {r["node"]: r["root"] for r in roots.take_all()} == want


def test_dedup_in_one_task_or_by_the_key_shuffle_keeps_the_same_documents(ray_session, monkeypatch):
    """Up to GATHER_MAX_DOCS documents their keys go to one task (no shuffle); past it, the hash
    shuffle of key rows. Both keep the same documents and count the same copies, whether dedup computes
    the keys or finds them computed with the documents (``keyer``: raysc curate); each removes the
    seeded exact copies and keeps every original."""
    import raysc.curate.dedup as dd
    from raysc.curate.inputs import normalise_batch

    spec = SynthSpec(docs=400, seed=3, near_frac=0.2, exact_frac=0.1, corpus_mb=1.0)
    docs, truth = [], []
    for doc, pair in Synth(spec, line_pools(1.0)):
        docs.append(doc)
        truth += [pair] if pair else []
    batch = normalise_batch(
        pa.table(
            {
                "text": [d["text"] for d in docs],
                "id": [d["id"] for d in docs],
                "domain": ["prose"] * len(docs),
                "bad": [""] * len(docs),
            }
        )
    )
    ds = ray_session.data.from_arrow(batch.select(["id", "text", "hash", "node"])).repartition(4)
    # the keys computed where the documents are read (raysc curate: dd.keyer), or by dedup itself
    keyed = ds.map_batches(dd.keyer(DedupConfig()), batch_format="pyarrow").materialize()
    kept, stats = {}, {}
    for path, limit, given in (
        ("one task", dd.GATHER_MAX_DOCS, ds),
        ("shuffle", 0, ds),
        ("one task, keys read", dd.GATHER_MAX_DOCS, keyed),
        ("shuffle, keys read", 0, keyed),
    ):
        monkeypatch.setattr(dd, "GATHER_MAX_DOCS", limit)
        out, stats[path] = dd.dedup(given, len(docs), DedupConfig(), log=lambda *_: None)
        rows = out.take_all()
        kept[path] = {r["id"] for r in rows}
        assert set(rows[0]) == {"id", "text", "hash", "node"}, path  # no key column goes on to the output
    a = stats["one task"]
    for path in ("shuffle", "one task, keys read", "shuffle, keys read"):
        b = stats[path]
        assert kept[path] == kept["one task"], path
        assert (a.documents, a.exact_removed, a.near_removed, a.clusters) == (
            b.documents,
            b.exact_removed,
            b.near_removed,
            b.clusters,
        ), path
    assert (a.shuffles, stats["shuffle"].shuffles) == (0, 1) and a.exact_removed > 0 and a.near_removed > 0
    assert {p["original"] for p in truth} <= kept["one task"]
    assert not {p["copy"] for p in truth if p["kind"] == "exact"} & kept["one task"]
