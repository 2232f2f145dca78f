"""The ``raysc`` command line, declared as one table (``COMMANDS``; ``raysc.cli_table``):

- ``train``, ``parity``, ``preflight``, ``plan``: train from a TOML config, check that a parallel
  layout reproduces single-process training, run the pre-training checklist, rank layouts;
- ``export``, ``generate``, ``status``: a run's checkpoint as a Hugging Face folder or a GGUF file, text from it,
  a summary of a running or finished run;
- ``ckpt list`` / ``verify`` / ``convert`` / ``now`` (``raysc.fleet.command``): a store's checkpoints,
  and a checkpoint from a running run now;
- ``cluster local up`` / ``add-node`` / ``down`` (``raysc.cluster.command``): a multi-node Ray cluster
  on this machine, to rehearse a cluster run;
- ``quantize`` (``raysc.quantize.command``): a run's checkpoint as a quantized folder vLLM serves;
- ``curate``, ``pack`` (``raysc.curate.command``): raw documents to curated Parquet, curated documents to
  token shards (raysc rows or Megatron indexed datasets);
- ``scale``, ``mup coord-check``: Chinchilla sizing, the μP coordinate check;
- ``spec tune`` (``raysc.serve.spec_cli``): α, cost ratio and speculation length for serving;
- ``demo``: corpus → tokenizer → training → checkpoint → export → sample.

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

from raysc.cli_table import JSON, RUN_DIR, SET, STEP, Command, OneOf, arg
from raysc.cluster.command import CLUSTER
from raysc.config.faults import KINDS as FAULT_KINDS
from raysc.config.load import ConfigError, load_config
from raysc.curate.command import CURATE, PACK
from raysc.fleet.command import CKPT
from raysc.mix.command import MIX
from raysc.quantize.command import QUANTIZE

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


def cmd_export(args: argparse.Namespace) -> int:
    from raysc.export.restore import load_run

    if args.format == "hf" and (args.type or args.method or not args.out):
        raise ValueError("--format hf writes a folder: give --out DIR, and no --type or --method (they are GGUF's)")
    if args.method == "gptq" and args.type != "q4_0":
        raise ValueError("--method gptq chooses Q4_0 roundings: pass --type q4_0 with it")
    run = load_run(args.run_dir, args.step)
    if args.format == "gguf":
        qtype = args.type or "f32"
        out = Path(args.out or Path(args.run_dir) / f"model-{qtype}{'-gptq' if args.method == 'gptq' else ''}.gguf")
        if args.method == "gptq":
            from raysc.quantize.gguf_gptq import export_gguf_gptq

            export_gguf_gptq(run, out, args.calib_tokens, name=Path(args.run_dir).name)
        else:
            from raysc.export.gguf import export_gguf

            export_gguf(run.model, run.tokenizer_path, out, qtype, Path(args.run_dir).name)
    else:
        from raysc.export.hf import export_hf

        out = export_hf(run.model, run.tokenizer_path, args.out)
    print(json.dumps({"export": str(out), "step": run.step, "checkpoint": str(run.checkpoint)}))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from raysc.export.restore import sample_text

    print(sample_text(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
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


def cmd_demo(args: argparse.Namespace) -> int:
    from raysc.demo import run_demo

    run_demo(args.overrides)
    return 0


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


def cmd_preflight(args: argparse.Namespace) -> int:
    from raysc.preflight.run import run_preflight

    cfg = load_config(args.config, args.overrides)
    report = run_preflight(cfg, steps=args.steps)
    print(f"report -> {cfg.run_dir}/preflight.json, preflight.md", flush=True)
    return 0 if report["passed"] else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from raysc.plan.command import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from raysc.serve.command import cmd_serve as serve

    return serve(args)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from raysc.serve.command import add_arguments

    add_arguments(p)


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    from raysc.plan.command import add_arguments

    add_arguments(p)


def cmd_spec_tune(args: argparse.Namespace) -> int:
    from raysc.serve.spec_cli import run

    return run(args)


def _spec_tune_arguments(p: argparse.ArgumentParser) -> None:
    from raysc.serve.spec_cli import add_arguments

    add_arguments(p)


COMMANDS = (
    Command(
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
                metavar="KIND@STEP[:RANK]",
                default=None,
                help=f"fault injection drill, same as --set supervisor.inject=... (kinds: {', '.join(FAULT_KINDS)}; "
                "comma-separated)",
            ),
        ),
    ),
    Command(
        "export",
        "export a run's checkpoint as a Hugging Face Llama folder or a GGUF file",
        cmd_export,
        (
            RUN_DIR,
            arg(
                "--format",
                choices=("hf", "gguf"),
                default="hf",
                help="hf: a Hugging Face Llama folder (vLLM, transformers); gguf: one file for llama.cpp",
            ),
            arg(
                "--type",
                choices=("f32", "f16", "q8_0", "q4_0"),
                default=None,
                help="GGUF tensor type (default f32; q4_0 keeps the output projection at q8_0)",
            ),
            arg(
                "--method",
                choices=("rtn", "gptq"),
                default=None,
                help="how q4_0 rounds the block linears: rtn (nearest, default) or gptq (error-compensating, "
                "calibrated on the run's training split)",
            ),
            arg("--calib-tokens", type=int, default=16384, help="GPTQ's calibration tokens"),
            arg("--out", help="output folder (hf, required) or file (gguf; default RUN_DIR/model-TYPE.gguf)"),
            STEP.but(help="checkpoint step to export (default: the newest committed one)"),
        ),
    ),
    Command(
        "generate",
        "generate text from a run's newest checkpoint",
        cmd_generate,
        (
            RUN_DIR,
            arg("--prompt", required=True),
            arg("--max-new-tokens", type=int, default=64),
            arg("--temperature", type=float, default=0.0, help="0 = greedy"),
            arg("--top-k", type=int, default=0, help="sample from the k most likely tokens"),
            arg("--seed", type=int, default=0),
        ),
    ),
    Command(
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
    ),
    CKPT,
    CLUSTER,
    QUANTIZE,
    CURATE,
    MIX,
    PACK,
    Command(
        "plan",
        "rank every parallel layout of a config on a cluster (memory, tokens/s); --profile measures the top ones",
        cmd_plan,
        (_plan_arguments, SET),
    ),
    Command(
        "preflight",
        "run the pre-training checklist on the fleet; preflight.json + .md; exit 1 on a fail",
        cmd_preflight,
        (
            arg("config", help="the TOML config of the run to check"),
            arg("--steps", type=int, default=8, help="steps of the probe run (>= 6)"),
            SET,
        ),
    ),
    Command("status", "summarise a running or finished run from its records", cmd_status, (RUN_DIR, JSON)),
    Command(
        "serve",
        "serve a run's newest checkpoint (or an export) with vLLM on Ray Serve LLM: an "
        "OpenAI-compatible endpoint (docs/serving.md)",
        cmd_serve,
        (_serve_arguments, SET.but(help="e.g. --set serve.max_num_seqs=64 (repeatable)")),
    ),
    Command("demo", "corpus → tokenizer → training → checkpoint → export → sample", cmd_demo, (SET,)),
    Command(
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
                help="tokens per optimizer step, for the step count (default: the "
                "config's batch, when a config is given)",
            ),
            SET,
            JSON.but(help="print one JSON object"),
        ),
    ),
    Command(
        "spec",
        "speculative decoding",
        dest="spec_cmd",
        sub=(
            Command(
                "tune",
                "measure a draft run's and prompt lookup's acceptance and cost against a target run; "
                "choose k; write <target>/serve_speculative.json",
                cmd_spec_tune,
                (_spec_tune_arguments,),
            ),
        ),
    ),
    Command(
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
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """``raysc`` and every command of ``COMMANDS``."""
    ap = argparse.ArgumentParser(prog="raysc", description="LLM pre-training on Ray")
    commands = ap.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        c.add_to(commands)
    return ap


def main(argv: list[str] | None = None, restart_command: list[str] | None = None) -> int:
    """``restart_command``: how to start this run again (``--resume`` is appended to it in the line a
    stopped run prints); default ``raysc train CONFIG --set ...``."""
    args = build_parser().parse_args(argv)
    args.restart_command = restart_command
    from raysc.cluster.connect import ClusterAddressError
    from raysc.cluster.fit import ClusterTooSmall
    from raysc.fleet.command import StoreUnreadable
    from raysc.fleet.errors import RunFailed
    from raysc.fleet.preflight_gate import PreflightRequired
    from raysc.serve.fit import ServeNotReady

    connected = _ray_connected()
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
        if getattr(args, "func", None) is cmd_train:  # the supervisor heals what it can; this one it could not
            print(
                "its committed checkpoints are kept: once the cause is fixed, the same command with --resume "
                "continues from the newest",
                file=sys.stderr,
            )
        return 1
    except (PreflightRequired, ClusterAddressError, ClusterTooSmall, StoreUnreadable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ServeNotReady as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if not connected and _ray_connected():
            _disconnect()


def _ray_connected() -> bool:
    """Whether this process is connected to Ray (never imports Ray to find out)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _disconnect() -> None:
    """Leave the Ray this command connected to (or stop the one it started) before the interpreter
    exits: the same ``ray.shutdown`` Ray's exit hook runs, but measured here 0.5 s faster before exit
    than inside it (a 5-step ``raysc train`` against a running head: 0.3 s against 0.8 s)."""
    import ray

    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
