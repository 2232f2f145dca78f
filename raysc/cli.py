"""The ``raysc`` command line: train, export, generate, demo.

Errors a user can fix (bad config, missing files, a failed run) print one
``error:`` line and exit non-zero; the last line ``raysc train`` prints on
success is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from raysc.ckpt_cli import cmd_ckpt_convert, cmd_ckpt_list, cmd_ckpt_now, cmd_ckpt_verify
from raysc.config.load import ConfigError, load_config


EXIT_CHECKPOINT_LAG = 3  # `raysc train` finished every step, but its last checkpoint(s) failed to save


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the newest verified checkpoint")
    p.add_argument("--resume-from", metavar="URI/step_N",
                   help="continue from this checkpoint (any run's, any layout: it is resharded)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh even though checkpoint.uri holds another run's checkpoints: they are deleted "
                        "once this run commits its first checkpoint (never before)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--inject", metavar="KIND@STEP[:RANK]", default=None,
                   help="fault injection drill, same as --set supervisor.inject=... (kinds: raise, kill, "
                        "hang, nan, spike, bitflip, slow, kill_save; comma-separated)")


def run_training(config: str | Path | None, overrides: list[str], resume: bool, resume_from: str | None,
                 progress: bool = True, overwrite: bool = False) -> dict:
    from raysc.driver import preflight, train

    cfg = load_config(config, overrides)
    preflight(cfg)
    return train(cfg, resume=resume_from or resume, progress=progress, overwrite=overwrite)


def cmd_train(args: argparse.Namespace) -> int:
    from raysc.fleet.errors import RunStopped

    overrides = list(args.overrides)
    if args.inject:
        overrides.append(f"supervisor.inject={json.dumps(args.inject)}")
    try:
        summary = run_training(args.config, overrides, args.resume, args.resume_from, not args.no_progress,
                               args.overwrite)
    except RunStopped as e:
        restart = args.restart_command or ["raysc", "train", args.config,
                                           *[a for o in args.overrides for a in ("--set", o)]]
        if e.checkpoint is not None:
            print(f"resume with: {shlex.join([*restart, '--resume'])}", flush=True)
        else:  # nothing committed: start over (from the same checkpoint when one was given)
            again = [*restart, "--resume-from", args.resume_from] if args.resume_from else restart
            print(f"no checkpoint was committed; start again with: {shlex.join(again)}", flush=True)
        return e.exit_code
    print(json.dumps(summary), flush=True)
    lag = summary.get("checkpoint_lag_steps") or 0
    if lag:  # finished, but the newest durable state is behind: a scheduler must be able to see it
        print(f"error: training finished but the newest committed checkpoint is {lag} steps behind "
              f"({summary.get('failed_saves')} failed save(s); see the checkpoint_lagging events)", file=sys.stderr)
        return EXIT_CHECKPOINT_LAG
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from raysc.checkpoint.restore import load_run
    from raysc.export.hf import export_hf

    run = load_run(args.run_dir, args.step)
    out = export_hf(run.model, run.tokenizer_path, args.out)
    print(json.dumps({"export": str(out), "step": run.step, "checkpoint": str(run.checkpoint)}))
    return 0


def sample_text(run_dir: str | Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                seed: int) -> str:
    from raysc.checkpoint.restore import load_run
    from raysc.data.tokenizer import EOS_ID, load_tokenizer
    from raysc.model.generate import generate

    run = load_run(run_dir)
    tok = load_tokenizer(run.tokenizer_path)
    ids = generate(run.model, tok.encode(prompt).ids, max_new_tokens, temperature, top_k, seed, EOS_ID)
    return prompt + tok.decode(ids)


def cmd_generate(args: argparse.Namespace) -> int:
    print(sample_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from raysc.parity import run_parity

    report = run_parity(args.config, args.layout, args.overrides, steps=args.steps, rtol=args.rtol,
                        work_dir=args.work_dir, progress=False)
    print(report.table())
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from raysc.fleet.status import run_status

    st = run_status(args.run_dir)
    if args.json:
        print(json.dumps(st))
        return 0
    gp = f"{st['goodput']:.1%}" if st["goodput"] is not None else "-"
    print(f"{st['run_dir']}: {st['state']}, step {st['step']}/{st['total_steps']}, loss {st['loss']}, "
          f"{(st['tokens_per_s'] or 0):.0f} tokens/s, goodput {gp}")
    print(f"restarts {st['restarts']}, skipped updates {st['skipped_updates']}, failed saves "
          f"{st['failed_saves']}, last checkpoint {st['last_checkpoint']}, wall {st['wall_s']} s")
    print("recent: " + "; ".join(st["last_events"]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from raysc.demo import run_demo

    run_demo(args.overrides)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from raysc.scaling.chinchilla import format_plan, parse_count, plan

    cfg = load_config(args.config, args.overrides)
    given = {k: parse_count(v, f"--{k}") for k, v in (("params", args.params), ("compute", args.compute),
                                                      ("tokens", args.tokens)) if v is not None}
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
        raise ValueError(f"--widths {args.widths!r}: expected comma-separated integers, e.g. 64,128,256,512")
    report = run(cfg, widths, args.steps, args.seeds, args.bound, args.out)
    print(format_report(report))
    print(f"wrote {report['files']['json']} and {report['files']['png']}")
    return 0 if report["passed"] else 1


def cmd_curate(args: argparse.Namespace) -> int:
    from raysc.curate.pipeline import curate
    from raysc.driver import ensure_ray

    cfg = load_config(args.config, args.overrides)
    ensure_ray()
    if args.audit:
        from raysc.curate.audit import run_audit

        print(json.dumps(run_audit(cfg)), flush=True)
        return 0
    report = curate(cfg)
    print(json.dumps({k: report[k] for k in ("output", "documents", "removed", "domains", "kept_bytes",
                                             "seconds_total")}), flush=True)
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from raysc.curate.pack import pack_curated
    from raysc.driver import ensure_ray

    cfg = load_config(args.config, args.overrides)
    curated = (cfg.curate.output or f"{cfg.run_dir}/curated").rstrip("/")
    ensure_ray()
    out = args.out or f"{curated}/packed"
    index = pack_curated(curated, args.tokenizer or cfg.data.tokenizer or None, cfg.model.vocab_size,
                         cfg.train.seq_len, out, dict(cfg.curate.storage_options),
                         sample_mb=cfg.data.tokenizer_sample_mb, seed=cfg.train.seed)
    print(json.dumps({d: {k: v for k, v in m.items() if k != "shards"} for d, m in index["domains"].items()}),
          flush=True)
    print(f"train on it with: --set data.source=\"{out}\" [--set data.schedule=\"0:...\"]", flush=True)
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from raysc.preflight.run import run_preflight

    cfg = load_config(args.config, args.overrides)
    report = run_preflight(cfg, steps=args.steps)
    print(f"report -> {cfg.run_dir}/preflight.json, preflight.md", flush=True)
    return 0 if report["passed"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from raysc.plan.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="raysc", description="LLM pre-training on Ray")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config, e.g. jobs/configs/tiny.toml")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="export a run's checkpoint as a Hugging Face Llama folder")
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the newest committed one)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("generate", help="generate text from a run's newest checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("parity", help="check that a parallel layout reproduces single-process training")
    p.add_argument("config", help="TOML config (the model, data and batch to compare)")
    p.add_argument("--layout", required=True, help="parallel degrees, e.g. pp=2,tp=2 or cp=2,tp=2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference that matches")
    p.add_argument("--work-dir", default="runs/parity", help="where the two runs are written")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_parity)

    ck = sub.add_parser("ckpt", help="inspect checkpoints in a store").add_subparsers(dest="ckpt_cmd", required=True)
    for name, func, text in (("list", cmd_ckpt_list, "list committed checkpoints"),
                             ("verify", cmd_ckpt_verify, "check every file's size and sha256 and the signature"),
                             ("convert", cmd_ckpt_convert, "convert checkpoints of the previous format (pickled "
                                                           "per-rank state) once, deliberately")):
        p = ck.add_parser(name, help=text)
        p.add_argument("uri", help="checkpoint.uri of a run (a path, s3://bucket/prefix, ...)")
        p.add_argument("--storage-options", help='fsspec options as JSON, e.g. \'{"endpoint_url": "http://..."}\'')
        if name == "list":
            p.add_argument("--checksums", action="store_true", help="also check sha256 (reads every file)")
            p.add_argument("--json", action="store_true")
        else:
            p.add_argument("--step", type=int)
        p.set_defaults(func=func)
    p = ck.add_parser("now", help="ask a running run to commit a checkpoint at its next step boundary and keep "
                                  "training (a preemption notice; the same as SIGUSR1 to its driver)")
    p.add_argument("run_dir", help="the run's directory (run.dir) on the driver's machine")
    p.set_defaults(func=cmd_ckpt_now)

    p = sub.add_parser("curate", help="dedup, quality-score and tag documents with Ray Data; write Parquet "
                                      "and a report")
    p.add_argument("config", help="TOML config with [curate], [dedup] and [quality] sections (all optional)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="e.g. --set curate.input='\"s3://bucket/raw/*.jsonl\"'")
    p.add_argument("--audit", action="store_true",
                   help="inject rewritten copies at known similarity and report near-dedup recall and precision")
    p.set_defaults(func=cmd_curate)

    p = sub.add_parser("pack", help="tokenize curated documents into per-domain token shards (train.seq_len)")
    p.add_argument("config", help="the config used for `raysc curate` (its curate.output is read)")
    p.add_argument("--tokenizer", help="an existing tokenizer.json (default data.tokenizer, else a BPE of "
                                       "model.vocab_size trained on data.tokenizer_sample_mb of the documents)")
    p.add_argument("--out", help="where the shards and index.json go (default <curate.output>/packed)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("plan", help="rank every parallel layout of a config on a cluster (memory, tokens/s); "
                                    "--profile measures the top ones")
    from raysc.plan.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("preflight", help="run the pre-training checklist on the fleet; preflight.json + .md; "
                                         "exit 1 on a fail")
    p.add_argument("config", help="the TOML config of the run to check")
    p.add_argument("--steps", type=int, default=8, help="steps of the probe run (>= 6)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("status", help="summarise a running or finished run from its records")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("demo", help="corpus → tokenizer → training → checkpoint → export → sample")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("scale", help="Chinchilla compute-optimal params/tokens/compute, loss estimate and "
                                     "model shapes (docs/scaling.md)")
    p.add_argument("config", nargs="?", help="TOML config whose vocab, GQA ratio and batch are used")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="parameters N, e.g. 1.3e9 or 7B")
    size.add_argument("--compute", help="training FLOPs C, e.g. 1e21")
    size.add_argument("--tokens", help="training tokens D, e.g. 1.4T")
    p.add_argument("--global-batch-tokens", help="tokens per optimizer step, for the step count (default: "
                                                 "the config's batch, when a config is given)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_scale)

    mp = sub.add_parser("mup", help="μP tools").add_subparsers(dest="mup_cmd", required=True)
    p = mp.add_parser("coord-check", help="train SP and μP models at several widths for a few steps; check that "
                                          "μP activations stay flat across widths (PNG + JSON)")
    p.add_argument("config", help="TOML config: depth, head_dim, vocab, data, batch, optim.lr")
    p.add_argument("--widths", default="64,128,256,512", help="comma-separated model.dim values")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seeds", type=int, default=1, help="average the activations over this many seeds")
    p.add_argument("--bound", type=float, default=0.25, help="largest μP slope of log|activation| vs log width")
    p.add_argument("--out", help="output folder (default <run.dir>/coord_check)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_mup_coord_check)
    return ap


def main(argv: list[str] | None = None, restart_command: list[str] | None = None) -> int:
    """``restart_command``: how to start this run again (``--resume`` is appended to it in the line a
    stopped run prints); default ``raysc train CONFIG --set ...``."""
    args = build_parser().parse_args(argv)
    args.restart_command = restart_command
    from raysc.fleet.errors import RunFailed
    from raysc.preflight.run import PreflightRequired

    try:
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: run failed: {e}", file=sys.stderr)
        return 1
    except PreflightRequired as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
