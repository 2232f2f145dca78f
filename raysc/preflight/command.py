"""The ``raysc preflight`` command: its handler and its row (``PREFLIGHT``) for the command table of
``raysc.cli``. The work is ``raysc.preflight.run.run_preflight``."""

from __future__ import annotations

import argparse

from raysc.cli_table import SET, Command, arg
from raysc.config.load import load_config


def cmd_preflight(args: argparse.Namespace) -> int:
    from raysc.preflight.run import run_preflight

    cfg = load_config(args.config, args.overrides)
    report = run_preflight(cfg, steps=args.steps)
    print(f"report -> {cfg.run_dir}/preflight.json, preflight.md", flush=True)
    return 0 if report["passed"] else 1


PREFLIGHT = Command(
    "preflight",
    "run the pre-training checklist on the fleet; preflight.json + .md; exit 1 on a fail",
    cmd_preflight,
    (
        arg("config", help="the TOML config of the run to check"),
        arg("--steps", type=int, default=8, help="steps of the probe run (>= 6)"),
        SET,
    ),
)
