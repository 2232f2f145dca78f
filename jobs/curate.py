"""Entry point for `ray job submit`: the same as `raysc curate`.

    ray job submit --working-dir . -- python jobs/curate.py --config jobs/configs/curate.toml \
        --set curate.input='"s3://bucket/raw/"' --set curate.output='"s3://bucket/curated"'

Connects to the cluster the job runs in, runs the Ray Data curation pipeline and prints a JSON
summary as its last line (the full report is report.json under curate.output).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working dir holds the raysc package

from raysc.cli import main as raysc_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="TOML config, e.g. jobs/configs/curate.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    argv = ["curate", args.config]
    for item in args.overrides:
        argv += ["--set", item]
    return raysc_main(argv)


if __name__ == "__main__":
    sys.exit(main())
