"""Restoring a checkpoint on every rank: resume, restart and rollback, falling back past corrupt ones.

``Restorer`` walks back from this run's newest committed checkpoint (or loads the one ``--resume-from``
names, possibly from another store) until one fetches intact: every rank fetches and verifies every
file (from the hot copy when it holds that step) before any rank loads. A restore or rollback makes
the restored step the newest durable one (``SaveInFlight.durable_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from raysc.checkpoint.store import CheckpointStore, CorruptCheckpoint
from raysc.config.load import config_hash
from raysc.config.schema import Config
from raysc.fleet.checkpoint_hot import HotCopy
from raysc.fleet.checkpoint_runs import RunOwnership, parse_resume_from
from raysc.fleet.checkpoint_saving import SaveInFlight
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind


class Restorer:
    """Loads a checkpoint into the saving side's workers; ``load_store`` is where a restore reads from."""

    def __init__(
        self,
        cfg: Config,
        event: Callable[..., dict],
        wait: Callable[..., list],
        store: CheckpointStore,
        runs: RunOwnership,
        hot: HotCopy,
        saving: SaveInFlight,
    ) -> None:
        self.cfg, self.event, self.wait, self.store = cfg, event, wait, store
        self.runs, self.hot, self.saving = runs, hot, saving
        self.load_store = store  # where a restore reads from (--resume-from may point elsewhere)

    def rollback_to_before(self, first_bad_step: int) -> int:
        """Restore, in place, the newest committed checkpoint taken before ``first_bad_step``."""
        self.saving.finish()
        step = next(
            (s for s in reversed(self.runs.own_steps()) if s < first_bad_step and self.store.verify(s) is None), None
        )
        if step is None:
            raise RunFailed(f"rollback: no committed checkpoint before step {first_bad_step}")
        restored, self.saving.durable_step = self.fetch_and_load(self.store, step)[0], step
        return restored

    def fetch_and_load(self, store: CheckpointStore, step: int) -> tuple[int, list[dict]]:
        """Every rank fetches ``step`` (verifying each file; no collectives, so a corrupt file
        fails everywhere before anything is loaded), then loads it. The hot copy is used when it
        holds that step. Returns (restored step, per-rank fetch info)."""
        hot = self.hot.refs_for(store, step)
        infos = self.wait(
            [w.fetch.remote(store.uri, step, hot) for w in self.saving.workers], f"fetch of checkpoint {step}"
        )
        restored = self.wait(
            [w.load.remote(store.uri, step) for w in self.saving.workers], f"load of checkpoint {step}"
        )[0]
        return restored, infos

    def candidates(self, resume: bool | str) -> Iterator[int]:
        """The checkpoints a restore may load, newest first, each verified (sizes) only when the newer
        ones failed: a restart reads one manifest and its files' sizes, not every checkpoint's."""
        if isinstance(resume, str):
            root, step = parse_resume_from(resume)
            if root.rstrip("/") != self.cfg.checkpoint_uri.rstrip("/"):
                self.load_store = CheckpointStore.for_config(self.cfg, root)
            reason = self.load_store.verify(step)
            if reason:
                raise RunFailed(f"cannot resume from {resume}: {reason}")
            yield step
            return
        for step in reversed(self.store.steps()):
            owner = self.runs.owners([step])[step]
            reason = (
                self.store.verify(step)
                if owner in (None, self.runs.run_id)
                else f"written by run {owner}, not by this run ({self.runs.run_id}); "
                "name it with --resume-from to use it"
            )
            if reason is None:
                yield step
            else:
                self.event(EventKind.CHECKPOINT_SKIPPED, step=step, reason=reason)

    def restore(self, resume: bool | str, fresh_ok: bool = False) -> int:
        """Fetch (verifying every file) the newest usable checkpoint on every rank, then load it; with
        ``fresh_ok`` (a restart) and no checkpoint of this run, 0: the fresh workers start over."""
        tried = False
        for step in self.candidates(resume):
            tried = True
            try:
                restored, infos = self.fetch_and_load(self.load_store, step)
            except RunFailed as e:
                if e.failure is not None and isinstance(e.failure.cause, CorruptCheckpoint):
                    self.event(
                        EventKind.CHECKPOINT_CORRUPT,
                        step=step,
                        error=str(e),
                        action="falling back to the previous checkpoint",
                    )
                    continue
                raise
            if self.load_store is self.store:
                self.saving.durable_step = step
            manifest = self.load_store.read_manifest(step) or {}
            self.event(
                EventKind.RESUMED,
                step=restored,
                uri=self.load_store.uri,
                from_layout=manifest.get("layout"),
                source=sorted({i["source"] for i in infos}),
                fetch_s=round(max(i["seconds"] for i in infos), 3),
            )
            if manifest.get("config_hash") and manifest["config_hash"] != config_hash(self.cfg):
                self.event(
                    EventKind.RESUME_CONFIG_CHANGED,
                    step=step,
                    saved_hash=manifest["config_hash"],
                    hash=config_hash(self.cfg),
                    note="the configuration differs from the one that wrote the checkpoint",
                )
            return restored
        if not tried:
            if fresh_ok:
                return 0
            raise RunFailed(
                f"--resume: no committed checkpoint of run {self.runs.run_id} under "
                f"{self.cfg.checkpoint_uri}; start without --resume (or --resume-from URI/step_N)."
            )
        raise RunFailed(
            f"every checkpoint under {self.load_store.uri} failed verification; see the "
            f"checkpoint_corrupt events. Start without --resume or restore the files."
        )
