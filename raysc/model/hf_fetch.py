"""Where ``model.init_from`` lives on this node: the directory itself, or a local copy of a URL.

safetensors reads a local, memory-mapped file, so a checkpoint in an object store (``s3://...``) is
copied once per node into ``data.cache_dir/init_from/<hash of the URL>/`` (a file lock lets the
ranks of one node share one copy; each file is written under a temporary name and renamed; config,
index and tokenizer are fetched every time, a weight file again when its size differs from the
store's). Only the files an import reads are
copied: config, index, weight files, tokenizer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

import fsspec

from raysc.config.paths import is_url
from raysc.model.hf_checkpoint import CONFIG, INDEX, TOKENIZER, WEIGHTS


def init_dir(source: str, options: dict, cache_dir: str | Path) -> Path:
    """A local directory holding the checkpoint ``source`` (a path, or a URL copied into the cache)."""
    if not is_url(source):
        return Path(source)  # HFCheckpoint says what is wrong with it, if anything
    local = Path(cache_dir) / "init_from" / hashlib.sha256(source.encode()).hexdigest()[:16]
    local.mkdir(parents=True, exist_ok=True)
    fs, root = fsspec.core.url_to_fs(source, **dict(options))
    root = root.rstrip("/")
    with open(local / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        names = [n for n in (CONFIG, INDEX, TOKENIZER) if fs.exists(f"{root}/{n}")]
        if CONFIG not in names:
            raise FileNotFoundError(
                f"model.init_from {source!r} has no {CONFIG}: point it at a Hugging Face "
                f"Llama checkpoint (what `raysc export` writes)"
            )
        for name in names:  # small: always fetched again
            _copy(fs, f"{root}/{name}", local / name, reuse=False)
        if INDEX in names:
            weights = sorted(set(json.loads((local / INDEX).read_text())["weight_map"].values()))
        else:
            weights = [WEIGHTS]
        for name in weights:
            _copy(fs, f"{root}/{name}", local / name)
    return local


def _copy(fs, remote: str, local: Path, reuse: bool = True) -> None:
    if reuse and local.is_file() and local.stat().st_size == fs.size(remote):
        return
    tmp = local.with_name(local.name + ".part")
    fs.get_file(remote, str(tmp))
    tmp.replace(local)
