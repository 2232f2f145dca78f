"""What ``raysc serve`` hands to vLLM: a Hugging Face Llama folder, found or made from a source.

A source is one of
- a raysc run directory (has ``config.toml``): its newest verified checkpoint, or ``step``, is
  exported once to ``<run>/serve/step_N`` and reused while the checkpoint's manifest is unchanged
  (``export.json`` records the manifest's digest); when the run's checkpoints live in an object
  store, the export is also uploaded next to them (``<checkpoint.uri>/serve/step_N``) so replicas
  on other nodes mirror it from there;
- a Hugging Face folder (has ``config.json``), e.g. the output of ``raysc export`` or
  ``raysc quantize``, served as it is;
- an ``s3://`` (or other fsspec) URI of such a folder: Ray Serve LLM mirrors it onto each replica's
  node (``CloudMirrorConfig``), reading the endpoint from ``AWS_ENDPOINT_URL_S3``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from raysc.checkpoint.storage import step_name

EXPORT_RECORD = "export.json"  # what a cached export was made from
EXPORT_FORMAT = 2  # raise when export_hf's output changes, so cached exports are made again (2: chat template)


@dataclass(frozen=True)
class ServedModel:
    """A folder vLLM loads, and where it came from."""

    path: str  # a local folder, or a remote URI (mirrored by Ray Serve LLM)
    step: int | None = None  # the checkpoint step, for a run source
    checkpoint: str | None = None  # the checkpoint's URI, for a run source
    run_dir: Path | None = None
    reused: bool = False  # an existing export of the same checkpoint was reused
    local: str | None = None  # a local copy of a remote folder (a run's export), if this machine has one

    @property
    def remote(self) -> bool:
        return "://" in self.path


def is_run_dir(source: str) -> bool:
    return "://" not in source and (Path(source) / "config.toml").is_file()


def resolve(source: str, step: int | None = None) -> ServedModel:
    """The folder to serve for ``source`` (see the module docstring); exports a run's checkpoint when
    no export of that exact checkpoint exists yet."""
    if "://" in source:
        import fsspec

        fs, root = fsspec.core.url_to_fs(source)
        root = root.rstrip("/")
        if not fs.exists(f"{root}/config.json"):
            raise FileNotFoundError(
                f"{source} holds no config.json: serve an export folder from the object store "
                f"(written by `raysc serve RUN_DIR` or `raysc export`), or a run directory"
            )
        return ServedModel(source.rstrip("/"), *_recorded_step(fs, f"{root}/{EXPORT_RECORD}"))
    path = Path(source)
    if is_run_dir(source):
        return export_run(path, step)
    if (path / "config.json").is_file():
        if step is not None:
            raise ValueError(f"--step applies to a run directory; {source} is an export folder (one step already)")
        from fsspec.implementations.local import LocalFileSystem

        return ServedModel(str(path.resolve()), *_recorded_step(LocalFileSystem(), str(path / EXPORT_RECORD)))
    raise FileNotFoundError(
        f"{source} is neither a raysc run directory (config.toml) nor a Hugging Face folder "
        f"(config.json); pass run.dir of a training run, an export folder or an s3:// export"
    )


def newest_verified_step(run_dir: Path) -> int | None:
    """The newest committed, verified checkpoint step the run in ``run_dir`` wrote (None if none yet)."""
    from raysc.export.restore import newest_verified, run_store

    return newest_verified(*run_store(run_dir))


def export_run(run_dir: Path, step: int | None = None) -> ServedModel:
    """Export ``step`` (default: the newest verified) of the run in ``run_dir`` to ``<run>/serve/step_N``,
    unless that folder already holds an export of the same manifest."""
    from raysc.export.restore import newest_verified, run_store

    run_dir = run_dir.resolve()
    store, mine = run_store(run_dir)
    if step is None:
        step = newest_verified(store, mine)
        if step is None:
            raise FileNotFoundError(
                f"run {run_dir} has no committed, verified checkpoint yet; train it first "
                f"(or wait for its first checkpoint: `raysc serve --follow` does)"
            )
    manifest = store.read_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"run {run_dir} has no committed checkpoint at step {step} (steps: {mine})")
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    out = run_dir / "serve" / step_name(step)
    record = {
        "format": EXPORT_FORMAT,
        "step": step,
        "checkpoint": f"{store.uri}/{step_name(step)}",
        "manifest_sha256": digest,
    }
    remote = None if store.storage.is_local else f"{store.uri.rstrip('/')}/serve/{step_name(step)}"
    reused = _same_export(out, record)
    if not reused:
        from raysc.export.hf import export_hf
        from raysc.export.restore import load_run
        from raysc.model.hf_names import require_dense

        run = load_run(run_dir, step)
        require_dense(run.model.cfg, "served (vLLM's MoE path is not verified here yet)")
        tmp = out.with_name(out.name + ".partial")
        export_hf(run.model, run.tokenizer_path, tmp)
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2))
        if out.exists():
            import shutil

            shutil.rmtree(out)
        tmp.rename(out)  # a crash mid-export leaves only a .partial folder, never a half export
    if remote is not None:
        _upload_once(out, store.storage.fs, f"{store.storage.root}/serve/{step_name(step)}")
    return ServedModel(remote or str(out.resolve()), step, record["checkpoint"], run_dir, reused, str(out.resolve()))


def _recorded_step(fs, record_path: str) -> tuple[int | None, str | None]:
    """(step, checkpoint URI) from a run export's ``export.json``; (None, None) for a folder that has
    none (``raysc export``, ``raysc quantize`` and other Hugging Face folders). With the step known, `raysc
    serve` reports what it serves and a follower of the same run rolls only onto newer checkpoints."""
    try:
        with fs.open(record_path, "r") as f:
            record = json.load(f)
        return int(record["step"]), record.get("checkpoint")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def _same_export(out: Path, record: dict) -> bool:
    try:
        return json.loads((out / EXPORT_RECORD).read_text()) == record
    except (OSError, ValueError):
        return False


def _upload_once(local: Path, fs, root: str) -> None:
    """Copy the export folder to ``root`` on ``fs`` unless an identical ``export.json`` is already there;
    the record goes last, so a remote folder with a record is complete."""
    try:
        if fs.cat_file(f"{root}/{EXPORT_RECORD}") == (local / EXPORT_RECORD).read_bytes():
            return
    except FileNotFoundError:
        pass
    for f in sorted(local.iterdir()):
        if f.name != EXPORT_RECORD:
            fs.put_file(str(f), f"{root}/{f.name}")
    fs.put_file(str(local / EXPORT_RECORD), f"{root}/{EXPORT_RECORD}")
