"""The ``raysc data`` commands: their handlers and their row (``DATA``) for the command table of
``raysc.cli``. The work is ``raysc.data.verify``."""

from __future__ import annotations

import argparse
import json
import sys

from raysc.cli_table import SET, Command, arg


def cmd_data_verify(args: argparse.Namespace) -> int:
    from raysc.config.load import load_config
    from raysc.data.verify import verify_source

    cfg = load_config(args.config, args.overrides)
    source = args.source or cfg.data.source
    if source == "bundled":
        print("raysc data verify: give SOURCE (or a config whose data.source is a corpus on disk or in a store)")
        return 2
    vocab = cfg.model.vocab_size if (args.config or args.overrides) else None
    report = verify_source(source, dict(cfg.data.storage_options), vocab, log=lambda m: print(m, file=sys.stderr))
    out = report.to_dict()
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        for name, sha in out["sha256"].items():
            print(f"{sha}  {name}")
        what = "matched index.json's checksums" if report.recorded else "read and checked (no checksums recorded)"
        print(
            f"{source}: {out['files']} files, {out['bytes'] / 1e9:.3f} GB in {out['seconds']} s; "
            + ("all " + what if report.ok else f"{len(report.problems)} problem(s):")
        )
        for p in report.problems:
            print(f"  {p}")
    return 0 if report.ok else 1


DATA = Command(
    "data",
    "corpora as a run reads them",
    dest="data_cmd",
    sub=(
        Command(
            "verify",
            "read every byte of a corpus once: a `raysc pack` directory against the checksums its index.json "
            "records; .npy token files and Megatron datasets checked (headers, sizes, token ids below "
            "model.vocab_size) and their SHA-256 printed. Exit 1 naming each file that fails",
            cmd_data_verify,
            (
                arg("source", nargs="?", help="the corpus (default: the config's data.source); any fsspec URL"),
                arg("--config", help="TOML config: data.storage_options for a store, model.vocab_size for ids"),
                arg("--json", action="store_true", help="one JSON object on stdout"),
                SET,
            ),
        ),
    ),
)
