"""Load, override, validate and write raysc configurations.

``load_config(path, overrides)`` reads a TOML file, applies ``section.key=value``
overrides and returns a checked ``Config``: each value against its field's rules
as it is read, then the cross-key checks of ``raysc.config.checks``. Every problem
raises ``ConfigError`` with the key, where it came from (file or ``--set``) and what
is allowed, before any actor or tensor exists. ``dump_config`` writes the resolved config back as
TOML (our config is two levels of scalars, so a small writer suffices and saves a
dependency).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tomllib

from raysc.config.checks import ConfigError, validate
from raysc.config.schema import SECTIONS, Config
from raysc.config.secrets import REDACTED, redact

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
            f"{where} = {value!r} has type {type(value).__name__}; expected {want.__name__} ({spec.metadata['help']})."
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
                    f"{p}: top-level key '{section}' must be a [section] table; sections are: {', '.join(SECTIONS)}."
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
    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        out.append(f"[{section.name}]")
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            if f.metadata.get("secret") and v:
                v = REDACTED
            out.append(f"{key_name(f)} = {_toml_value(redact(v) if isinstance(v, dict) else v)}")
        out.append("")
    return "\n".join(out)


def config_hash(cfg: Config) -> str:
    """Identity of a run's configuration. Fault-injection drills (``supervisor.inject``, which a
    restart consumes as faults fire) and the trackers it logs to (``[track]``) do not change what
    is trained, so they are left out; so is the size an elastic run has now (``parallel.elastic``: its
    data-parallel size and the micro-batching that keeps its global batch follow the cluster)."""
    clean = copy.deepcopy(cfg)
    clean.supervisor.inject = ""
    clean.track = type(cfg.track)()
    if clean.parallel.elastic:
        setattr(clean.parallel, clean.parallel.elastic_dim, clean.parallel.min_dp)
        clean.parallel.pp_microbatches = clean.train.micro_batch = 0
    return hashlib.sha256(dump_config(clean).encode()).hexdigest()[:16]
