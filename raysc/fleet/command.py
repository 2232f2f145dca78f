"""The ``raysc ckpt`` subcommands: list, verify, convert a store's checkpoints; ask a run for one now.

``CKPT`` is their entry in the command table of ``raysc.cli``. Here in ``fleet`` rather than ``checkpoint``
because ``ckpt now`` asks a running fleet (``fleet.stopping``), and ``checkpoint`` sits below ``fleet``."""

from __future__ import annotations

import argparse
import json
import sys

from raysc.cli_table import JSON, RUN_DIR, STEP, Command, arg


def cmd_ckpt_now(args: argparse.Namespace) -> int:
    from raysc.fleet.stopping import request_checkpoint

    path = request_checkpoint(args.run_dir)
    print(
        f"asked the run for a checkpoint at its next step boundary ({path}); its events.jsonl records "
        f"checkpoint_requested, then checkpoint_saved",
        flush=True,
    )
    return 0


class StoreUnreadable(RuntimeError):
    """The checkpoint location could not be listed (unreachable endpoint, credentials, permissions)."""


def _ckpt_store(args: argparse.Namespace):
    """The store ``args.uri`` names; a run directory (its ``config.toml``) stands for its own
    ``checkpoint.uri`` and storage options, as the other commands that take a run take it."""
    from pathlib import Path

    from raysc.checkpoint.signing import Signer
    from raysc.checkpoint.storage import parse_storage_options
    from raysc.checkpoint.store import CheckpointStore

    uri, options = args.uri, parse_storage_options(args.storage_options or "")
    if (Path(uri) / "config.toml").is_file():
        from raysc.config.load import load_config

        cfg = load_config(Path(uri) / "config.toml")
        uri, options = cfg.checkpoint_uri, options or dict(cfg.checkpoint.storage_options)
        print(f"{args.uri} is a run directory: its checkpoints are at {uri}", file=sys.stderr)
    # RAYSC_CHECKPOINT_KEY (and _PREVIOUS_KEYS) verify signatures; without them signatures are shown, not checked
    return CheckpointStore(uri, options, signer=Signer.resolve())


def _steps(store, uri: str) -> list[int]:
    """The committed steps, or ``StoreUnreadable`` naming the location and what to check."""
    try:
        return store.steps()
    except Exception as e:  # botocore / fsspec errors of every kind: one line for the user, not a traceback
        raise StoreUnreadable(
            f"cannot list checkpoints under {uri}: {type(e).__name__}: {e}. Check the endpoint "
            f"(--storage-options '{{\"endpoint_url\": ...}}' or AWS_ENDPOINT_URL) and the "
            f"credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        ) from None


def cmd_ckpt_list(args: argparse.Namespace) -> int:
    import datetime

    store = _ckpt_store(args)
    rows = []
    for step in _steps(store, args.uri):
        m = store.read_manifest(step) or {}
        reason = store.verify(step, checksums=args.checksums)
        layout = m.get("layout", {})
        rows.append(
            {
                "step": step,
                "time": datetime.datetime.fromtimestamp(m.get("time", 0)).isoformat(timespec="seconds"),
                "bytes": sum(f["size"] for f in m.get("files", [])),
                "layout": ",".join(f"{k}={v}" for k, v in layout.items() if k != "world_size" and v != 1) or "single",
                "verified": "yes" if reason is None else f"no: {reason}",
                "signature": store.signer.describe(m),
                "run_id": m.get("run_id"),
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'step':>10}  {'time':19}  {'size':>10}  {'run':12}  {'layout':24}  verified / signature")
    for r in rows:
        print(
            f"{r['step']:>10}  {r['time']:19}  {r['bytes'] / 1e6:8.1f}MB  {r['run_id'] or '-':12}  "
            f"{r['layout']:24}  {r['verified']} / {r['signature']}"
        )
    if not rows:
        print(f"no committed checkpoints under {args.uri}")
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    store = _ckpt_store(args)
    steps = [args.step] if args.step is not None else _steps(store, args.uri)
    if not steps:
        print(f"error: no committed checkpoints under {args.uri}", file=sys.stderr)
        return 1
    bad = 0
    for step in steps:
        reason = store.verify(step, checksums=True)
        print(
            f"step {step}: {'ok (sizes and sha256)' if reason is None else 'REFUSED: ' + reason}; "
            f"{store.signature_state(step)}"
        )
        bad += reason is not None
    return 1 if bad else 0


def cmd_ckpt_convert(args: argparse.Namespace) -> int:
    from raysc.checkpoint.convert import convert_step

    store = _ckpt_store(args)
    steps = [args.step] if args.step is not None else _steps(store, args.uri)
    for step in steps:
        written = convert_step(store, step)
        print(f"step {step}: " + (f"converted ({', '.join(written)})" if written else "already current"))
    return 0


STORE = (
    arg("uri", help="checkpoint.uri of a run (a path, s3://bucket/prefix, ...)"),
    arg("--storage-options", help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\''),
)
CKPT = Command(
    "ckpt",
    "inspect checkpoints in a store",
    dest="ckpt_cmd",
    sub=(
        Command(
            "list",
            "list committed checkpoints",
            cmd_ckpt_list,
            (*STORE, arg("--checksums", action="store_true", help="also check sha256 (reads every file)"), JSON),
        ),
        Command("verify", "check every file's size and sha256 and the signature", cmd_ckpt_verify, (*STORE, STEP)),
        Command(
            "convert",
            "convert checkpoints of the previous format (pickled per-rank state) once, deliberately",
            cmd_ckpt_convert,
            (*STORE, STEP),
        ),
        Command(
            "now",
            "ask a running run to commit a checkpoint at its next step boundary and keep training "
            "(a preemption notice; the same as SIGUSR1 to its driver)",
            cmd_ckpt_now,
            (RUN_DIR.but(help="the run's directory (run.dir) on the driver's machine"),),
        ),
    ),
)
