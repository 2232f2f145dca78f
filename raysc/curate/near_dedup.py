"""The near-dedup stage: MinHash signatures and LSH band keys (``raysc.curate.minhash``), buckets
by a group-by on the band key, candidate pairs whose signatures agree on at least
``dedup.threshold`` of the hash functions, clusters by connected components
(``raysc.curate.graph``), one survivor per cluster (the smallest node key), the rest removed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from raysc.config.schema import DedupConfig
from raysc.curate.graph import connected_components, drop_nodes, shuffle_partitions
from raysc.curate.minhash import MinHasher

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset

PAIRWISE_MAX = 2048  # buckets up to this size compare every pair; larger ones pair with their smallest member


@dataclass(frozen=True)
class NearStats:
    """After near dedup: documents left, removed, clusters found, connected-components rounds."""

    documents: int
    removed: int
    clusters: int
    rounds: int


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


def band_rows(batch: dict, hasher: MinHasher) -> dict:
    """One row per (document, band): the band key as ``bucket``, the node key and the signature."""
    sig = hasher.signatures(list(batch["text"]))
    keys = hasher.band_keys(sig)
    return {"bucket": keys.ravel().view(np.int64),
            "node": np.repeat(np.asarray(batch["node"], dtype=object), hasher.bands),
            "sig": np.repeat(np.array([s.tobytes() for s in sig], dtype=object), hasher.bands)}


def bucket_edges(group: pa.Table, threshold: float) -> pa.Table:
    """Candidate pairs (a, b) of one LSH bucket, kept when ``similar_pairs`` finds them."""
    import pyarrow as pa

    empty = pa.table({"a": pa.array([], pa.string()), "b": pa.array([], pa.string())})
    if group.num_rows < 2:  # most buckets: checked before any conversion
        return empty
    by_node = dict(zip(group["node"].to_pylist(), group["sig"].to_pylist()))
    nodes = sorted(by_node)
    if len(nodes) < 2:
        return empty
    i, j = similar_pairs(np.stack([np.frombuffer(by_node[n], dtype=np.uint32) for n in nodes]), threshold)
    return pa.table({"a": [nodes[x] for x in i], "b": [nodes[x] for x in j]})


def near_dedup(docs: Dataset, count: int, d: DedupConfig,
               log: Callable[[str], None] = print) -> tuple[Dataset, NearStats]:
    """``docs`` (``count`` rows) with one survivor per near-duplicate cluster, and its stats."""
    removed, clusters, rounds = 0, 0, 0
    if d.near and count > 1:
        edges = candidate_pairs(docs, count, d)
        n_edges = edges.count()
        log(f"curate: near dedup: {n_edges} candidate pair(s) above dedup.threshold={d.threshold}")
        if n_edges:
            docs, removed, clusters, rounds = keep_one_per_cluster(docs, edges, d.max_rounds, log)
    stats = NearStats(docs.count(), removed, clusters, rounds)
    log(f"curate: near dedup removed {removed} in {clusters} cluster(s) ({rounds} rounds)")
    return docs, stats


def candidate_pairs(docs: Dataset, count: int, d: DedupConfig) -> Dataset:
    """The (a, b) node pairs of ``docs`` that share an LSH bucket and pass ``similar_pairs``; a pair
    found in several bands repeats."""
    hasher = MinHasher(d.num_perm, d.bands, d.rows, d.shingle, d.seed)
    parts = shuffle_partitions(count * d.bands)
    return docs.map_batches(band_rows, batch_format="numpy", fn_kwargs={"hasher": hasher}).groupby(
        "bucket", num_partitions=parts).map_groups(bucket_edges, batch_format="pyarrow",
                                                   fn_kwargs={"threshold": d.threshold}).materialize()


def keep_one_per_cluster(docs: Dataset, edges: Dataset, max_rounds: int,
                         log: Callable[[str], None] = print) -> tuple[Dataset, int, int, int]:
    """(``docs`` without every node of a cluster but its root, removed, clusters, rounds).
    Repeated edges are harmless: connected components merges sets."""
    roots, rounds = connected_components(edges, max_rounds, log)
    roots = roots.materialize()
    losers = roots.filter(lambda r: r["node"] != r["root"]).select_columns(["node"]).materialize()
    clusters = roots.filter(lambda r: r["node"] == r["root"]).count()
    removed = losers.count()
    if removed:
        docs = drop_nodes(docs, losers, removed).materialize()
    return docs, removed, clusters, rounds
