"""How a config key is declared: a dataclass field with its default, help text and validation rules
(read by ``raysc.config.load`` and ``raysc.config.reference``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field with a default, a help text and validation rules.

    Rules understood by the loader: ``min``, ``max`` (inclusive), ``gt`` (strict
    lower bound) and ``choices``; ``key`` is the TOML name when it differs from the
    field name (``checkpoint.async`` is ``async_save`` in Python).
    """
    return field(default=default, metadata={"help": help, **rules})


def opt_dict(help: str) -> Any:
    """A table-valued option (default empty)."""
    return field(default_factory=dict, metadata={"help": help})
