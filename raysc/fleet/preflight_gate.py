"""The pre-flight gate: with ``train.require_preflight`` a run starts only when
``<run.dir>/preflight.json`` passed for the same config.

``raysc.preflight`` writes that report (stamped with ``preflight_hash``) and runs its probe
through the driver; the driver checks the gate before any worker starts. The gate sits below
both, and imports only config, so the ``raysc`` command can catch ``PreflightRequired``
without starting Ray.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from raysc.config.load import config_hash
from raysc.config.paths import absolutize
from raysc.config.schema import Config


class PreflightRequired(RuntimeError):
    """``train.require_preflight`` is set and no passing pre-flight report is there for this config."""


def preflight_hash(cfg: Config) -> str:
    """The config's identity for the pre-flight gate: paths made absolute (as a run sees them), and
    ``train.require_preflight`` itself left out."""
    clean = absolutize(copy.deepcopy(cfg))
    clean.train.require_preflight = False
    return config_hash(clean)


def require_passing(cfg: Config) -> None:
    """Raise ``PreflightRequired`` unless ``<run.dir>/preflight.json`` (``raysc preflight``) passed
    for this config."""
    path = Path(cfg.run_dir).resolve() / "preflight.json"
    if not path.is_file():
        raise PreflightRequired(
            f"train.require_preflight is set but {path} does not exist: run `raysc preflight` with this config first"
        )
    report = json.loads(path.read_text())
    if report.get("config_hash") != preflight_hash(cfg):
        raise PreflightRequired(
            f"{path} is for config {report.get('config_hash')}, this config is "
            f"{preflight_hash(cfg)}: the config changed since the pre-flight; run it again"
        )
    if not report.get("passed"):
        failed = [f"{i['name']}: {i['summary']}" for i in report["items"] if i["status"] == "fail"]
        raise PreflightRequired(
            f"the pre-flight in {path} failed ({'; '.join(failed)}); fix it and re-run `raysc preflight`"
        )
