"""The ``raysc quantize`` command: its handler and its row (``QUANTIZE``) for the command table of
``raysc.cli``. The work is ``raysc.quantize.run.quantize_run``."""

from __future__ import annotations

import argparse
import json

from raysc.cli_table import RUN_DIR, STEP, Command, arg


def cmd_quantize(args: argparse.Namespace) -> int:
    from raysc.quantize.run import quantize_run

    manifest = quantize_run(
        args.run_dir,
        args.method,
        bits=args.bits,
        group_size=args.group_size,
        calib_tokens=args.calib_tokens,
        eval_tokens=args.eval_tokens,
        out=args.out,
        seed=args.seed,
        step=args.step,
        act_order=not args.no_act_order,
    )
    q = manifest["quality"]
    print(
        json.dumps(
            {
                "out": manifest["out"],
                "method": manifest["method"],
                "bits": manifest["bits"],
                "group_size": manifest["group_size"],
                "bytes": manifest["bytes"],
                "perplexity_before": q["perplexity_before"],
                "perplexity_after": q["perplexity_after"],
                "relative_increase": q["relative_increase"],
            }
        ),
        flush=True,
    )
    return 0


QUANTIZE = Command(
    "quantize",
    "quantize a run's checkpoint (int8, 4-bit RTN, GPTQ, AWQ) into a compressed-tensors Hugging Face "
    "folder vLLM serves, with quantize_manifest.json (errors per layer, perplexity before/after)",
    cmd_quantize,
    (
        RUN_DIR,
        arg(
            "--method",
            required=True,
            choices=["int8", "rtn4", "gptq", "awq"],
            help="int8: per-channel round-to-nearest, served W8A8; rtn4: 4-bit round-to-nearest; gptq, awq: 4-bit "
            "(or --bits 8) with calibration",
        ),
        arg("--bits", type=int, choices=[4, 8], help="weight bits for gptq/awq (default 4; 8 = per channel, W8A8)"),
        arg(
            "--group-size", type=int, default=128, help="input columns per 4-bit scale; -1 = per channel (default 128)"
        ),
        arg("--calib-tokens", type=int, default=16384, help="calibration tokens from the run's training split"),
        arg("--eval-tokens", type=int, default=16384, help="held-out (validation) tokens for the perplexities"),
        arg("--seed", type=int, help="seed of the calibration draw (default: the run's train.seed)"),
        arg("--no-act-order", action="store_true", help="gptq: quantize columns in order, not by activation size"),
        arg(
            "--out",
            help="output folder, or an object-store prefix (s3://bucket/prefix, uploaded with the run's "
            "checkpoint.storage_options; default <run_dir>/quantized/<method>-w<bits>[g<group>])",
        ),
        STEP.but(help="checkpoint step (default: the newest committed one)"),
    ),
)
