"""Node-local copies of checkpoints: where each node keeps them, and how many it keeps.

Every rank stages the files of a save on its node's disk before uploading them, and a
restore fetches into the same directory (reusing intact files, ``CheckpointStore.fetch``).
These copies are a cache of the store, never the durable copy, so they are pruned to the
newest ``checkpoint.keep_last`` steps (the store's retention count) when a save starts;
checkpoints kept in the store for ``keep_every_steps`` are not kept locally (a restore of
one reads the store).

Layout: ``<data.cache_dir>/checkpoints/node-<node id>/<hash of the uri>/step_NNNNNNNN/``.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path

from raysc.checkpoint.storage import step_name

STEP_DIR = re.compile(r"^step_(\d+)$")


def node_copies_root(cache_dir: str | Path, node: str = "") -> Path:
    """Every local checkpoint copy of node ``node`` (a Ray node id; "" outside a fleet). Per node,
    because nodes do not share disks: on a local multi-node cluster, where they share one, a new
    node must not find another's copy."""
    return Path(cache_dir) / "checkpoints" / (f"node-{node[:12]}" if node else "")


def local_copy_dir(cache_dir: str | Path, uri: str, step: int, node: str = "") -> Path:
    """Where node ``node`` keeps its copy of checkpoint ``step`` of ``uri`` (save staging and
    restore cache)."""
    key = hashlib.sha256(uri.encode()).hexdigest()[:12]
    return node_copies_root(cache_dir, node) / key / step_name(step)


def prune_local_copies(step_dir: Path, keep_last: int) -> list[int]:
    """Delete the copies beside ``step_dir`` (same node, same store) that are older than the newest
    ``keep_last`` steps up to and including ``step_dir``'s own; return the deleted steps.

    Steps newer than ``step_dir``'s (left by a run that rolled back past them) are kept: they
    count once a later save passes them. Several ranks of one node may prune at once: a copy
    already deleted by another is no error."""
    own = int(STEP_DIR.match(step_dir.name)[1])
    if not step_dir.parent.is_dir():
        return []
    older = sorted(
        (
            int(m[1])
            for p in step_dir.parent.iterdir()
            if p.is_dir() and (m := STEP_DIR.match(p.name)) and int(m[1]) < own
        ),
        reverse=True,
    )
    doomed = older[max(keep_last - 1, 0) :]
    for step in doomed:
        shutil.rmtree(step_dir.parent / step_name(step), ignore_errors=True)
    return sorted(doomed)
