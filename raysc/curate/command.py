"""The ``raysc curate`` and ``raysc pack`` commands: their handlers and their rows (``CURATE``, ``PACK``)
for the command table of ``raysc.cli``. The work is ``raysc.curate.pipeline.curate`` and
``raysc.curate.pack.pack_curated``."""

from __future__ import annotations

import argparse
import importlib
import json
import threading
from collections.abc import Callable

from raysc.cli_table import SET, Command, arg
from raysc.config.load import load_config


def _import_while(start: Callable[[], None], modules: tuple[str, ...]) -> None:
    """Run ``start`` (starting Ray: ~3 s, mostly waiting for its processes) while a thread imports
    ``modules`` that the command needs later, then wait for both. ``ray.data`` (0.4 s) and the report's
    ``matplotlib.figure`` (0.3 s) share 8 of the ~700 modules they load with ``ray.init`` (Ray's usage
    library, ``gzip``, ``pkgutil``, ``socketserver``): Python's per-module import locks make the second
    importer of a module wait for the first. A module that fails to import here fails again, with its
    error, where used."""

    def load() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - reported where the module is used
                return

    loader = threading.Thread(target=load, name="raysc-imports", daemon=True)
    loader.start()
    try:
        start()
    finally:
        loader.join()


def cmd_curate(args: argparse.Namespace) -> int:
    from raysc.curate.pipeline import curate
    from raysc.fleet.driver import ensure_ray

    cfg = load_config(args.config, args.overrides)
    _import_while(ensure_ray, ("ray.data", "matplotlib.figure"))
    if args.audit:
        from raysc.curate.audit import run_audit

        print(json.dumps(run_audit(cfg)), flush=True)
        return 0
    report = curate(cfg)
    print(
        json.dumps(
            {k: report[k] for k in ("output", "documents", "removed", "domains", "kept_bytes", "seconds_total")}
        ),
        flush=True,
    )
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from raysc.curate.pack import pack_curated
    from raysc.data.prepare import special_tokens
    from raysc.fleet.driver import ensure_ray

    cfg = load_config(args.config, args.overrides)
    curated = cfg.curated_uri
    ensure_ray()
    out = args.out or f"{curated}/packed"
    tokenizer = args.tokenizer or cfg.data.tokenizer or None
    special = special_tokens(cfg, tokenizer) if tokenizer else None  # data.eos_token / bos_token / add_bos
    index = pack_curated(
        curated,
        tokenizer,
        cfg.model.vocab_size,
        cfg.train.seq_len,
        out,
        dict(cfg.curate.storage_options),
        sample_mb=cfg.data.tokenizer_sample_mb,
        seed=cfg.train.seed,
        special=special,
        fmt=args.format,
    )
    print(
        json.dumps({d: {k: v for k, v in m.items() if k != "shards"} for d, m in index["domains"].items()}), flush=True
    )
    if args.format == "megatron":  # Megatron-LM / NeMo: --data-path [weight] prefix ...
        print(
            "Megatron --data-path: "
            + " ".join(f"{out.rstrip('/')}/{p}" for m in index["domains"].values() for p in m["shards"]),
            flush=True,
        )
    print(f'train on it with: --set data.source="{out}" [--set data.schedule="0:..."]', flush=True)
    return 0


CURATE = Command(
    "curate",
    "dedup, quality-score and tag documents with Ray Data; write Parquet and a report",
    cmd_curate,
    (
        arg("config", help="TOML config with [curate], [dedup] and [quality] sections (all optional)"),
        SET.but(help="e.g. --set curate.input='\"s3://bucket/raw/*.jsonl\"'"),
        arg(
            "--audit",
            action="store_true",
            help="inject rewritten copies at known similarity and report near-dedup recall and precision",
        ),
    ),
)

PACK = Command(
    "pack",
    "tokenize curated documents into per-domain token shards (train.seq_len)",
    cmd_pack,
    (
        arg("config", help="the config used for `raysc curate` (its curate.output is read)"),
        arg(
            "--tokenizer",
            help="an existing tokenizer.json (default data.tokenizer, else a BPE of "
            "model.vocab_size trained on data.tokenizer_sample_mb of the documents)",
        ),
        arg("--out", help="where the shards and index.json go (default <curate.output>/packed)"),
        arg(
            "--format",
            choices=["raysc", "megatron"],
            default="raysc",
            help="raysc: rows of train.seq_len + 1 tokens; megatron: Megatron-LM indexed datasets (.bin/.idx, a "
            "document per sequence) that Megatron-LM and NeMo read and raysc trains on too",
        ),
        SET,
    ),
)
