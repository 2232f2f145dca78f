"""The ``raysc export`` and ``raysc generate`` commands: a run's checkpoint as a Hugging Face Llama
folder or a GGUF file, and text sampled from it; their handlers and their rows (``EXPORT``,
``GENERATE``) for the command table of ``raysc.cli``. The work is ``raysc.export`` (``restore``,
``hf``, ``gguf``). Here in ``quantize`` rather than ``export`` because ``export --method gptq``
quantizes (``raysc.quantize.gguf_gptq``), and ``export`` sits below ``quantize``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from raysc.cli_table import RUN_DIR, STEP, Command, arg


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


EXPORT = Command(
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
)

GENERATE = Command(
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
)
