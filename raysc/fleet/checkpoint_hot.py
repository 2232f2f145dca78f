"""The hot copy: the newest committed checkpoint's files kept in Ray's object store.

The supervisor owns the object refs, so the files outlive the workers that read them; a restore of
that step from this run's store fetches them from there instead of from the checkpoint store.
"""

from __future__ import annotations

from raysc.checkpoint.store import CheckpointStore


class HotCopy:
    """File name -> ObjectRef of the newest committed checkpoint's files, and which step they hold."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store  # the hot copy holds this store's checkpoints only
        self.refs: dict[str, object] = {}
        self.step: int | None = None

    def keep(self, workers: list, step: int, results: list[dict]) -> None:
        """Keep the newest checkpoint's files in Ray's object store, owned by the supervisor."""
        import ray

        refs = {f["path"]: workers[r["rank"]].read_file.remote(step, f["path"]) for r in results for f in r["files"]}
        ray.wait(list(refs.values()), num_returns=len(refs), fetch_local=False)
        self.refs, self.step = refs, step  # the previous step's refs are dropped and freed

    def refs_for(self, store: CheckpointStore, step: int) -> dict[str, object] | None:
        """The refs of ``step`` when the hot copy holds it (and it is read from this run's store), else None."""
        return self.refs if step == self.step and store is self.store else None
