"""Entry point for `ray job submit`: the same as `raysc preflight`.

    ray job submit --working-dir . -- python jobs/preflight.py --config jobs/configs/small.toml

Runs the pre-training checklist on the cluster the job runs in (a short probe run of the
config's own layout and checkpoint store), writes preflight.json and preflight.md into the
run directory and exits non-zero when an item fails. With `train.require_preflight = true`
the training job then refuses to start without a passing report for the same config.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working dir holds the raysc package

from raysc.cli import main as raysc_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="TOML config of the run to check")
    ap.add_argument("--steps", type=int, default=8, help="steps of the probe run")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    argv = ["preflight", args.config, "--steps", str(args.steps)]
    for item in args.overrides:
        argv += ["--set", item]
    return raysc_main(argv)


if __name__ == "__main__":
    sys.exit(main())
