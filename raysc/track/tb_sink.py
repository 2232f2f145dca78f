"""TensorBoard: event files under ``<run dir>/tensorboard``, written with torch's ``SummaryWriter``.

A rewind (a rollback, a restart or ``--resume`` from an earlier checkpoint) reopens the writer with
``purge_step``: TensorBoard's readers then drop every event at or after that step logged before it,
so the re-run steps replace the discarded ones. A fresh run in a directory that holds another run's
event files purges from step 0 (nothing of the old run shows under the new one).

With ``track.tensorboard_uri`` the event files are also copied to a shared store (any fsspec URL),
so ``tensorboard --logdir s3://...`` shows a cluster run from anywhere: ``sync`` copies the files
that grew since the last copy (TensorBoard's writer appends, and object stores have no append, so
a grown file is put whole; scalar event files stay small).
"""

from __future__ import annotations

from pathlib import Path


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: Path, mirror: str = "", storage_options: dict | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.mirror = mirror.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._writer = None
        self._copied: dict[str, int] = {}  # file -> size when last copied to the mirror
        self._store = None

    def _open_writer(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is not None:
            self._writer.close()
        self._writer = SummaryWriter(str(self.log_dir), purge_step=purge_step, flush_secs=30)

    def open(self, run_id: str | None) -> str:
        old = self.log_dir.is_dir() and any(self.log_dir.glob("events.out.tfevents.*"))
        # a fresh run (no id of ours recorded) over another run's files: hide all of theirs
        self._open_writer(0 if old and run_id is None else None)
        return str(self.log_dir)

    def params(self, params: dict[str, str], tags: dict[str, str]) -> None:
        rows = "\n".join(f"| {k} | `{v}` |" for k, v in sorted({**tags, **params}.items()))
        self._writer.add_text("config", "| key | value |\n|---|---|\n" + rows, 0)
        self._writer.flush()

    def metrics(self, rows: list[tuple[int, float, dict[str, float]]]) -> None:
        for step, t, values in rows:
            for k, v in values.items():
                self._writer.add_scalar(k, v, global_step=step, walltime=t)
        self._writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self._writer.add_text(f"events/{tag}", text, step)
        self._writer.flush()

    def rewind(self, step: int, why: str) -> None:
        self._open_writer(step + 1)
        self._writer.add_text("events/rewind", f"steps after {step} re-run: {why}", step + 1)
        self._writer.flush()

    def sync(self) -> None:
        """Copy every event file that grew since the last copy to ``mirror`` (if set)."""
        if not self.mirror:
            return
        from raysc.checkpoint.storage import Storage  # the options as checkpoint.storage_options takes them

        if self._writer is not None:
            self._writer.flush()
        if self._store is None:
            self._store = Storage(self.mirror, self.storage_options)
        for f in sorted(p for p in self.log_dir.rglob("*") if p.is_file()):
            rel, size = f.relative_to(self.log_dir).as_posix(), f.stat().st_size
            if self._copied.get(rel) != size:
                self._store.fs.put_file(str(f), f"{self._store.root}/{rel}")
                self._copied[rel] = size

    def close(self, status: str = "FINISHED") -> None:
        """Close the writer and make the last copy (a retried close only copies again)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.sync()
