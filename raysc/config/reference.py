"""Render the configuration reference (docs/config.md) from the schema.

``python -m raysc.config.reference > docs/config.md``; a test checks the file is current.
"""

from __future__ import annotations

import dataclasses

from raysc.config.schema import Config


def _rules(meta: dict) -> str:
    parts = []
    if "choices" in meta:
        parts.append(" / ".join(f"`{c}`" for c in meta["choices"]))
    if "min" in meta:
        parts.append(f"≥ {meta['min']}")
    if "gt" in meta:
        parts.append(f"> {meta['gt']}")
    if "max" in meta:
        parts.append(f"≤ {meta['max']}")
    return ", ".join(parts)


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `raysc/config/schema.py` by `python -m raysc.config.reference`; do not edit by hand.",
        "",
        "A run is configured by a TOML file with the sections below; any key can be overridden on the",
        "command line with `--set section.key=value` (the value is parsed as TOML; a bare word is a string).",
        "An unknown key, a wrong type or an impossible value stops the run before anything starts, with a",
        "message naming the key, the file (or `--set`) and what is allowed. The resolved configuration is",
        "written to `<run.dir>/config.toml`.",
        "",
        "Cross-key rules: `model.dim` divisible by `model.n_heads` with an even head dim; `model.n_kv_heads`",
        "divides `model.n_heads`; exactly one of `train.global_batch` / `train.global_batch_tokens` (setting",
        "the token count clears the default sequence count); `train.global_batch_tokens` a multiple of",
        "`train.seq_len`; the global batch divisible by the data-parallel size and the local batch by",
        '`train.micro_batch`; `train.dtype = "bf16"` only on `cuda`. Parallel layout rules (tp divides heads,',
        "KV heads, vocabulary and SwiGLU width; pp × virtual stages divides layers; 2·cp divides seq_len; the",
        "local batch splits into `pp_microbatches`, and `train.micro_batch`, when set under pp, agrees with",
        "them; schedule needs) are listed in docs/parallelism.md.",
        "",
    ]
    for section in dataclasses.fields(Config):
        lines += [f"## [{section.name}]", "", "| key | default | allowed | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(section.default_factory()):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = (
                f'"{default}"'
                if isinstance(default, str)
                else str(default).lower()
                if isinstance(default, bool)
                else "{}"
                if isinstance(default, dict)
                else repr(default)
            )
            lines.append(
                f"| `{section.name}.{f.metadata.get('key', f.name)}` | `{shown}` | {f.type} {_rules(f.metadata)} "
                f"| {f.metadata['help']} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
