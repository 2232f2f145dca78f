"""``raysc spec tune TARGET_RUN [DRAFT_RUN]``: measure α and the cost ratio of a draft model and of prompt
lookup against a target run, print the table per k, and write the winner's speculative config into the
target run directory (``serve_speculative.json``, read by ``raysc serve --draft``)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target_run", help="the run to serve (its newest committed checkpoint)")
    p.add_argument("draft_run", nargs="?", help="a draft run with the same tokenizer (omit: prompt lookup only)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts (validation rows of the target's data)")
    p.add_argument("--max-k", type=int, default=8, help="largest speculation length considered")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each prompt")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens the target generates after each prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="serving temperature (0 = greedy)")
    p.add_argument("--ngram-min", type=int, default=2, help="prompt lookup: shortest n-gram matched")
    p.add_argument("--ngram-max", type=int, default=4, help="prompt lookup: longest n-gram matched")
    p.add_argument("--threads", type=int, default=1, help="torch threads while timing (1: stable on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the whole report as JSON after the table")


def run(args: argparse.Namespace) -> int:
    import torch

    from raysc.serve.spec_tune import choose, format_table, tune, write_spec

    for name in ("prompts", "max_k", "prompt_len", "new_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = tune(
            args.target_run,
            args.draft_run,
            args.prompts,
            args.max_k,
            args.prompt_len,
            args.new_tokens,
            args.temperature,
            args.ngram_min,
            args.ngram_max,
            args.seed,
        )
    finally:
        torch.set_num_threads(threads)
    print(format_table(report))
    fragment = choose(report)
    path = write_spec(args.target_run, fragment)
    verdict = "" if fragment["pays"] else " (no k pays: serve without speculation)"
    print(f"chosen: {fragment['method']} k={fragment['num_speculative_tokens']}{verdict} -> {path}")
    if args.json:
        print(json.dumps(report))
    sys.stdout.flush()
    return 0
