"""Entry point for `ray job submit`: the same as `raysc train`.

    ray job submit --working-dir . -- python jobs/pretrain.py --config jobs/configs/tiny.toml \
        --set train.steps=100

Connects to the cluster the job runs in (RAY_ADDRESS is set by the job server),
starts the supervisor and prints the JSON summary as its last line. `ray job stop`
(SIGTERM) stops it gracefully: it saves a checkpoint, exits 143 and prints the job
command that resumes it (docs/operations.md, "Stopping"; give the job time with
`--runtime-env-json '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "300"}}'`).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working dir holds the raysc package

from raysc.cli import main as raysc_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="TOML config, e.g. jobs/configs/tiny.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace another run's checkpoints in checkpoint.uri (deleted after this run's first commit)",
    )
    ap.add_argument("--inject", metavar="KIND@STEP[:RANK]", help="fault injection drill (docs/resilience.md)")
    args = ap.parse_args()
    argv = ["train", args.config, "--no-progress"]
    for item in args.overrides:
        argv += ["--set", item]
    if args.resume:
        argv.append("--resume")
    if args.overwrite:
        argv.append("--overwrite")
    if args.inject:
        argv += ["--inject", args.inject]
    # after `ray job stop` (SIGTERM) the job prints how to continue: the same job with --resume
    restart = [
        "ray",
        "job",
        "submit",
        "--working-dir",
        ".",
        "--",
        "python",
        "jobs/pretrain.py",
        "--config",
        args.config,
        *[a for o in args.overrides for a in ("--set", o)],
    ]
    return raysc_main(argv, restart_command=restart)


if __name__ == "__main__":
    sys.exit(main())
