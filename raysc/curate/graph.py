"""Graph steps of near dedup on Ray Data: connected components of the candidate pairs and
removing the losers from the corpus (a broadcast filter, or a shuffle anti-join for very many ids).

Components (``components``): the pairs arrive already reduced to a forest by a union-find
inside each LSH bucket partition (``union_find``), so they are few (at most one per duplicate
document and band). Up to ``GATHER_MAX_EDGES`` of them go to one task that finishes the
union-find: no further shuffle, zero rounds, bounded memory (the graph of the duplicates, never
the corpus), as datatrove's single cluster stage does. Beyond that, hash-to-min rounds of
group-bys (``connected_components``), in which no single process holds the graph."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from raysc.curate.errors import CurateError

if TYPE_CHECKING:
    import pyarrow as pa
    from ray.data import Dataset


def shuffle_partitions(rows: int) -> int:
    """Partitions of a group-by: about 2,000 rows each, at most 200 (Ray Data's default), so small
    inputs do not pay for hundreds of nearly empty shuffle tasks."""
    return max(1, min(200, rows // 2000))


def partitions(rows: int, per: int = 100_000) -> int:
    """Partitions of a hash shuffle of ``rows`` rows of a few small columns: ``per`` rows each
    (fewer, bigger tasks: a task costs milliseconds of fixed overhead), 1 to 200."""
    return max(1, min(200, -(-rows // per)))


GATHER_MAX_EDGES = 2_000_000  # up to this many forest edges, components are one union-find task


def union_find(a: list, b: list) -> dict:
    """{node: root} of the undirected graph with edges (a[i], b[i]): the root of a component is
    its smallest node. Path halving; the smaller root wins a union."""
    parent: dict = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in zip(a, b):
        rx, ry = find(x), find(y)
        if rx != ry:
            parent[max(rx, ry)] = min(rx, ry)
    return {x: find(x) for x in parent}


def forest_edges(a: list, b: list) -> pa.Table:
    """The edges (root, node) that span the components of the edges (a, b): one per non-root node."""
    import pyarrow as pa

    roots = union_find(a, b)
    pairs = [(r, x) for x, r in roots.items() if x != r]
    return pa.table(
        {"a": pa.array([r for r, _ in pairs], pa.string()), "b": pa.array([x for _, x in pairs], pa.string())}
    )


def _roots_of_block(t: pa.Table) -> pa.Table:
    """One task's union-find over every edge it is given: (node, root) of every node."""
    import pyarrow as pa

    roots = union_find(t["a"].to_pylist(), t["b"].to_pylist())
    return pa.table({"node": pa.array(list(roots), pa.string()), "root": pa.array(list(roots.values()), pa.string())})


def components(
    edges: Dataset, count: int, max_rounds: int, log: Callable[[str], None] = print
) -> tuple[Dataset, int, int]:
    """(node, root) of every node of the graph ``edges`` (``count`` (a, b) rows), the hash-to-min
    rounds and shuffles used: zero of each when the edges fit ``GATHER_MAX_EDGES``."""
    if count <= GATHER_MAX_EDGES:
        return edges.repartition(1).map_batches(_roots_of_block, batch_size=None, batch_format="pyarrow"), 0, 0
    roots, rounds = connected_components(edges, max_rounds, log)
    return roots, rounds, rounds + 1


def connected_components(edges: Dataset, max_rounds: int, log: Callable[[str], None] = print) -> tuple[Dataset, int]:
    """Clusters of an undirected graph given as a Ray Dataset of (a, b) rows.

    Hash-to-min (Rastogi et al., "Finding connected components in map-reduce in logarithmic
    rounds", ICDE 2013): every node keeps a set C holding itself and the nodes it knows; each
    round it sends C to min(C) and min(C) to every other member; the sets are merged by a
    group-by. At the fixed point, min(C) of every node is the smallest node of its component.
    Returns a Dataset of (node, root) and the rounds used."""
    parts = shuffle_partitions(4 * edges.count())
    state = (
        edges.map_batches(_init, batch_format="numpy")
        .groupby("node", num_partitions=parts)
        .map_groups(_merge, batch_format="pyarrow")
        .materialize()
    )
    previous = None
    for rounds in range(1, max_rounds + 1):
        state = (
            state.map_batches(_send, batch_format="numpy")
            .groupby("node", num_partitions=parts)
            .map_groups(_merge, batch_format="pyarrow")
            .materialize()
        )
        fp = state.map_batches(_fingerprint, batch_format="numpy").sum("fp")
        log(f"  connected components: round {rounds}, {state.count()} nodes")
        if fp == previous:
            break
        previous = fp
    else:
        raise CurateError(f"connected components did not converge in dedup.max_rounds={max_rounds} rounds")
    roots = state.map_batches(
        lambda b: {"node": b["node"], "root": np.array([c[0] for c in b["members"]], dtype=object)},
        batch_format="numpy",
    )
    return roots, rounds


def _init(batch: dict) -> dict:
    """Each edge (a, b) as the member rows a: {a, b} and b: {a, b}."""
    a, b = batch["a"], batch["b"]
    return {"node": np.concatenate([a, b, a, b]), "member": np.concatenate([b, a, a, b])}


def _merge(group: pa.Table) -> pa.Table:
    """One node's row: its sorted set of members."""
    import pyarrow as pa

    members = sorted(set(group["member"].to_pylist()))
    return pa.table({"node": [group["node"][0].as_py()], "members": [members]})


def _send(batch: dict) -> dict:
    """One hash-to-min round's messages: C to min(C), min(C) to every member."""
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


def _fingerprint(batch: dict) -> dict:
    """A hash of each node's set, summed to tell when a round changed nothing."""
    return {
        "fp": np.array(
            [
                int(hashlib.blake2b(f"{n}\x00{'|'.join(c)}".encode(), digest_size=6).hexdigest(), 16)
                for n, c in zip(batch["node"], batch["members"])
            ],
            dtype=np.int64,
        )
    }


BROADCAST_MAX_IDS = 1_000_000  # up to this many removed ids are broadcast as a set, not shuffled


def drop_nodes(docs: Dataset, losers: Dataset, count: int) -> Dataset:
    """``docs`` without the rows whose ``node`` is in ``losers``. Near duplicates are a small share
    of a corpus: up to ``BROADCAST_MAX_IDS`` ids go to every task as one object (a filter, no
    shuffle, run again by each later use: cheap); beyond that, the shuffle-based ``anti_join``, run once."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import ray

    if count > BROADCAST_MAX_IDS:  # materialized: the write and its totals must not each run the shuffle again
        return anti_join(docs, losers, "node").materialize()
    ids_ref = ray.put(pa.concat_tables(ray.get(losers.to_arrow_refs()))["node"].combine_chunks())

    def keep(t: pa.Table) -> pa.Table:
        return t.filter(pc.invert(pc.is_in(t["node"], value_set=ray.get(ids_ref))))

    return docs.map_batches(keep, batch_format="pyarrow")


def anti_join(left: Dataset, right: Dataset, key: str) -> Dataset:
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
    return marked_left.union(marked_right).groupby(key, num_partitions=parts).map_groups(keep, batch_format="pyarrow")
