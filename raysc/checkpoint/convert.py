"""`raysc ckpt convert`: turn a checkpoint of the previous format (v3) into the current one, deliberately.

v3 kept each rank's training state as a pickle (``extra_rank{r}.pt``), which a
restore no longer unpickles. Converting is the one place raysc reads those files,
and only when a user asks for it: each file is checked against the manifest's
SHA-256, read with ``torch.load(weights_only=True)`` (tensors and primitive
containers only; anything else is refused, not converted), written as a rank-state
file (``raysc.checkpoint.rank_state``) and uploaded under its new name. Then the
manifest is replaced by a v4 one (signed when a key is set): this is the only
rewrite of a committed object raysc does, and it is atomic (a manifest is one
object). The old ``.pt`` files are deleted last.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import torch

from raysc.checkpoint.rank_state import save_rank_state
from raysc.checkpoint.staging import extra_name
from raysc.checkpoint.store import CONVERTIBLE, FORMAT, CheckpointStore, CorruptCheckpoint


def convert_step(store: CheckpointStore, step: int) -> list[str]:
    """Convert committed checkpoint ``step`` from v3 to v4 in place; return the new files' names."""
    manifest = store.read_manifest(step)
    if manifest is None:
        raise FileNotFoundError(f"step {step}: no manifest under {store.uri} (never committed)")
    if manifest.get("format") == FORMAT:
        return []
    if manifest.get("format") != CONVERTIBLE:
        raise ValueError(f"step {step}: format {manifest.get('format')!r} cannot be converted (only {CONVERTIBLE!r})")
    old = [e for e in manifest["files"] if e["path"].startswith("extra_rank") and e["path"].endswith(".pt")]
    keep = [e for e in manifest["files"] if e not in old]
    new_entries = []
    with tempfile.TemporaryDirectory(prefix="raysc-convert-") as tmp:
        local = Path(tmp)
        for entry in old:
            rank = int(entry["path"][len("extra_rank") : -len(".pt")])
            path = local / entry["path"]
            size, sha = store.storage.download_file(
                f"{store.prefix(step)}/{entry['path']}", str(path), size_hint=entry["size"]
            )
            if (size, sha) != (entry["size"], entry["sha256"]):
                raise CorruptCheckpoint(step, entry["path"], "size or sha256 differs from the manifest: not converted")
            try:
                state = torch.load(path, weights_only=True)
            except pickle.UnpicklingError as e:
                raise ValueError(
                    f"step {step}: {entry['path']} holds more than tensors and primitive containers "
                    f"({str(e).splitlines()[0]}); refusing to convert it"
                ) from None
            out = local / extra_name(rank)
            save_rank_state(out, state)
            new_entries += store.upload(step, local, [out.name])
        meta = {k: v for k, v in manifest.items() if k not in ("format", "step", "time", "files", "signature")}
        meta["converted_from"] = CONVERTIBLE
        store.commit(step, keep + new_entries, meta)  # the manifest is replaced in one write
    for entry in old:
        store.storage.delete(f"{store.prefix(step)}/{entry['path']}")
    return [e["path"] for e in new_entries]
