"""Checkpoints in any fsspec store: one prefix per step, a manifest written last.

Layout under ``checkpoint.uri``::

    step_00000100/
        .metadata, __0_0.distcp, __1_0.distcp ...  torch.distributed.checkpoint shards (model + optimizer)
        extra_rank0.safetensors ...                per rank: step, tokens, loader cursor, scheduler, RNG
                                                   (JSON + tensors, ``raysc.checkpoint.rank_state``)
        manifest.json                              written last: step, tokens, layout, config + hash,
                                                   every file with size and sha256, loader state,
                                                   and an HMAC signature when a key is set

Rules (``docs/checkpointing.md``): a checkpoint exists only when its manifest
exists and every file it lists is there with the recorded size (and, when
loading, the recorded SHA-256). The newest is found by listing manifests; no
object is rewritten in place: a prefix left by a save that died before its
commit is deleted before that step is saved again. Retention un-commits (deletes
the manifest) before deleting files, and never touches the checkpoint being
restored.

Nothing read from the store is unpickled by raysc: the manifest is JSON, the
per-rank state is safetensors + JSON, and DCP's files go through
``raysc.checkpoint.safe_dcp``. With a signing key (``raysc.checkpoint.signing``)
the manifest's signature is checked before anything else is read, and every
file's SHA-256 before it is parsed.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from raysc.checkpoint.failures import PermanentStorageError, permanent_reason
from raysc.checkpoint.local_copies import local_copy_dir  # noqa: F401  (its older home; importers use it from here)
from raysc.checkpoint.signing import Signer
from raysc.checkpoint.storage import Storage
from raysc.hashing import file_sha256

# v3: optimizer state flattened by parameter name; v4: per-rank state as safetensors + JSON (v3 pickled it)
FORMAT = "raysc-ckpt-v4"
CONVERTIBLE = "raysc-ckpt-v3"  # `raysc ckpt convert` turns it into FORMAT
MANIFEST = "manifest.json"
FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class CorruptCheckpoint(RuntimeError):
    """A file of a committed checkpoint is missing, truncated or altered."""

    def __init__(self, step: int, file: str, reason: str) -> None:
        super().__init__(f"checkpoint step {step}: {file}: {reason}")
        self.step, self.file, self.reason = step, file, reason

    def __reduce__(self):  # crosses process boundaries (Ray) intact
        return (CorruptCheckpoint, (self.step, self.file, self.reason))


@dataclass
class CheckpointStore:
    uri: str
    options: dict = field(default_factory=dict)
    concurrency: int = 0  # parallel parts per file transfer (checkpoint.transfer_concurrency); 0 = auto
    signer: Signer = field(default_factory=Signer)  # signs commits, checks manifests before anything is read

    def __post_init__(self) -> None:
        self.storage = Storage(self.uri, self.options, self.concurrency)

    @classmethod
    def for_config(cls, cfg, uri: str | None = None) -> CheckpointStore:
        """The store of ``cfg``'s checkpoint settings at ``uri`` (default: ``cfg.checkpoint_uri``)."""
        return cls(
            uri or cfg.checkpoint_uri,
            cfg.checkpoint.storage_options,
            cfg.checkpoint.transfer_concurrency,
            Signer.resolve(cfg.checkpoint.signing_key),
        )

    # ---- listing and verification ----
    def prefix(self, step: int) -> str:
        return self.storage.step_prefix(step)

    def read_manifest(self, step: int) -> dict | None:
        try:
            return json.loads(self.storage.read_bytes(f"{self.prefix(step)}/{MANIFEST}"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def steps(self) -> list[int]:
        """Steps with a manifest, oldest first."""
        out = []
        for name in self.storage.step_dirs():
            try:
                step = int(name.split("_", 1)[1])
            except ValueError:
                continue
            if self.storage.exists(f"{name}/{MANIFEST}"):
                out.append(step)
        return sorted(out)

    def verify(self, step: int, checksums: bool = False) -> str | None:
        """None when ``step`` is intact; else why not. Sizes always, SHA-256 if ``checksums``."""
        manifest = self.read_manifest(step)
        if manifest is None:
            return "no manifest (never committed)"
        reason = self.check_manifest(step, manifest)
        if reason:
            return reason
        for entry in manifest["files"]:
            rel = f"{self.prefix(step)}/{entry['path']}"
            try:
                size = self.storage.size(rel)
            except FileNotFoundError:
                return f"{entry['path']}: missing"
            if size != entry["size"]:
                return f"{entry['path']}: size {size} != recorded {entry['size']} (truncated or altered)"
            if checksums and self.storage.sha256(rel) != entry["sha256"]:
                return f"{entry['path']}: sha256 mismatch (altered after commit)"
        return None

    def check_manifest(self, step: int, manifest: dict) -> str | None:
        """None when ``manifest`` is one this raysc reads and its signature satisfies the signer; else why not."""
        fmt = manifest.get("format")
        if fmt == CONVERTIBLE:
            return (
                f"format {fmt!r} keeps per-rank state as pickle (extra_rank*.pt), which raysc no longer "
                f"unpickles: if you trust whoever could write this store, convert it once with "
                f"`raysc ckpt convert {self.uri} --step {step}`"
            )
        if fmt != FORMAT:
            return f"format {fmt!r}, this raysc reads {FORMAT!r}: load it with the raysc version that wrote it"
        reason = self.signer.check(manifest)
        if reason:
            return reason
        for entry in manifest.get("files", []):  # names are written under a local directory: no paths
            if (
                not isinstance(entry.get("path"), str)
                or not FILE_NAME.fullmatch(entry["path"])
                or entry["path"] in (".", "..")
            ):
                return f"file name {entry.get('path')!r} is not a plain checkpoint file name: refused"
        return None

    def signature_state(self, step: int) -> str:
        manifest = self.read_manifest(step)
        return "no manifest" if manifest is None else self.signer.describe(manifest)

    def latest(self, on_skip: Callable[[int, str], None] | None = None, checksums: bool = False) -> int | None:
        for step in reversed(self.steps()):
            reason = self.verify(step, checksums)
            if reason is None:
                return step
            if on_skip:
                on_skip(step, reason)
        return None

    # ---- writing ----
    def discard_uncommitted(self, step: int) -> bool:
        """Before saving ``step``: False if it is already committed, else clear any leftovers."""
        if self.read_manifest(step) is not None:
            return False
        self.storage.delete_prefix(self.prefix(step))
        return True

    def upload(
        self,
        step: int,
        local_dir: Path,
        names: list[str],
        digests: dict | None = None,
        retries: int = 3,
        backoff_s: float = 1.0,
        on_retry: Callable[[str, int, Exception], None] | None = None,
        after_file: Callable[[str], None] | None = None,
    ) -> list[dict]:
        """Upload ``names`` from ``local_dir``, up to ``concurrency`` files at once; return their
        manifest entries. ``digests`` holds (size, sha256) taken when the files were written;
        others are hashed on the way. A transient failure (throttling, 5xx, a dropped connection)
        is retried with exponential backoff; one that retrying cannot fix (no space, quota,
        permission, missing bucket: ``failures.permanent_reason``) raises ``PermanentStorageError``
        at once and the files not yet started are not attempted. Nothing is committed here."""
        digests = digests or {}
        doomed = threading.Event()  # a permanent error: the other files would fail the same way

        def one(name: str) -> dict:
            for attempt in range(retries + 1):
                if doomed.is_set():
                    raise PermanentStorageError("not attempted", "an earlier file hit a permanent error")
                try:
                    size, sha = self.storage.upload_file(
                        str(local_dir / name), f"{self.prefix(step)}/{name}", known=digests.get(name)
                    )
                    if after_file:
                        after_file(name)
                    return {"path": name, "size": size, "sha256": sha}
                except Exception as e:  # any client error (botocore's have no common base) is classified
                    reason = permanent_reason(e)
                    if reason is not None:
                        doomed.set()
                        raise PermanentStorageError(reason, f"{name}: {type(e).__name__}: {e}") from e
                    if attempt == retries:
                        raise
                    if on_retry:
                        on_retry(name, attempt + 1, e)
                    time.sleep(backoff_s * 2**attempt)
            raise AssertionError("unreachable")

        with ThreadPoolExecutor(max_workers=max(1, min(len(names), self.storage.concurrency))) as pool:
            futures = [pool.submit(one, name) for name in names]
            errors = [f.exception() for f in futures]
            first = next(
                (e for e in errors if isinstance(e, PermanentStorageError) and e.reason != "not attempted"),
                next((e for e in errors if e is not None), None),
            )
            if first is not None:
                raise first
            return [f.result() for f in futures]

    def write_receipt(self, step: int, rank: int, entries: list[dict]) -> None:
        """After every file of ``rank``'s part of ``step`` is durable: its manifest entries, so that
        the save can still be committed when the rank dies before the supervisor hears from it."""
        self.storage.write_bytes(f"{self.prefix(step)}/{RECEIPT.format(rank=rank)}", json.dumps(entries).encode())

    def read_receipt(self, step: int, rank: int) -> list[dict] | None:
        """``rank``'s upload receipt of ``step`` (its manifest entries), or None when it has none."""
        try:
            entries = json.loads(self.storage.read_bytes(f"{self.prefix(step)}/{RECEIPT.format(rank=rank)}"))
        except Exception:  # missing, unreadable or not JSON: that rank's upload is not known to be whole
            return None
        ok = isinstance(entries, list) and all(
            isinstance(e, dict)
            and isinstance(e.get("path"), str)
            and isinstance(e.get("size"), int)
            and isinstance(e.get("sha256"), str)
            for e in entries
        )
        return [{k: e[k] for k in ("path", "size", "sha256")} for e in entries] if ok else None

    def discard_failed(self, step: int) -> int:
        """After a failed save of ``step``: delete what it uploaded (never a committed checkpoint);
        return the bytes freed."""
        if self.read_manifest(step) is not None:
            return 0
        freed = self.storage.usage(self.prefix(step))
        self.storage.delete_prefix(self.prefix(step))
        return freed

    def commit(self, step: int, files: list[dict], meta: dict) -> dict:
        """Write the manifest (the commit point) after every file is durable."""
        manifest = self.signer.sign(
            {
                "format": FORMAT,
                "step": step,
                "time": time.time(),
                "files": sorted(files, key=lambda f: f["path"]),
                **meta,
            }
        )
        self.storage.write_bytes(f"{self.prefix(step)}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        return manifest

    def delete_committed(self, step: int) -> None:
        """Delete committed checkpoint ``step``: un-commit (delete the manifest) first, then its files."""
        self.storage.delete(f"{self.prefix(step)}/{MANIFEST}")
        self.storage.delete_prefix(self.prefix(step))

    def retention(
        self, keep_last: int, keep_every: int = 0, protect: int | None = None, steps: list[int] | None = None
    ) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep_last`` of ``steps`` (default: all;
        a run passes its own), sparing multiples of ``keep_every`` and ``protect``; return the
        deleted steps."""
        steps = self.steps() if steps is None else sorted(steps)
        doomed = [s for s in steps[:-keep_last] if s != protect and not (keep_every and s % keep_every == 0)]
        for s in doomed:
            self.delete_committed(s)
        return doomed

    # ---- reading ----
    def fetch(self, step: int, local_dir: Path, hot: dict | None = None, reuse_local: bool = True) -> tuple[dict, str]:
        """Make ``local_dir`` hold every file of ``step`` with its recorded SHA-256.

        Files already there and intact are kept (unless ``reuse_local`` is False); the rest come
        from ``hot`` (name -> bytes getter, the supervisor's in-memory copy) or the store, up to
        ``concurrency`` files at once. Returns (manifest, source). Raises ``CorruptCheckpoint``
        naming the first bad file (in manifest order); nothing is loaded from it.
        """
        manifest = self.read_manifest(step)
        if manifest is None:
            raise CorruptCheckpoint(step, MANIFEST, "missing")
        reason = self.check_manifest(step, manifest)
        if reason:  # before any file is fetched, let alone parsed
            raise CorruptCheckpoint(step, MANIFEST, reason)
        local_dir.mkdir(parents=True, exist_ok=True)
        files = manifest["files"]
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), self.storage.concurrency))) as pool:
            futures = [pool.submit(self._fetch_file, step, entry, local_dir, hot, reuse_local) for entry in files]
            sources = {f.result() for f in futures}
        source = "store" if "store" in sources else "hot" if "hot" in sources else "local"
        return manifest, source

    def _fetch_file(self, step: int, entry: dict, local_dir: Path, hot: dict | None, reuse_local: bool) -> str:
        """One file of ``fetch``; returns where its bytes came from."""
        target = local_dir / entry["path"]
        if (
            reuse_local
            and target.is_file()
            and target.stat().st_size == entry["size"]
            and file_sha256(target) == entry["sha256"]
        ):
            return "local"
        tmp = target.with_name(target.name + f".part{os.getpid()}")
        got, source = None, "hot"
        if hot and entry["path"] in hot:
            try:
                data = hot[entry["path"]]()
                tmp.write_bytes(data)
                got = (len(data), file_sha256(tmp))
            except Exception:  # the hot copy is a cache: any failure falls back to the store
                got = None
        if got is None or got != (entry["size"], entry["sha256"]):
            try:
                got = self.storage.download_file(
                    f"{self.prefix(step)}/{entry['path']}", str(tmp), size_hint=entry["size"]
                )
            except FileNotFoundError:
                raise CorruptCheckpoint(step, entry["path"], "missing from the store") from None
            source = "store"
        if got[0] != entry["size"]:
            tmp.unlink(missing_ok=True)
            raise CorruptCheckpoint(step, entry["path"], f"size {got[0]} != recorded {entry['size']}")
        if got[1] != entry["sha256"]:
            tmp.unlink(missing_ok=True)
            raise CorruptCheckpoint(step, entry["path"], "sha256 mismatch")
        tmp.replace(target)
        return source


RECEIPT = "upload-rank{rank}.json"  # in a step's prefix: one rank's uploaded entries, never in its manifest
RUN_FILE = "run.json"  # in a run directory: {"run_id": ..., "checkpoint_uri": ...}; manifests carry the id


def read_run_id(run_dir: str | Path) -> str | None:
    """The id a run directory's run put into its manifests (None for a run before run ids)."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text()).get("run_id")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None
