"""A rank's non-tensor training state (step, tokens, loader cursor, scheduler, RNG, detectors) as data.

Written as one safetensors file: the tensors (RNG states) as safetensors tensors,
everything else as JSON in the file's metadata header. Reading it parses JSON and
raw tensor buffers and never unpickles anything, so whoever can write to the
checkpoint store cannot make a restore run code (docs/checkpointing.md, threat
model). We write this small codec ourselves because the state mixes tensors with
tuples, dicts keyed by ints and numpy scalars, and neither JSON nor safetensors
alone round-trips that exactly; anything else (an object, a function) is refused
when the checkpoint is written, so a new state key that is not data fails in tests,
not on a restore.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT = "raysc-rank-state-v1"
_TENSOR, _TUPLE, _DICT, _ARRAY, _FLOAT = (
    "__raysc_tensor__",
    "__raysc_tuple__",
    "__raysc_dict__",
    "__raysc_ndarray__",
    "__raysc_float__",
)
_MARKERS = (_TENSOR, _TUPLE, _DICT, _ARRAY, _FLOAT)


class StateNotData(TypeError):
    """The state to save holds something that is not plain data (it would need pickle)."""


class BadRankState(ValueError):
    """A rank-state file is not a valid raysc rank-state file (altered, truncated or foreign)."""


def _encode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else {_FLOAT: repr(v)}  # JSON has no nan/inf
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {_TENSOR: name}
    if isinstance(value, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value).copy())
        return {_ARRAY: name}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in value):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
        return {
            _DICT: [
                [_encode(k, tensors, f"{where} key"), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()
            ]
        }
    raise StateNotData(
        f"rank state {where}: a {type(value).__name__} is not data (tensors, numbers, strings, "
        f"lists, tuples and dicts only); convert it before it goes into a checkpoint"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((key, inner),) = value.items()
        if key == _TENSOR:
            return tensors[inner]
        if key == _ARRAY:
            return tensors[inner].numpy()
        if key == _TUPLE:
            return tuple(_decode(v, tensors) for v in inner)
        if key == _DICT:
            return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
        if key == _FLOAT:
            return float(inner)
    return {k: _decode(v, tensors) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor, np.ndarray)):
        raise BadRankState(f"a dict key of type {type(key).__name__}")
    return key


def save_rank_state(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` (a ``.safetensors`` file); raises ``StateNotData`` for non-data values."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    save_file(tensors, str(path), metadata={"format": FORMAT, "state": json.dumps(tree)})


def load_rank_state(path: Path) -> dict:
    """Read a file written by ``save_rank_state`` (JSON and raw tensors; nothing is unpickled)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT or "state" not in meta:
                raise BadRankState(f"{path.name}: not a raysc rank-state file (format {meta.get('format')!r})")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        state = _decode(json.loads(meta["state"]), tensors)
    except BadRankState:
        raise
    except (SafetensorError, ValueError, KeyError, TypeError, OSError) as e:
        raise BadRankState(f"{path.name}: unreadable rank state ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise BadRankState(f"{path.name}: the state is a {type(state).__name__}, not a table")
    return state
