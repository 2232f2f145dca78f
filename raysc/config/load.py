"""Load, override, validate and write raysc configurations.

``load_config(path, overrides)`` reads a TOML file, applies ``section.key=value``
overrides and returns a checked ``Config``. Every problem raises ``ConfigError``
with the key, where it came from (file or ``--set``) and what is allowed, before
any actor or tensor exists. ``dump_config`` writes the resolved config back as
TOML (our config is two levels of scalars, so a small writer suffices and saves a
dependency).
"""

from __future__ import annotations

import dataclasses
import difflib
import copy
import hashlib
import math
import tomllib
from pathlib import Path
from typing import Any, Iterable

from raysc.config.dims import MULTI_STAGE
from raysc.config.schema import SECTIONS, Config


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: key, origin, what is allowed."""


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict}


def key_name(f: dataclasses.Field) -> str:
    """The TOML key of a field (``metadata['key']`` when the Python name differs)."""
    return f.metadata.get("key", f.name)


def _suggest(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" Did you mean '{close[0]}'?" if close else ""


def _plain(v: Any) -> bool:
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_plain(x) for x in v)
    return isinstance(v, (str, int, float, bool))


def _check_value(section: str, key: str, value: Any, spec: dataclasses.Field, origin: str) -> Any:
    where = f"{origin}: {section}.{key}"
    want = _TYPES[spec.type] if isinstance(spec.type, str) else spec.type
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is not bool and isinstance(value, bool) or not isinstance(value, want):
        raise ConfigError(
            f"{where} = {value!r} has type {type(value).__name__}; expected {want.__name__} "
            f"({spec.metadata['help']})."
        )
    if want is float and not math.isfinite(value):
        raise ConfigError(f"{where} = {value!r} must be a finite number.")
    rules = spec.metadata
    if want is dict and not _plain(value):
        raise ConfigError(f"{where}: values must be strings, numbers, booleans or tables of them.")
    if "choices" in rules and value not in rules["choices"]:
        raise ConfigError(f"{where} = {value!r} is not allowed; choose one of {rules['choices']}.")
    if "min" in rules and value < rules["min"]:
        raise ConfigError(f"{where} = {value!r} is too small; it must be >= {rules['min']} ({rules['help']}).")
    if "max" in rules and value > rules["max"]:
        raise ConfigError(f"{where} = {value!r} is too large; it must be <= {rules['max']} ({rules['help']}).")
    if "gt" in rules and not value > rules["gt"]:
        raise ConfigError(f"{where} = {value!r} must be > {rules['gt']} ({rules['help']}).")
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, origin: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(
            f"{origin}: unknown section '[{section}]'.{_suggest(section, SECTIONS)} "
            f"Sections are: {', '.join(SECTIONS)}."
        )
    sub = getattr(cfg, section)
    fields = {key_name(f): f for f in dataclasses.fields(sub)}
    fields.update({f.name: f for f in dataclasses.fields(sub)})  # dicts from config_to_dict use field names
    if key not in fields:
        names = [key_name(f) for f in dataclasses.fields(sub)]
        raise ConfigError(
            f"{origin}: unknown key '{section}.{key}'.{_suggest(key, names)} "
            f"Keys of [{section}] are: {', '.join(names)}."
        )
    f = fields[key]
    setattr(sub, f.name, _check_value(section, key_name(f), value, f, origin))


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.steps=50.")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key must be section.key, e.g. optim.lr.")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set run.name=demo
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Read ``path`` (optional), apply ``overrides`` and validate the result."""
    cfg = Config()
    explicit: set[str] = set()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; see jobs/configs/ for examples.")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}.") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"{p}: top-level key '{section}' must be a [section] table; "
                    f"sections are: {', '.join(SECTIONS)}."
                )
            for key, value in table.items():
                _apply(cfg, section, key, value, str(p))
                explicit.add(f"{section}.{key}")
    for item in overrides:
        section, key, value = _parse_override(item)
        _apply(cfg, section, key, value, "--set")
        explicit.add(f"{section}.{key}")
    if "train.global_batch_tokens" in explicit and "train.global_batch" not in explicit:
        cfg.train.global_batch = 0  # the token count replaces the default sequence count
    validate(cfg, origin=str(path) if path else "defaults")
    return cfg


def validate(cfg: Config, origin: str = "config") -> None:
    """Cross-key checks that a single field's rules cannot express."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if cfg.data.schedule:
        from raysc.data.mixture import parse_schedule

        try:
            parse_schedule(cfg.data.schedule)
        except ValueError as e:
            raise ConfigError(f"{origin}: data.schedule: {e}") from None
    d = cfg.dedup
    if d.bands * d.rows != d.num_perm:
        raise ConfigError(f"{origin}: dedup.bands × dedup.rows = {d.bands} × {d.rows} = {d.bands * d.rows} must "
                          f"equal dedup.num_perm = {d.num_perm}; e.g. 14 × 8 = 112.")
    from raysc.curate.quality import parse_ngram_limits

    for key in ("top_ngram_max", "dup_ngram_max"):
        try:
            parse_ngram_limits(getattr(cfg.quality, key))
        except ValueError as e:
            raise ConfigError(f"{origin}: quality.{key}: {e}") from None
    if m.dim % m.n_heads:
        raise ConfigError(f"{origin}: model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}.")
    if m.head_dim % 2:
        raise ConfigError(
            f"{origin}: head dim model.dim/model.n_heads={m.head_dim} must be even for rotary embeddings."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"{origin}: model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
            f"(grouped-query attention shares each KV head among n_heads/n_kv_heads query heads)."
        )
    if m.max_seq_len and m.max_seq_len < t.seq_len:
        raise ConfigError(
            f"{origin}: model.max_seq_len={m.max_seq_len} is shorter than train.seq_len={t.seq_len}; "
            f"raise it or set it to 0 (= train.seq_len)."
        )
    if cfg.checkpoint.keep_every_steps and cfg.checkpoint.every_steps and \
            cfg.checkpoint.keep_every_steps % cfg.checkpoint.every_steps:
        raise ConfigError(
            f"{origin}: checkpoint.keep_every_steps={cfg.checkpoint.keep_every_steps} is not a multiple of "
            f"checkpoint.every_steps={cfg.checkpoint.every_steps}, so no checkpoint would match it.")
    if bool(t.global_batch) == bool(t.global_batch_tokens):
        raise ConfigError(
            f"{origin}: set exactly one of train.global_batch (sequences) or train.global_batch_tokens "
            f"(got global_batch={t.global_batch}, global_batch_tokens={t.global_batch_tokens})."
        )
    if t.global_batch_tokens and t.global_batch_tokens % t.seq_len:
        raise ConfigError(
            f"{origin}: train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
            f"train.seq_len={t.seq_len}; use {max(1, t.global_batch_tokens // t.seq_len) * t.seq_len}."
        )
    gb, dp = t.global_batch_sequences, par.dp
    if gb % dp:
        raise ConfigError(
            f"{origin}: the global batch of {gb} sequences is not divisible by the data-parallel size "
            f"dp_replicate×dp_shard={dp}."
        )
    local = gb // dp
    if t.micro_batch and local % t.micro_batch:
        raise ConfigError(
            f"{origin}: train.micro_batch={t.micro_batch} does not divide the {local} sequences each "
            f"data-parallel rank processes per step (global batch {gb} / dp {dp})."
        )
    _validate_layout(cfg, origin)
    from raysc.fleet.faults import parse_faults

    try:
        faults = parse_faults(cfg.supervisor.inject)
    except ValueError as e:
        raise ConfigError(f"{origin}: supervisor.inject: {e}") from None
    for f in faults:
        if f.rank >= par.world_size:
            raise ConfigError(f"{origin}: supervisor.inject: rank {f.rank} in {f.spec!r} does not exist "
                              f"(world size {par.world_size}).")
    if t.dtype == "bf16" and par.device == "cpu":
        raise ConfigError(f"{origin}: train.dtype='bf16' needs parallel.device='cuda'; use 'auto' or 'fp32'.")


def _validate_layout(cfg: Config, origin: str) -> None:
    """Checks of the parallel layout against the model and batch, each naming the numbers and a fix."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if par.tp > 1:
        for what, n in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                        ("model.vocab_size", m.vocab_size), ("the SwiGLU hidden size", m.hidden_ffn_dim)):
            if n % par.tp:
                raise ConfigError(f"{origin}: {what}={n} is not divisible by parallel.tp={par.tp}; "
                                  f"pick a tp that divides it.")
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError(f"{origin}: parallel.sequence_parallel needs parallel.tp > 1.")
    if par.cp > 1 and t.seq_len % (2 * par.cp):
        raise ConfigError(f"{origin}: train.seq_len={t.seq_len} is not divisible by 2×parallel.cp={2 * par.cp} "
                          f"(context parallelism gives each rank an early and a late chunk).")
    v = par.pp_virtual_stages
    if v > 1 and par.pp_schedule not in MULTI_STAGE:
        raise ConfigError(f"{origin}: parallel.pp_virtual_stages={v} needs an interleaved schedule "
                          f"(parallel.pp_schedule = {' or '.join(map(repr, MULTI_STAGE))}).")
    if par.pp == 1:
        return
    if m.n_layers % (par.pp * v):
        raise ConfigError(f"{origin}: model.n_layers={m.n_layers} is not divisible by parallel.pp×"
                          f"pp_virtual_stages={par.pp}×{v}={par.pp * v}; change either so each stage gets "
                          f"the same number of layers.")
    if m.tie_embeddings:
        raise ConfigError(f"{origin}: model.tie_embeddings cannot be used with parallel.pp={par.pp} "
                          f"(the embedding and output live on different stages); set it to false.")
    if t.micro_batch:
        raise ConfigError(f"{origin}: with pipeline parallelism set parallel.pp_microbatches, not "
                          f"train.micro_batch.")
    if par.pp_schedule in MULTI_STAGE and v < 2:
        raise ConfigError(f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs "
                          f"parallel.pp_virtual_stages >= 2.")
    micro = par.pp_microbatches or par.pp
    local = t.global_batch_sequences // par.dp
    if local % micro:
        raise ConfigError(f"{origin}: the global batch of {t.global_batch_sequences} sequences is not divisible by "
                          f"dp×microbatches={par.dp}×{micro}; each data-parallel rank's {local} sequences must "
                          f"split into parallel.pp_microbatches={micro} equal microbatches.")
    if par.pp_schedule != "gpipe" and micro < par.pp:
        raise ConfigError(f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs at least pp={par.pp} "
                          f"microbatches, got parallel.pp_microbatches={micro}.")
    rounds = max(1, micro // par.pp)
    if par.pp_schedule in MULTI_STAGE and micro % rounds:
        raise ConfigError(f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs pp_microbatches to be a "
                          f"multiple of {rounds} (pp_microbatches // pp); use {rounds * par.pp}.")


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict[str, dict[str, Any]], origin: str = "saved config") -> Config:
    cfg = Config()
    for section, table in data.items():
        for key, value in table.items():
            _apply(cfg, section, key, value, origin)
    validate(cfg, origin)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def dump_config(cfg: Config) -> str:
    """The resolved config as TOML, secrets redacted; ``load_config`` reads it back to an equal Config
    (but for redacted values)."""
    from raysc.config.secrets import redact

    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        out.append(f"[{section.name}]")
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            if f.metadata.get("secret") and v:
                v = "***"
            out.append(f"{key_name(f)} = {_toml_value(redact(v) if isinstance(v, dict) else v)}")
        out.append("")
    return "\n".join(out)


def config_hash(cfg: Config) -> str:
    """Identity of a run's configuration. Fault-injection drills (``supervisor.inject``, which a
    restart consumes as faults fire) do not change what is trained, so they are left out."""
    clean = copy.deepcopy(cfg)
    clean.supervisor.inject = ""
    return hashlib.sha256(dump_config(clean).encode()).hexdigest()[:16]
