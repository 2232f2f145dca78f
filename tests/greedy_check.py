"""What the served-model tests share: whether served token ids are the greedy continuation of a run's
checkpoint (tests/test_serve.py, tests/test_newcomer.py)."""

from __future__ import annotations

from pathlib import Path

from raysc.data.tokenizer import load_tokenizer
from raysc.export.restore import load_run


def greedy_mismatches(run_dir: Path, step: int, prompts: list[str], served: list[list[int]]) -> list[str]:
    """Where ``served`` is not the greedy continuation of the checkpoint: each token must be the
    argmax of raysc's own logits given the tokens before it (teacher forcing), except at an exact
    tie, i.e. the top logits within 1e-4 (fp32 kernels of two engines may break those either way)."""
    import torch

    run = load_run(run_dir, step)
    tok = load_tokenizer(run.tokenizer_path)
    bad = []
    for p, out in zip(prompts, served):
        ids = tok.encode(p).ids
        with torch.no_grad():
            logits = run.model(torch.tensor([ids + out]))[0]
        for i, t in enumerate(out):
            row = logits[len(ids) + i - 1]
            if row[t] < row.max() - 1e-4:
                bad.append(f"{p!r} token {i}: served {t} ({row[t]:.5f}), argmax {int(row.argmax())} ({row.max():.5f})")
                break
    return bad
