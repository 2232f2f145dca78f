"""Reading torch.distributed.checkpoint (DCP) files without letting them run code.

DCP (torch 2.13) unpickles two things on load: the ``.metadata`` file
(``FileSystemReader.read_metadata`` calls ``pickle.load``) and every non-tensor
value in the ``.distcp`` shards (``DefaultLoadPlanner.load_bytes`` calls
``torch.load(weights_only=False)``; our optimizer's param-group settings are such
values). A pickle can name any callable, so either file, written by someone with
access to the store, could run code on every rank that restores it.

Here DCP does the reading and resharding as before, with two seams replaced:

- ``SafeFileSystemReader.read_metadata`` unpickles ``.metadata`` with an
  unpickler that resolves only DCP's own metadata dataclasses and enums,
  ``torch.Size``, torch dtypes/layouts and ``pathlib`` paths: data types whose
  constructors only store their arguments. Anything else is refused.
- ``SafeLoadPlanner.load_bytes`` uses ``torch.load(weights_only=True)``
  (tensors and primitive containers only).

This is defence in depth: signed manifests (``raysc.checkpoint.signing``) stop
a writer without the key before any byte is parsed; these seams keep an
unsigned store from being a remote-code-execution hole too.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class CheckpointRejected(ValueError):
    """A checkpoint file holds something other than data (or is not what its name says); it is not loaded."""

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(f"{file}: {reason}")
        self.file, self.reason = file, reason

    def __reduce__(self):
        return (CheckpointRejected, (self.file, self.reason))


def _is_data_type(obj: Any) -> bool:
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


def _allowed(module: str, name: str) -> Any | None:
    """The object ``module.name`` if a DCP metadata file may reference it, else None."""
    if module == dcp_md.__name__:
        obj = getattr(dcp_md, name, None)
        return obj if _is_data_type(obj) else None
    if module == dcp_fs.__name__ and name == "_StorageInfo":
        return dcp_fs._StorageInfo
    if module == "torch":
        obj = getattr(torch, name, None)
        return obj if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
    if module == "torch.serialization" and name == "_get_layout":  # looks a layout up by its name
        return torch.serialization._get_layout
    if module == "pathlib" and name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    if module == "collections" and name == "OrderedDict":
        import collections

        return collections.OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise CheckpointRejected(
                ".metadata", f"references {module}.{name}, which is not DCP metadata (refused: it could run code)"
            )
        return obj


def load_metadata(data: bytes) -> Metadata:
    """Parse the bytes of a DCP ``.metadata`` file; raise ``CheckpointRejected`` if it is not plain metadata."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointRejected:
        raise
    except Exception as e:  # truncated or garbage pickles raise anything from EOFError to TypeError
        raise CheckpointRejected(".metadata", f"unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointRejected(".metadata", f"holds a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """DCP's local reader, with ``.metadata`` parsed by ``load_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointRejected(
                f"value {read_item.dest_index.fqn!r} of a .distcp shard",
                f"not plain data (refused: {str(e).splitlines()[0]})",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


LOAD_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException derives from BaseException


def rejection_in(exc: BaseException) -> CheckpointRejected | None:
    """The ``CheckpointRejected`` behind ``exc``, also when DCP wrapped it (``CheckpointException``
    carries each rank's failure) or chained it."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointRejected):
            return e
        for failure in getattr(e, "failures", {}).values():  # DCP's CheckpointException: rank -> (exc, tb)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e.__cause__, e.__context__]
    return None
