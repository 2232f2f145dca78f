"""The commands that start or read a training run: ``raysc train`` (``TRAIN``), ``raysc parity``
(``PARITY``) and ``raysc status`` (``STATUS``), their handlers and their rows for the command table of
``raysc.cli``. The work is ``raysc.fleet.driver.train``, ``raysc.fleet.parity.run_parity`` and
``raysc.fleet.status.run_status``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from raysc.cli_table import JSON, RUN_DIR, SET, Command, arg
from raysc.config.faults import KINDS as FAULT_KINDS
from raysc.config.load import load_config

EXIT_CHECKPOINT_LAG = 3  # `raysc train` finished every step, but its last checkpoint(s) failed to save


def run_training(
    config: str | Path | None,
    overrides: list[str],
    resume: bool,
    resume_from: str | None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    from raysc.fleet.driver import check_inputs, train

    cfg = load_config(config, overrides)
    check_inputs(cfg)
    return train(cfg, resume=resume_from or resume, progress=progress, overwrite=overwrite)


def cmd_train(args: argparse.Namespace) -> int:
    from raysc.fleet.errors import RunStopped

    overrides = list(args.overrides)
    if args.inject:
        overrides.append(f"supervisor.inject={json.dumps(args.inject)}")
    if args.init_from:
        overrides.append(f"model.init_from={json.dumps(args.init_from)}")
    try:
        summary = run_training(
            args.config, overrides, args.resume, args.resume_from, not args.no_progress, args.overwrite
        )
    except RunStopped as e:
        restart = args.restart_command or [
            "raysc",
            "train",
            args.config,
            *[a for o in args.overrides for a in ("--set", o)],
            *(["--init-from", args.init_from] if args.init_from else []),
        ]
        if e.checkpoint is not None:
            print(f"resume with: {shlex.join([*restart, '--resume'])}", flush=True)
        else:  # nothing committed: start over (from the same checkpoint when one was given)
            again = [*restart, "--resume-from", args.resume_from] if args.resume_from else restart
            print(f"no checkpoint was committed; start again with: {shlex.join(again)}", flush=True)
        return e.exit_code
    print(json.dumps(summary), flush=True)
    lag = summary.get("checkpoint_lag_steps") or 0
    if lag:  # finished, but the newest durable state is behind: a scheduler must be able to see it
        print(
            f"error: training finished but the newest committed checkpoint is {lag} steps behind "
            f"({summary.get('failed_saves')} failed save(s); see the checkpoint_lagging events)",
            file=sys.stderr,
        )
        return EXIT_CHECKPOINT_LAG
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from raysc.fleet.parity import run_parity

    report = run_parity(
        args.config,
        args.layout,
        args.overrides,
        steps=args.steps,
        rtol=args.rtol,
        work_dir=args.work_dir,
        progress=False,
    )
    print(report.table())
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from raysc.fleet.status import run_status

    st = run_status(args.run_dir)
    if args.json:
        print(json.dumps(st))
        return 0
    gp = f"{st['goodput']:.1%}" if st["goodput"] is not None else "-"
    print(
        f"{st['run_dir']}: {st['state']}, step {st['step']}/{st['total_steps']}, loss {st['loss']}, "
        f"{(st['tokens_per_s'] or 0):.0f} tokens/s, goodput {gp}"
    )
    print(
        f"restarts {st['restarts']}, skipped updates {st['skipped_updates']}, failed saves "
        f"{st['failed_saves']}, last checkpoint {st['last_checkpoint']}, running {st['wall_s']} s over "
        f"{st['sessions']} session(s)"
    )
    if st.get("resizes"):
        print(f"elastic: data-parallel size {st['dp']} now; resized: " + "; ".join(st["resizes"]))
    print("recent: " + "; ".join(st["last_events"]))
    if st.get("trackers"):
        print(
            "trackers: "
            + "; ".join(
                f"{name} {t.get('state')}"
                + (f" (run {t['run_id']})" if t.get("run_id") else "")
                + (f": {t['error']}" if t.get("state") != "ok" and t.get("error") else "")
                for name, t in st["trackers"].items()
            )
        )
    if st.get("serving"):
        sv = st["serving"]
        print(
            f"serving: {sv['model_id']} at {sv['url']} (step {sv['step']}, app {sv['app']}, replicas {sv['replicas']})"
        )
    return 0


TRAIN = Command(
    "train",
    "train a model from a TOML config",
    cmd_train,
    (
        arg("config", help="TOML config, e.g. jobs/configs/tiny.toml"),
        SET.but(help="override a config key, e.g. --set train.steps=50 (repeatable)"),
        arg("--resume", action="store_true", help="continue from the newest verified checkpoint"),
        arg(
            "--resume-from",
            metavar="URI/step_N",
            help="continue from this checkpoint (any run's, any layout: it is resharded)",
        ),
        arg(
            "--overwrite",
            action="store_true",
            help="start afresh even though checkpoint.uri holds another run's checkpoints: they are deleted "
            "once this run commits its first checkpoint (never before)",
        ),
        arg(
            "--init-from",
            metavar="HF_DIR|URL",
            default=None,
            help="continued pre-training: start from this Hugging Face Llama checkpoint (same as --set "
            "model.init_from=...; its tokenizer.json is used when present)",
        ),
        arg("--no-progress", action="store_true", help="no progress bar (log lines only)"),
        arg(
            "--inject",
            metavar="KIND@STEP[:RANK][/PHASE]",
            default=None,
            help=f"fault injection drill, same as --set supervisor.inject=... (kinds: {', '.join(FAULT_KINDS)}; "
            "comma-separated)",
        ),
    ),
)

PARITY = Command(
    "parity",
    "check that a parallel layout reproduces single-process training",
    cmd_parity,
    (
        arg("config", help="TOML config (the model, data and batch to compare)"),
        arg("--layout", required=True, help="parallel degrees, e.g. pp=2,tp=2 or cp=2,tp=2"),
        arg("--steps", type=int, default=10),
        arg("--rtol", type=float, default=1e-4, help="largest relative difference that matches"),
        arg("--work-dir", default="runs/parity", help="where the two runs are written"),
        SET,
    ),
)

STATUS = Command("status", "summarise a running or finished run from its records", cmd_status, (RUN_DIR, JSON))
