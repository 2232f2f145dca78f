"""Which configuration values are secrets, and how they are written: as '***'.

Lives in config (the bottom layer) because ``dump_config`` redacts with it; the
checkpoint store re-exports ``redact`` for storage options it logs.
"""

from __future__ import annotations

from typing import Any

SECRET_WORDS = ("secret", "password", "token", "key", "credential", "session")
REDACTED = "***"  # what a secret is written as (config.toml, logs); readers treat it as unset


def redact(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every value whose key looks secret replaced by '***' (recursively)."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, dict):
            out[k] = redact(v)
        elif any(w in k.lower() for w in SECRET_WORDS):
            out[k] = REDACTED
        else:
            out[k] = v
    return out
