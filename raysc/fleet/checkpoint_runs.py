"""Whose checkpoints these are: the run id a run claims, and which committed steps belong to it.

``RunOwnership`` decides a run's id before any worker starts (recorded in ``run.json`` and every
manifest), refuses a fresh run over another run's committed checkpoints unless ``--overwrite`` (whose
steps it deletes only once this run commits), remembers each committed step's run id, and reads the
trackers' run ids back from a manifest. ``parse_resume_from`` splits a ``--resume-from`` spec.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from raysc.checkpoint.store import RUN_FILE, CheckpointStore, read_run_id
from raysc.config.schema import Config
from raysc.fleet.errors import RunFailed
from raysc.fleet.events import EventKind


def parse_resume_from(spec: str) -> tuple[str, int]:
    """'s3://bucket/run/step_00000100' -> ('s3://bucket/run', 100)."""
    m = re.match(r"^(?P<root>.*?)/?step_(?P<step>\d+)/?$", spec)
    if not m:
        raise RunFailed(f"--resume-from {spec!r}: expected URI/step_NNNNNNNN (see `raysc ckpt list URI`)")
    return m["root"], int(m["step"])


class RunOwnership:
    """This run's id, the trackers' run ids, and each committed step's owner (read once per manifest)."""

    def __init__(self, cfg: Config, store: CheckpointStore, event: Callable[..., dict]) -> None:
        self.cfg, self.store, self.event = cfg, store, event
        self.run_id = ""  # recorded in run.json and every manifest (``claim``)
        self.trackers: dict[str, str] = {}  # the [track] trackers' run ids, in every manifest
        self.replacing: list[int] = []  # another run's steps, deleted once this run commits (--overwrite)
        self._run_of: dict[int, str | None] = {}  # a committed step's run id (its manifest never changes)

    def claim(self, resume: bool | str, overwrite: bool, run_dir: Path) -> str:
        """Decide this run's id before any worker starts, and refuse to start a fresh run over another
        run's committed checkpoints unless ``overwrite`` (which deletes nothing until this run commits).
        The id goes to ``run_dir/run.json`` and into every manifest; restores take only this run's."""
        committed = self.store.steps()
        own_store = not isinstance(resume, str) or parse_resume_from(resume)[0].rstrip(
            "/"
        ) == self.cfg.checkpoint_uri.rstrip("/")
        if resume is False or not own_store:
            if committed and not overwrite:
                owners = sorted({o or "unknown" for o in self.owners(committed).values()})
                raise RunFailed(
                    f"checkpoint.uri {self.cfg.checkpoint_uri} already holds committed checkpoints (steps "
                    f"{committed}) of run {', '.join(owners)}; a fresh run would mix its checkpoints with them. "
                    f"Continue that run with --resume, start a new one with another run.dir or checkpoint.uri, "
                    f"or pass --overwrite to replace them (nothing is deleted until this run commits its first "
                    f"checkpoint)."
                )
            self.run_id = uuid.uuid4().hex[:12]
            self.replacing = committed if overwrite else []
            if self.replacing:
                self.event(
                    EventKind.CHECKPOINT_OVERWRITE_PENDING,
                    steps=committed,
                    note="--overwrite: these are deleted once this run commits its first checkpoint",
                )
        else:
            recorded = read_run_id(run_dir)
            newest = self.owners(committed[-1:]).get(committed[-1]) if committed else None
            self.run_id = recorded or newest or uuid.uuid4().hex[:12]
        (run_dir / RUN_FILE).write_text(json.dumps({"run_id": self.run_id, "checkpoint_uri": self.cfg.checkpoint_uri}))
        return self.run_id

    def tracker_ids(self, resume: bool | str) -> dict[str, str]:
        """The trackers' run ids in the manifest of the checkpoint ``resume`` names (the newest
        committed one for ``True``); empty when there is none."""
        if isinstance(resume, str):
            root, step = parse_resume_from(resume)
            store = (
                self.store
                if root.rstrip("/") == self.cfg.checkpoint_uri.rstrip("/")
                else CheckpointStore.for_config(self.cfg, root)
            )
        else:
            store, steps = self.store, self.store.steps()
            if not steps:
                return {}
            step = steps[-1]
        ids = (store.read_manifest(step) or {}).get("trackers") or {}
        return {k: v for k, v in ids.items() if isinstance(v, str)}

    def owners(self, steps: list[int]) -> dict[int, str | None]:
        """Each step's run id; a manifest is read once (retention asks at every save), an unreadable one again."""
        for s in set(steps) - self._run_of.keys():
            manifest = self.store.read_manifest(s)
            if manifest is not None:
                self._run_of[s] = manifest.get("run_id")
        return {s: self._run_of.get(s) for s in steps}

    def own_steps(self) -> list[int]:
        """Committed steps written by this run (or by a raysc that recorded no run id), oldest first."""
        return [s for s, o in self.owners(self.store.steps()).items() if o in (None, self.run_id)]

    def committed(self, step: int) -> None:
        """Record that this run committed ``step`` (so its manifest need not be read)."""
        self._run_of[step] = self.run_id

    def delete_replaced(self) -> None:
        """--overwrite: delete the other run's checkpoints once this run has committed one of its own."""
        if self.replacing:
            for old in self.replacing:
                self.store.delete_committed(old)
            self.event(
                EventKind.PREVIOUS_RUN_DELETED, steps=self.replacing, note="--overwrite, after this run's first commit"
            )
            self.replacing = []
