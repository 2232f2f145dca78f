"""The Llama model in plain torch, its μP parametrisation, its FLOP accounting and text generation.

``Llama`` and ``build_model`` load ``raysc.model.llama`` (and torch) on first use, so that importing
``raysc.model.flops`` (the planner, the CLI) does not cost a torch import (about 2.5 s of CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raysc.model.flops import flops_per_token, param_count

if TYPE_CHECKING:
    from raysc.model.llama import Llama, build_model

__all__ = ["Llama", "build_model", "flops_per_token", "param_count"]


def __getattr__(name: str):
    if name in ("Llama", "build_model"):
        from raysc.model import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'raysc.model' has no attribute {name!r}")
