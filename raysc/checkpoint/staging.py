"""Staging checkpoints on local disk with torch.distributed.checkpoint, checksummed at the source.

Every rank writes its DCP shards (collective over the checkpoint group) into a
node-local directory, then uploads them (``CheckpointStore.upload``). DCP's own
``FileSystemWriter`` does the writing; we only give it a file system whose
write streams hash the bytes as DCP writes them (``HashingFileSystem``). The
manifest's SHA-256 is then the digest of the bytes DCP produced, so:

- the upload does not hash again (on a busy host the second pass competed with
  the transfer for CPU), and
- corruption anywhere after DCP wrote a file (local disk, transfer, store) is
  caught by the checksum on load.

Loading goes through DCP, which reshards to the current layout, with its two
unpickling seams replaced (``raysc.checkpoint.safe_dcp``); the per-rank state is
safetensors + JSON (``raysc.checkpoint.rank_state``). Before any collective load,
each rank parses ``.metadata`` and its rank-state file itself, so a file that is
not data is refused on every rank alike (``CorruptCheckpoint``) and the restore
can fall back to an older checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from raysc.checkpoint.rank_state import BadRankState, load_rank_state, save_rank_state
from raysc.checkpoint.safe_dcp import (
    LOAD_ERRORS,
    CheckpointRejected,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_metadata,
    rejection_in,
)
from raysc.checkpoint.store import CorruptCheckpoint
from raysc.hashing import file_sha256

Digest = tuple[int, str]  # (size in bytes, sha256 hex)
# optimizer state and param-group settings keyed by parameter name, not by group index: pipeline
# stages hold different parameters in "group 0", and only per-name keys reshard between layouts
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
WRITE_THREADS = 2


class _HashingStream:
    """A write stream that hashes what passes through it. A seek makes the digest unusable
    (DCP writes sequentially; if that ever changes, the upload hashes the file instead)."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self._hash = hashlib.sha256()
        self.size = 0
        self.sequential = True

    def write(self, data) -> int:
        n = self._raw.write(data)
        view = memoryview(data).cast("B")
        self._hash.update(view[:n] if n is not None else view)
        self.size += n if n is not None else view.nbytes
        return n

    def seek(self, *args):
        self.sequential = False
        return self._raw.seek(*args)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def __getattr__(self, name: str):  # tell, flush, fileno, close ... go to the file
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system, recording (size, sha256) of every file written through it."""

    def __init__(self) -> None:
        self.digests: dict[str, Digest | None] = {}

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        self.digests[Path(path).name] = (stream.size, stream.hexdigest()) if stream.sequential else None

    def rename(self, path, new_path) -> None:  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        self.digests[Path(new_path).name] = self.digests.pop(Path(path).name, None)


@dataclass
class Staged:
    """A rank's shards being written: ``wait()`` returns {file name: (size, sha256)} once on disk."""

    fs: HashingFileSystem
    future: Future | None = None
    extra: dict = field(default_factory=dict)

    def wait(self) -> dict[str, Digest]:
        if self.future is not None:
            self.future.result()
        return {name: d for name, d in {**self.fs.digests, **self.extra}.items() if d is not None}


def write_shards(
    local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group=None, asynchronous: bool = False
) -> Staged:
    """Write this rank's DCP shards (collective over ``group``) into ``local_dir``. Asynchronously,
    the state is copied to CPU memory now and written by a background thread; ``Staged.wait()``
    returns when the files are on disk."""
    local_dir.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
    # staging, not the durable copy: skip fsync (the store holds the durable copy)
    # two writer threads (two files per rank): hashing in the writing threads then costs no time
    writer = FileSystemWriter(str(local_dir), sync_files=False, thread_count=WRITE_THREADS)
    writer.fs = fs = HashingFileSystem()
    state = {"model": msd, "optim": osd}
    if asynchronous:
        return Staged(fs, dcp.async_save(state, storage_writer=writer, process_group=group))
    dcp.save(state, storage_writer=writer, process_group=group)
    return Staged(fs)


def save_extra(staged: Staged, local_dir: Path, extra: dict, rank: int) -> None:
    """This rank's non-tensor state (step, tokens, loader cursor, scheduler, RNG, detectors), as data."""
    path = local_dir / extra_name(rank)
    save_rank_state(path, extra)
    staged.extra[path.name] = (path.stat().st_size, file_sha256(path))


def stage_shards(
    local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, rank: int, group=None
) -> tuple[list[str], dict[str, Digest]]:
    """Write this rank's DCP shards and extra state into ``local_dir``; return the files it wrote
    and their digests."""
    staged = write_shards(local_dir, model, optimizer, group)
    save_extra(staged, local_dir, extra, rank)
    return rank_files(local_dir, rank), staged.wait()


def extra_name(rank: int) -> str:
    return f"extra_rank{rank}.safetensors"


def rank_files(local_dir: Path, rank: int) -> list[str]:
    names = [p.name for p in local_dir.glob(f"__{rank}_*.distcp")] + [extra_name(rank)]
    if rank == 0 and (local_dir / ".metadata").is_file():
        names.append(".metadata")
    return sorted(names)


def load_local(
    local_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int, step: int = -1
) -> dict:
    """Load tensors in place from a local copy of checkpoint ``step`` (DCP reshards as needed) and
    return this rank's training state. Raises ``CorruptCheckpoint`` when a file is not data.

    No collectives (DCP's ``no_dist``): every rank's local copy holds every file and the checkpoint's
    global metadata, so each rank plans its own reads (DCP's global load plan only gathers the local
    ones). The plan exchange cost a restore ~0.3 s on 2 cores. A file that is not data fails the ranks
    that read it; the supervisor then falls back to the previous checkpoint on every rank."""
    extra = local_dir / extra_name(rank)
    if not extra.is_file():  # resharded to more ranks than saved: counters and cursor are global
        extra = local_dir / extra_name(0)
    try:  # parsed here, by every rank, before the collective load: a bad file fails everywhere alike
        load_metadata((local_dir / ".metadata").read_bytes())
        state = load_rank_state(extra) if extra.is_file() else {}
    except CheckpointRejected as e:
        raise CorruptCheckpoint(step, e.file, e.reason) from None
    except BadRankState as e:
        raise CorruptCheckpoint(step, extra.name, str(e).removeprefix(f"{extra.name}: ")) from None
    reader = SafeFileSystemReader(str(local_dir))
    planner = SafeLoadPlanner()
    try:
        if optimizer is not None:
            msd, osd = get_state_dict(model, optimizer, options=OPTIONS)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)
            set_state_dict(
                model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=OPTIONS
            )
        else:
            msd = model.state_dict()
            dcp.load({"model": msd}, storage_reader=reader, planner=planner, no_dist=True)
            model.load_state_dict(msd)
    except LOAD_ERRORS as e:
        rejected = rejection_in(e)
        if rejected is None:
            raise
        raise CorruptCheckpoint(step, rejected.file, rejected.reason) from None
    return state
