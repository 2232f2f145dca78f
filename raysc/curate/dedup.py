"""The dedup stage, exact and near together: a document's LSH band keys (MinHash over word
shingles, ``raysc.curate.minhash``) and, for exact dedup, one more key from its content hash.
Up to ``GATHER_MAX_DOCS`` documents, one row per document (node, signature, keys; ``doc_keys``)
goes to one task, which keeps only the keys held by more than one document (``gathered_forest``);
past it, the keys are rows (key, node, signature; ``key_rows``) and one hash shuffle brings every
key's rows into one partition. Either way, vectorised, keys of one row are skipped with numpy, a
content-hash key's rows are exact duplicates (the smallest node key survives), a band key's pairs
are duplicates when their signatures agree on at least ``dedup.threshold`` of the hash functions,
and a union-find (per partition) reduces these pairs to a forest (one edge per non-root node;
``bucket_forest``). Clusters are the connected components of the forests
(``raysc.curate.graph.components``: one union-find task, or hash-to-min rounds past
``GATHER_MAX_EDGES``); the smallest node key of a cluster survives, the rest leave by a broadcast
filter (``graph.drop_nodes``).

Shuffles: none up to ``GATHER_MAX_DOCS`` documents, else one of small columns (never the text),
plus ``1 + rounds`` only on the hash-to-min path and one for an anti-join of more than
``BROADCAST_MAX_IDS`` losers. Exact first, then near (the old order) keeps the same survivors: an
exact copy has its twin's signature, so it joins its twin's cluster, whose smallest node is at
most the twin's. Ray Data's ``groupby().map_groups`` would call Python once per key (``bands + 1``
calls per document, nearly all on one-row buckets): one call per partition is why this is ours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from raysc.config.schema import DedupConfig
from raysc.curate.graph import BROADCAST_MAX_IDS, components, drop_nodes, forest_edges, partitions
from raysc.curate.minhash import MinHasher
from raysc.curate.stages import count_by

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

# Up to this many documents, their keys go to one task (``doc_keys``, ``gathered_forest``): ~0.6 kB a
# document at 112 hashes, ~0.6 GB at the limit. Measured at 30k documents on 2 cores: the whole dedup
# stage 11.1 and 12.2 s with the hash shuffle of their 450k key rows (each row carrying its signature),
# 4.8 and 4.6 s in one task, same survivors. Past it, the shuffle: no task holds every document's keys.
GATHER_MAX_DOCS = 1_000_000
PAIRWISE_MAX = 2048  # buckets up to this size compare every pair; larger ones pair with their smallest member
_EXACT_KEY = np.uint64(0x5EED0F00D15EA5E5)  # mixed into content-hash keys so they never meet a band key


@dataclass(frozen=True)
class DedupStats:
    """After dedup: documents left, exact and near copies removed, near-duplicate clusters,
    hash-to-min rounds and shuffles."""

    documents: int
    exact_removed: int
    near_removed: int
    clusters: int
    rounds: int
    shuffles: int


def similar_pairs(sig: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i < j) of one bucket's signatures (rows sorted by node key) that agree on at
    least ``threshold`` of the hash functions (the estimated Jaccard similarity). A bucket of more
    than ``PAIRWISE_MAX`` is compared with its first member only."""
    if len(sig) <= PAIRWISE_MAX:  # every pair of the bucket
        est = (sig[:, None, :] == sig[None, :, :]).mean(axis=2)
        return np.nonzero(np.triu(est >= threshold, k=1))
    est = (sig[1:] == sig[0]).mean(axis=1)
    j = np.nonzero(est >= threshold)[0] + 1
    return np.zeros_like(j), j


def key_rows(batch: dict, hasher: MinHasher, exact: bool, near: bool) -> dict:
    """Per document, one row per LSH band (``near``) and one for its content hash (``exact``):
    the key as ``bucket``, the node key, the signature (band rows only) and ``exact``."""
    nodes = np.asarray(batch["node"], dtype=object)
    cols: dict[str, list] = {"bucket": [], "node": [], "sig": [], "exact": []}
    if near:
        sig = hasher.signatures(list(batch["text"]))
        cols["bucket"].append(hasher.band_keys(sig).ravel().view(np.int64))
        cols["node"].append(np.repeat(nodes, hasher.bands))
        cols["sig"].append(np.repeat(np.array([s.tobytes() for s in sig], dtype=object), hasher.bands))
        cols["exact"].append(np.zeros(len(nodes) * hasher.bands, dtype=bool))
    if exact:
        keys = np.array([int(h[:16], 16) for h in batch["hash"]], dtype=np.uint64) ^ _EXACT_KEY
        cols["bucket"].append(keys.view(np.int64))
        cols["node"].append(nodes)
        cols["sig"].append(np.array([b""] * len(nodes), dtype=object))
        cols["exact"].append(np.ones(len(nodes), dtype=bool))
    return {k: np.concatenate(v) for k, v in cols.items()}


def doc_keys(batch: dict, hasher: MinHasher, exact: bool, near: bool) -> pa.Table:
    """Per document, one row: the node key, its signature and band keys as bytes (``near``) and its
    content-hash key (``exact``): what ``key_rows`` spreads over ``bands + 1`` rows, held once."""
    import pyarrow as pa

    out = {"node": pa.array(list(batch["node"]), pa.string())}
    if near:
        sig = hasher.signatures(list(batch["text"]))
        out["sig"] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(sig.shape[1] * 4), len(sig),
                                                          [None, pa.py_buffer(sig.tobytes())])
        keys = hasher.band_keys(sig)
        out["keys"] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(keys.shape[1] * 8), len(keys),
                                                           [None, pa.py_buffer(keys.tobytes())])
    if exact:
        out["hash_key"] = (np.array([int(h[:16], 16) for h in batch["hash"]], dtype=np.uint64) ^ _EXACT_KEY
                           ).view(np.int64)
    return pa.table(out)


def gathered_forest(t: pa.Table, bands: int, threshold: float) -> pa.Table:
    """Every document's ``doc_keys`` row in one task: the keys held by more than one row become
    ``key_rows`` rows (only those: nearly every key is held by one document) for ``bucket_forest``."""
    import pyarrow as pa

    n = len(t)
    buckets, docs, exact = [], [], []
    if "keys" in t.column_names:
        keys = np.frombuffer(t["keys"].combine_chunks().buffers()[1], dtype=np.int64, count=n * bands)
        buckets.append(keys)
        docs.append(np.repeat(np.arange(n), bands))
        exact.append(np.zeros(n * bands, dtype=bool))
    if "hash_key" in t.column_names:
        buckets.append(t["hash_key"].to_numpy())
        docs.append(np.arange(n))
        exact.append(np.ones(n, dtype=bool))
    bucket, doc, is_exact = np.concatenate(buckets), np.concatenate(docs), np.concatenate(exact)
    order = np.argsort(bucket, kind="stable")
    b = bucket[order]
    shared = np.r_[b[1:] == b[:-1], False] | np.r_[False, b[1:] == b[:-1]]
    rows = order[shared]
    take = pa.array(doc[rows])
    sig = (t["sig"].take(take).cast(pa.binary()) if "sig" in t.column_names
           else pa.nulls(len(rows), pa.binary()))
    sig = pa.compute.if_else(pa.array(is_exact[rows]), pa.scalar(b"", pa.binary()), sig)
    return bucket_forest(pa.table({"bucket": bucket[rows], "node": t["node"].take(take), "sig": sig,
                                   "exact": is_exact[rows]}), threshold)


def _signature_rows(sig: pa.Array, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The signatures of a binary column whose rows are ``width`` bytes or empty (an exact key's row), as
    a matrix of uint32 (one row per non-empty row, in order) and each row's index into it (-1: empty)."""
    import pyarrow as pa

    sig = sig.cast(pa.binary()) if pa.types.is_large_binary(sig.type) else sig
    lengths = pa.compute.binary_length(sig).fill_null(0).to_numpy(zero_copy_only=False)
    full = lengths == width
    if not np.all(full | (lengths == 0)):
        raise ValueError(f"signatures of {sorted(set(lengths.tolist()) - {0, width})} bytes, expected {width}")
    if not full.any():
        return np.zeros((0, width // 4), dtype=np.uint32), np.full(len(sig), -1)
    offsets = np.frombuffer(sig.buffers()[1], dtype=np.int32)[sig.offset:sig.offset + len(sig) + 1]
    data = np.frombuffer(sig.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]]  # the empty rows add nothing
    return data.view(np.uint32).reshape(-1, width // 4), np.where(full, np.cumsum(full) - 1, -1)


def bucket_forest(t: pa.Table, threshold: float) -> pa.Table:
    """One partition of key rows: the forest edges (a, b) of its duplicate pairs, and ``exact``
    rows (smallest node, copy) for every exact copy.

    Vectorised: rows are ordered by key and node (Arrow's dense rank of the node strings: byte order,
    which is code point order, as Python sorts them), a node's repeat within a key is dropped, an exact
    key's copies pair with its smallest node, and the signatures of the two-document band keys (nearly
    all of them) are compared in one numpy operation; only keys of three or more documents go through
    ``similar_pairs`` one by one (a Python loop over every key was 12.6 of 13.5 s at 100k documents)."""
    import pyarrow as pa

    n = len(t)
    nodes = t["node"].combine_chunks() if n else pa.array([], pa.string())
    rank = (pa.compute.rank(nodes, sort_keys="ascending", tiebreaker="dense").to_numpy() if n
            else np.zeros(0, dtype=np.uint64))
    buckets = t["bucket"].to_numpy()
    order = np.lexsort((rank, buckets))
    b, r = buckets[order], rank[order]
    first = np.r_[True, (b[1:] != b[:-1]) | (r[1:] != r[:-1])] if n else np.zeros(0, dtype=bool)
    order, b = order[first], b[first]  # each node once per key
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]]) if len(b) else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.r_[starts, len(b)])
    group_start = np.repeat(starts, sizes)  # each row's key's first row (its smallest node)
    exact = t["exact"].combine_chunks().to_numpy(zero_copy_only=False)[order] if n else np.zeros(0, dtype=bool)
    node_of = nodes.take(pa.array(order))
    rest = np.flatnonzero((np.arange(len(order)) != group_start) & np.repeat(sizes > 1, sizes))
    copies = rest[exact[rest]]  # an exact key: every other copy pairs with its smallest node
    near = ~exact & np.repeat(sizes > 1, sizes)
    if near.any():
        sig = t["sig"].combine_chunks()
        width = pa.compute.max(pa.compute.binary_length(sig)).as_py()
        sigs, row = _signature_rows(sig, width)
        row = row[order]
        two = starts[(sizes == 2) & near[starts]]  # keys of two documents: one comparison each
        agree = (sigs[row[two]] == sigs[row[two + 1]]).mean(axis=1) >= threshold
        near_a, near_b = [two[agree]], [two[agree] + 1]
        for s, k in zip(starts[(sizes > 2) & near[starts]], sizes[(sizes > 2) & near[starts]]):
            i, j = similar_pairs(sigs[row[s:s + k]], threshold)
            near_a.append(s + i)
            near_b.append(s + j)
        pairs_a, pairs_b = np.concatenate(near_a), np.concatenate(near_b)
    else:
        pairs_a = pairs_b = np.zeros(0, dtype=np.int64)
    copy_a, copy_b = group_start[copies], copies
    forest = forest_edges(node_of.take(pa.array(pairs_a)).to_pylist(), node_of.take(pa.array(pairs_b)).to_pylist())
    exact_edges = pa.table({"a": node_of.take(pa.array(copy_a)), "b": node_of.take(pa.array(copy_b))})
    return pa.concat_tables([forest.append_column("exact", pa.array([False] * len(forest), pa.bool_())),
                             exact_edges.append_column("exact", pa.array([True] * len(exact_edges), pa.bool_()))])


def dedup(docs: Dataset, count: int, d: DedupConfig,
          log: Callable[[str], None] = print) -> tuple[Dataset, DedupStats]:
    """``docs`` (``count`` rows) with one survivor per exact-copy group and near-duplicate
    cluster (the smallest node key), and the stats."""
    from ray.data.expressions import col

    if not (d.exact or d.near) or not count:
        return docs, DedupStats(count, 0, 0, 0, 0, 0)
    hasher = MinHasher(d.num_perm, d.bands, d.rows, d.shingle, d.seed)
    per_doc = d.bands * d.near + d.exact
    keyed = {"hasher": hasher, "exact": d.exact, "near": d.near}
    if count <= GATHER_MAX_DOCS:  # one task: no shuffle
        edges = docs.map_batches(doc_keys, batch_format="numpy", fn_kwargs=keyed).repartition(1).map_batches(
            gathered_forest, batch_size=None, batch_format="pyarrow",
            fn_kwargs={"bands": d.bands, "threshold": d.threshold}).materialize()
    else:
        edges = docs.map_batches(key_rows, batch_format="numpy", fn_kwargs=keyed).repartition(
            partitions(count * per_doc), keys=["bucket"]).map_batches(
            bucket_forest, batch_size=None, batch_format="pyarrow", fn_kwargs={"threshold": d.threshold}).materialize()
    n_edges = edges.count()
    log(f"curate: dedup: {n_edges} forest edge(s) of exact copies and pairs above dedup.threshold={d.threshold}")
    key_shuffles = int(count > GATHER_MAX_DOCS)
    if not n_edges:
        return docs, DedupStats(count, 0, 0, 0, 0, key_shuffles)
    n_exact = count_by(edges, "exact").get("true", 0)  # one content-hash row per document: no repeats
    roots, rounds, shuffles = components(edges.select_columns(["a", "b"]), n_edges, d.max_rounds, log)
    roots = roots.materialize()
    losers = roots.filter(expr=col("node") != col("root")).select_columns(["node"]).materialize()
    removed = losers.count()
    clusters = roots.count() - removed
    docs = drop_nodes(docs, losers, removed)
    stats = DedupStats(count - removed, n_exact, removed - n_exact, clusters, rounds,
                       key_shuffles + shuffles + int(removed > BROADCAST_MAX_IDS))
    log(f"curate: dedup removed {stats.exact_removed} exact and {stats.near_removed} near copies in {clusters} "
        f"cluster(s) ({rounds} hash-to-min rounds)")
    return docs, stats
