"""The dedup stage, exact and near together: a document's LSH band keys (MinHash over word
shingles, ``raysc.curate.minhash``) and, for exact dedup, one more key from its content hash, as
columns of each document (``doc_keys``): ``raysc curate`` adds them where it reads the documents, in the
same task (``keyer``, ``with_keys``: the texts are not read again), else dedup computes them.
Up to ``GATHER_MAX_DOCS`` documents, those columns of every document go to one task, which keeps
only the keys held by more than one document (``gathered_forest``); past it, the keys are rows (key,
node, signature; ``key_rows``) and one hash shuffle brings every key's rows into one partition.
Either way, vectorised (``_forest``), keys of one row are skipped with numpy, a
content-hash key's rows are exact duplicates (the smallest node key survives), a band key's pairs
are duplicates when their signatures agree on at least ``dedup.threshold`` of the hash functions,
and a union-find (per partition) reduces these pairs to a forest (one edge per non-root node;
``_forest``). Clusters are the connected components of the forests
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

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

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
KEY_COLUMNS = ("sig", "keys", "hash_key")  # what doc_keys adds to a document (with_keys)
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


def doc_keys(batch: pa.Table, hasher: MinHasher, exact: bool, near: bool) -> pa.Table:
    """Per document, one row: the node key, its signature and band keys as bytes (``near``) and its
    content-hash key (``exact``). An Arrow batch: the texts go to ``MinHasher`` as UTF-8 buffers, never as
    Python strings (ASCII ones)."""
    import pyarrow as pa

    out = {"node": batch["node"].combine_chunks()}
    if near:
        sig = hasher.signatures(batch["text"].combine_chunks())
        out["sig"] = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(sig.shape[1] * 4), len(sig), [None, pa.py_buffer(sig.tobytes())]
        )
        keys = hasher.band_keys(sig)
        out["keys"] = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(keys.shape[1] * 8), len(keys), [None, pa.py_buffer(keys.tobytes())]
        )
    if exact:
        out["hash_key"] = (
            np.array([int(h[:16], 16) for h in batch["hash"].to_pylist()], dtype=np.uint64) ^ _EXACT_KEY
        ).view(np.int64)
    return pa.table(out)


def with_keys(batch: pa.Table, hasher: MinHasher, exact: bool, near: bool) -> pa.Table:
    """The batch with its ``doc_keys`` columns added (``KEY_COLUMNS``): computed where the documents are
    read, in the same task (``keyer``), so dedup does not read the texts again."""
    keys = doc_keys(batch, hasher, exact, near)
    for name in KEY_COLUMNS:
        if name in keys.column_names:
            batch = batch.append_column(name, keys[name])
    return batch


def keyer(d: DedupConfig) -> Callable[[pa.Table], pa.Table] | None:
    """``with_keys`` for ``dedup.*`` (for ``stages.read_documents``), or None when dedup is off."""
    if not (d.exact or d.near):
        return None
    return partial(with_keys, hasher=hasher_of(d), exact=d.exact, near=d.near)


def hasher_of(d: DedupConfig) -> MinHasher:
    """The ``MinHasher`` of ``dedup.*``."""
    return MinHasher(d.num_perm, d.bands, d.rows, d.shingle, d.seed, d.minhash)


def _fixed_rows(col: pa.Array | pa.ChunkedArray, dtype: type) -> np.ndarray:
    """A fixed-size binary column as a matrix of ``dtype`` (a view of its buffer), one row per value."""
    import pyarrow as pa

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    width = arr.type.byte_width // np.dtype(dtype).itemsize
    flat = np.frombuffer(arr.buffers()[1], dtype=dtype)
    return flat[arr.offset * width : (arr.offset + len(arr)) * width].reshape(len(arr), width)


def key_rows(keys: pa.Table) -> pa.Table:
    """``doc_keys`` rows spread to one row per key, for the hash shuffle: per LSH band (``keys``) and per
    content hash (``hash_key``), the key as ``bucket``, the node key, the signature (band rows only,
    else empty) and ``exact``."""
    import pyarrow as pa

    parts, n = [], len(keys)
    node = keys["node"].combine_chunks()
    if "keys" in keys.column_names:
        band = _fixed_rows(keys["keys"], np.int64)
        take = pa.array(np.repeat(np.arange(n), band.shape[1]))
        parts.append(
            pa.table(
                {
                    "bucket": band.ravel(),
                    "node": node.take(take),
                    "sig": keys["sig"].combine_chunks().take(take).cast(pa.binary()),
                    "exact": np.zeros(band.size, dtype=bool),
                }
            )
        )
    if "hash_key" in keys.column_names:
        parts.append(
            pa.table(
                {
                    "bucket": keys["hash_key"].combine_chunks(),
                    "node": node,
                    "sig": pa.array([b""] * n, pa.binary()),
                    "exact": np.ones(n, dtype=bool),
                }
            )
        )
    return pa.concat_tables(parts)


def gathered_forest(t: pa.Table, threshold: float) -> pa.Table:
    """Every document's ``doc_keys`` row in one task: the keys held by more than one row (nearly every
    key is held by one document) go through ``_forest`` with the signature matrix as it is (a view of
    the column's buffer: a row per key would copy ~90 MB of signatures at 100k documents) and the nodes
    ranked once per document. The shared keys are found one band (and the content hashes) at a time: a
    sort of all 1.5M keys of 100k documents at once held ~150 MB of index arrays, and on these VMs memory
    a process touches for the first time costs up to ~7 s per GiB (1.2 of its 1.5 s)."""
    import pyarrow as pa

    n = len(t)
    columns: list[tuple[np.ndarray, bool]] = []  # (one key per document, whether it is a content hash)
    if "keys" in t.column_names:
        band = _fixed_rows(t["keys"], np.int64)
        columns += [(band[:, j], False) for j in range(band.shape[1])]
    if "hash_key" in t.column_names:
        columns.append((t["hash_key"].to_numpy(), True))
    buckets, docs, exact = [], [], []
    for keys, is_exact in columns:
        keys = np.ascontiguousarray(keys)
        order = np.argsort(keys)  # SIMD quicksort; _forest orders each key's rows itself
        b = keys[order]
        dup = b[1:] == b[:-1]
        held = order[np.r_[dup, False] | np.r_[False, dup]]  # the documents of keys held more than once
        buckets.append(keys[held])
        docs.append(held)
        exact.append(np.full(len(held), is_exact))
    bucket, doc = np.concatenate(buckets or [np.zeros(0, np.int64)]), np.concatenate(docs or [np.zeros(0, np.int64)])
    nodes = t["node"].combine_chunks()
    sigs = _fixed_rows(t["sig"], np.uint32) if "sig" in t.column_names else np.zeros((n, 0), dtype=np.uint32)
    return _forest(
        bucket,
        _rank(nodes)[doc],
        np.concatenate(exact or [np.zeros(0, bool)]),
        sigs,
        doc,
        lambda i: nodes.take(pa.array(doc[i])),
        threshold,
    )


def _rank(nodes: pa.Array) -> np.ndarray:
    """Each node's dense rank in byte order (code point order, as Python sorts strings)."""
    import pyarrow as pa

    if not len(nodes):
        return np.zeros(0, dtype=np.uint64)
    return pa.compute.rank(nodes, sort_keys="ascending", tiebreaker="dense").to_numpy()


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
    offsets = np.frombuffer(sig.buffers()[1], dtype=np.int32)[sig.offset : sig.offset + len(sig) + 1]
    data = np.frombuffer(sig.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]  # the empty rows add nothing
    return data.view(np.uint32).reshape(-1, width // 4), np.where(full, np.cumsum(full) - 1, -1)


def bucket_forest(t: pa.Table, threshold: float) -> pa.Table:
    """One partition of key rows (bucket, node, sig, exact): the forest edges (a, b) of its duplicate
    pairs, and ``exact`` rows (smallest node, copy) for every exact copy (``_forest``)."""
    import pyarrow as pa

    nodes = t["node"].combine_chunks() if len(t) else pa.array([], pa.string())
    exact = t["exact"].combine_chunks().to_numpy(zero_copy_only=False) if len(t) else np.zeros(0, dtype=bool)
    sigs, row = np.zeros((0, 0), dtype=np.uint32), np.full(len(t), -1)
    if (~exact).any():
        sig = t["sig"].combine_chunks()
        sigs, row = _signature_rows(sig, pa.compute.max(pa.compute.binary_length(sig)).as_py())
    return _forest(t["bucket"].to_numpy(), _rank(nodes), exact, sigs, row, lambda i: nodes.take(pa.array(i)), threshold)


def _forest(
    buckets: np.ndarray,
    rank: np.ndarray,
    exact: np.ndarray,
    sigs: np.ndarray,
    sig_row: np.ndarray,
    node_of: Callable[[np.ndarray], pa.Array],
    threshold: float,
) -> pa.Table:
    """Key rows (each row's key, its node's rank, whether the key is a content hash, its signature as
    ``sigs[sig_row]``; ``node_of(rows)`` gives rows' node keys): the forest edges (a, b) of the duplicate
    pairs and ``exact`` rows (smallest node, copy) for every exact copy.

    Vectorised: rows are ordered by key and node rank, a node's repeat within a key is dropped, an exact
    key's copies pair with its smallest node, and the signatures of the two-document band keys (nearly
    all of them) are compared in one numpy operation; only keys of three or more documents go through
    ``similar_pairs`` one by one (a Python loop over every key was 12.6 of 13.5 s at 100k documents)."""
    import pyarrow as pa

    n = len(buckets)
    order = np.lexsort((rank, buckets))
    b, r = buckets[order], rank[order]
    first = np.r_[True, (b[1:] != b[:-1]) | (r[1:] != r[:-1])] if n else np.zeros(0, dtype=bool)
    order, b = order[first], b[first]  # each node once per key
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]]) if len(b) else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.r_[starts, len(b)])
    group_start = np.repeat(starts, sizes)  # each row's key's first row (its smallest node)
    exact = exact[order]
    rest = np.flatnonzero((np.arange(len(order)) != group_start) & np.repeat(sizes > 1, sizes))
    copies = rest[exact[rest]]  # an exact key: every other copy pairs with its smallest node
    near = ~exact & np.repeat(sizes > 1, sizes)
    if near.any():
        row = sig_row[order]
        two = starts[(sizes == 2) & near[starts]]  # keys of two documents: one comparison each
        agree = np.zeros(len(two), dtype=bool)
        for lo in range(0, len(two), 4096):  # 4k pairs at a time: ~4 MiB, not 100 MB of gathered signatures
            i = two[lo : lo + 4096]
            same = np.count_nonzero(sigs[row[i]] == sigs[row[i + 1]], axis=1)
            agree[lo : lo + 4096] = same / sigs.shape[1] >= threshold  # as similar_pairs' mean
        near_a, near_b = [two[agree]], [two[agree] + 1]
        for s, k in zip(starts[(sizes > 2) & near[starts]], sizes[(sizes > 2) & near[starts]]):
            i, j = similar_pairs(sigs[row[s : s + k]], threshold)
            near_a.append(s + i)
            near_b.append(s + j)
        pairs_a, pairs_b = np.concatenate(near_a), np.concatenate(near_b)
    else:
        pairs_a = pairs_b = np.zeros(0, dtype=np.int64)
    forest = forest_edges(node_of(order[pairs_a]).to_pylist(), node_of(order[pairs_b]).to_pylist())
    exact_edges = pa.table({"a": node_of(order[group_start[copies]]), "b": node_of(order[copies])})
    return pa.concat_tables(
        [
            forest.append_column("exact", pa.array([False] * len(forest), pa.bool_())),
            exact_edges.append_column("exact", pa.array([True] * len(exact_edges), pa.bool_())),
        ]
    )


def dedup(docs: Dataset, count: int, d: DedupConfig, log: Callable[[str], None] = print) -> tuple[Dataset, DedupStats]:
    """``docs`` (``count`` rows) with one survivor per exact-copy group and near-duplicate
    cluster (the smallest node key), and the stats."""
    from ray.data.expressions import col

    present = [name for name in KEY_COLUMNS if name in docs.schema().names]  # with_keys ran where they were read
    if not (d.exact or d.near) or not count:
        return docs.drop_columns(present) if present else docs, DedupStats(count, 0, 0, 0, 0, 0)
    if present:
        keys = docs.select_columns(["node", *present])
    else:
        keys = docs.map_batches(
            doc_keys, batch_format="pyarrow", fn_kwargs={"hasher": hasher_of(d), "exact": d.exact, "near": d.near}
        )
    docs = docs.drop_columns(present) if present else docs
    if count <= GATHER_MAX_DOCS:  # one task: no shuffle
        edges = (
            keys.repartition(1)
            .map_batches(gathered_forest, batch_size=None, batch_format="pyarrow", fn_kwargs={"threshold": d.threshold})
            .materialize()
        )
    else:
        edges = (
            keys.map_batches(key_rows, batch_format="pyarrow")
            .repartition(partitions(count * (d.bands * d.near + d.exact)), keys=["bucket"])
            .map_batches(bucket_forest, batch_size=None, batch_format="pyarrow", fn_kwargs={"threshold": d.threshold})
            .materialize()
        )
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
    stats = DedupStats(
        count - removed,
        n_exact,
        removed - n_exact,
        clusters,
        rounds,
        key_shuffles + shuffles + int(removed > BROADCAST_MAX_IDS),
    )
    log(
        f"curate: dedup removed {stats.exact_removed} exact and {stats.near_removed} near copies in {clusters} "
        f"cluster(s) ({rounds} hash-to-min rounds)"
    )
    return docs, stats
