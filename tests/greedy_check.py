"""What the served-model tests share: whether served token ids are the greedy continuation of a model
(a run's checkpoint in tests/test_serve.py and tests/test_newcomer.py, a transformers model in
tests/test_families.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from raysc.data.tokenizer import load_tokenizer
from raysc.export.restore import load_run


def forced_mismatches(logits: Callable, prompts: list[list[int]], served: list[list[int]]) -> list[str]:
    """Where ``served`` is not the greedy continuation of ``prompts`` under ``logits`` (token ids
    (1, n) -> logits (n, vocab)): each token must be the argmax given the tokens before it (teacher
    forcing), except at an exact tie, i.e. the top logits within 1e-4 (fp32 kernels of two engines may
    break those either way)."""
    import torch

    bad = []
    for ids, out in zip(prompts, served):
        with torch.no_grad():
            rows = logits(torch.tensor([list(ids) + list(out)]))
        for i, t in enumerate(out):
            row = rows[len(ids) + i - 1]
            if row[t] < row.max() - 1e-4:
                bad.append(f"{ids} token {i}: served {t} ({row[t]:.5f}), argmax {int(row.argmax())} ({row.max():.5f})")
                break
    return bad


def greedy_mismatches(run_dir: Path, step: int, prompts: list[str], served: list[list[int]]) -> list[str]:
    """``forced_mismatches`` against the run's checkpoint at ``step``, prompts tokenized by its tokenizer."""
    run = load_run(run_dir, step)
    tok = load_tokenizer(run.tokenizer_path)
    return forced_mismatches(lambda x: run.model(x)[0], [tok.encode(p).ids for p in prompts], served)
