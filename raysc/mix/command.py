"""The ``raysc mix tune`` command: its handler and its row (``MIX``) for the command table of
``raysc.cli``. The work is ``raysc.mix.tune.tune_mixture``."""

from __future__ import annotations

import argparse
import json

from raysc.cli_table import SET, Command, arg


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cmd_mix_tune(args: argparse.Namespace) -> int:
    from raysc.mix.tune import TuneOptions, tune_mixture

    opts = TuneOptions(
        target=args.target,
        domains=[d for d in args.domains.split(",") if d.strip()],
        proxies=args.proxies,
        steps=args.steps,
        concentration=args.concentration,
        seed=args.seed,
        late_fraction=args.late_fraction,
        validate_seeds=_ints(args.validate_seeds),
        validate_steps=args.validate_steps,
        eval_rows=args.eval_rows,
        concurrency=args.concurrency,
        out=args.out or "",
    )
    report = tune_mixture(args.config, args.overrides, opts)
    out = {k: report[k] for k in ("target", "tuned", "schedule", "two_phase_schedule", "fit", "plot")}
    if "validation" in report:
        v = report["validation"]
        out["validation"] = {
            "target_loss": {a: v["arms"][a]["target_loss"] for a in v["arms"]},
            "tuned_minus_natural": v["tuned_minus_natural"],
        }
    print(json.dumps(out), flush=True)
    print(f'train with it: --set data.schedule="{report["schedule"]}"', flush=True)
    return 0


MIX = Command(
    "mix",
    "domain mixtures",
    dest="mix_cmd",
    sub=(
        Command(
            "tune",
            "train proxy runs on sampled domain mixtures, regress the target domain's held-out loss on "
            "the mixture (RegMix), write the best as a data.schedule fragment and validate it against the "
            "natural proportions (mix_tune.json, schedule.toml, a PNG)",
            cmd_mix_tune,
            (
                arg(
                    "config",
                    help="TOML config whose data.source is a `raysc pack` directory (the proxies' model and batch)",
                ),
                arg("--target", required=True, help="the domain whose held-out loss the mixture should lower"),
                arg("--domains", default="", help="comma-separated domains to mix (default: every domain of the data)"),
                arg("--proxies", type=int, default=12, help="proxy runs (the first on the natural mixture)"),
                arg("--steps", type=int, default=0, help="steps of each proxy (default: the config's train.steps)"),
                arg(
                    "--concentration",
                    type=float,
                    default=4.0,
                    help="Dirichlet concentration of the sampled mixtures around the natural ones (smaller = wider)",
                ),
                arg("--seed", type=int, default=0, help="seed of the mixture draws"),
                arg(
                    "--late-fraction",
                    type=float,
                    default=0.2,
                    help="two-phase variant: share of the tokens trained on the tuned mixture, at the end",
                ),
                arg(
                    "--validate-seeds",
                    default="1",
                    help="comma-separated seeds of the validation runs (natural, tuned, two-phase); empty = no validation",
                ),
                arg("--validate-steps", type=int, default=0, help="steps of each validation run (default: --steps)"),
                arg("--eval-rows", type=int, default=64, help="held-out rows per domain each run is scored on"),
                arg(
                    "--concurrency",
                    type=int,
                    default=0,
                    help="runs at once (default: as many as the cluster's CPUs, or GPUs, hold)",
                ),
                arg("--out", help="output folder (default <run.dir>/mix_tune)"),
                SET,
            ),
        ),
    ),
)
