"""The ``raysc scale`` and ``raysc mup coord-check`` commands: their handlers and their rows
(``SCALE``, ``MUP``) for the command table of ``raysc.cli``. The work is
``raysc.scaling.chinchilla`` and ``raysc.scaling.coord_check``."""

from __future__ import annotations

import argparse
import json

from raysc.cli_table import JSON, SET, Command, OneOf, arg
from raysc.config.load import load_config


def cmd_scale(args: argparse.Namespace) -> int:
    from raysc.scaling.chinchilla import format_plan, parse_count, plan

    cfg = load_config(args.config, args.overrides)
    given = {
        k: parse_count(v, f"--{k}")
        for k, v in (("params", args.params), ("compute", args.compute), ("tokens", args.tokens))
        if v is not None
    }
    if args.global_batch_tokens is not None:
        batch = parse_count(args.global_batch_tokens, "--global-batch-tokens")
    else:  # a config file's batch; the built-in default (2,048 tokens) means nothing at scale
        batch = cfg.train.global_batch_sequences * cfg.train.seq_len if args.config else None
    result = plan(**given, model=cfg.model, global_batch_tokens=batch, seq_len=cfg.train.seq_len)
    print(json.dumps(result) if args.json else format_plan(result))
    return 0


def cmd_mup_coord_check(args: argparse.Namespace) -> int:
    from raysc.scaling.coord_check import format_report, run

    cfg = load_config(args.config, args.overrides)
    try:
        widths = [int(w) for w in args.widths.split(",") if w.strip()]
    except ValueError:
        raise ValueError(f"--widths {args.widths!r}: expected comma-separated integers, e.g. 64,128,256,512") from None
    report = run(cfg, widths, args.steps, args.seeds, args.bound, args.out)
    print(format_report(report))
    print(f"wrote {report['files']['json']} and {report['files']['png']}")
    return 0 if report["passed"] else 1


SCALE = Command(
    "scale",
    "Chinchilla compute-optimal params/tokens/compute, loss estimate and model shapes (docs/scaling.md)",
    cmd_scale,
    (
        arg("config", nargs="?", help="TOML config whose vocab, GQA ratio and batch are used"),
        OneOf(
            (
                arg("--params", help="parameters N, e.g. 1.3e9 or 7B"),
                arg("--compute", help="training FLOPs C, e.g. 1e21"),
                arg("--tokens", help="training tokens D, e.g. 1.4T"),
            ),
            required=True,
        ),
        arg(
            "--global-batch-tokens",
            help="tokens per optimizer step, for the step count (default: the config's batch, when a config is given)",
        ),
        SET,
        JSON.but(help="print one JSON object"),
    ),
)

MUP = Command(
    "mup",
    "μP tools",
    dest="mup_cmd",
    sub=(
        Command(
            "coord-check",
            "train SP and μP models at several widths for a few steps; check that μP "
            "activations stay flat across widths (PNG + JSON)",
            cmd_mup_coord_check,
            (
                arg("config", help="TOML config: depth, head_dim, vocab, data, batch, optim.lr"),
                arg("--widths", default="64,128,256,512", help="comma-separated model.dim values"),
                arg("--steps", type=int, default=5),
                arg("--seeds", type=int, default=1, help="average the activations over this many seeds"),
                arg("--bound", type=float, default=0.25, help="largest μP slope of log|activation| vs log width"),
                arg("--out", help="output folder (default <run.dir>/coord_check)"),
                SET,
            ),
        ),
    ),
)
