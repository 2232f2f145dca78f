"""Speculative sampling, once, as the reference: the acceptance rule, the two drafters, a decoding loop.

The rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023): the drafter proposes k tokens x_1..x_k with probabilities q_i; one target pass
gives p_1..p_{k+1}. Token x_i is accepted with probability min(1, p_i(x_i)/q_i(x_i)); at the first
rejection a token is drawn from norm(max(0, p_i − q_i)) and the pass ends; if all k are accepted a
bonus token is drawn from p_{k+1}. The emitted tokens are distributed exactly as the target's own
samples, and at temperature 0 (p and q one-hot at their argmax) the output equals the target's greedy
decoding token for token.

vLLM implements the same rule in its serving engine (that is what `raysc serve` runs); this module is
the small, readable version that the tests check against the target's distribution and that
``raysc spec tune`` uses to measure acceptance. It recomputes the whole context each step (no KV
cache, like ``raysc.model.generate``): it is for measurements and checks, not for serving.

The n-gram drafter is prompt lookup as vLLM's ``ngram`` method does it: the longest suffix of the
context of length in [min_n, max_n] that occurs earlier in the context (its earliest occurrence), and
the up to k tokens that followed it. Ours is a plain scan written from that description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from raysc.model.llama import Llama


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token distributions from ``logits`` (..., vocab): softmax(logits / T), or at T = 0 a one-hot
    at the argmax (greedy decoding as a distribution, so the same rule covers both)."""
    logits = logits.float()
    if temperature < 0:
        raise ValueError(f"temperature {temperature} is negative; use 0 (greedy) or a positive value")
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


@dataclass
class Verdict:
    """One target pass: the tokens it emits (accepted drafts, then a correction or bonus token)."""

    tokens: list[int]
    accepted: int  # drafted tokens accepted (0..k); len(tokens) == accepted + 1


def verify(
    p: torch.Tensor, q: torch.Tensor | None, drafted: Sequence[int], generator: torch.Generator | None = None
) -> Verdict:
    """The acceptance rule. ``p`` (k+1, vocab): the target's distributions at the k drafted positions
    and one past them; ``q`` (k, vocab): the drafter's, or None for a deterministic drafter (a one-hot
    at each drafted token, as prompt lookup is); ``drafted``: the k proposed tokens."""
    k = len(drafted)
    if p.shape[0] != k + 1:
        raise ValueError(f"p has {p.shape[0]} rows for {k} drafted tokens; it needs k + 1 = {k + 1}")
    if q is not None and q.shape[0] != k:
        raise ValueError(f"q has {q.shape[0]} rows for {k} drafted tokens; it needs one per drafted token")
    out: list[int] = []
    for i, x in enumerate(drafted):
        px, qx = float(p[i, x]), float(q[i, x]) if q is not None else 1.0
        # accept with probability min(1, p/q); u < p/q written as u·q < p (q(x) > 0: x was drawn from q)
        if px >= qx or float(torch.rand((), generator=generator)) * qx < px:
            out.append(int(x))
            continue
        if q is not None:
            residual = torch.clamp(p[i] - q[i], min=0.0)
        else:  # max(0, p - onehot(x)): p without x
            residual = p[i].clone()
            residual[x] = 0.0
        total = float(residual.sum())
        # a rejection implies p(x) < q(x), hence p != q and a positive residual; fall back to p on underflow
        dist = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return Verdict(out, i)
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return Verdict(out, k)


def ngram_propose(context: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the longest suffix of ``context`` with min_n <= n <= max_n tokens that also occurs
    earlier (the earliest such occurrence), and the up to ``k`` tokens that followed it; [] if none."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
    ctx = np.asarray(context, dtype=np.int64)
    n_tok = len(ctx)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        # windows starting at 0..n_tok-n-1: every earlier occurrence, never the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
        hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return ctx[start : start + k].tolist()
    return []


class Drafter(Protocol):
    def propose(
        self, context: list[int], k: int, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to k tokens and their distributions (k, vocab), or None for a deterministic drafter."""
        ...


class ModelDrafter:
    """A small model sampling k tokens autoregressively at the serving temperature."""

    def __init__(self, model: Llama, temperature: float) -> None:
        self.model, self.temperature = model.eval(), temperature

    @torch.no_grad()
    def propose(
        self, context: list[int], k: int, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        ids, rows = list(context), []
        for _ in range(k):
            q = target_probs(self.model(torch.tensor([ids]))[0, -1], self.temperature)
            ids.append(int(torch.multinomial(q, 1, generator=generator)))
            rows.append(q)
        return ids[len(context) :], torch.stack(rows) if rows else None


@dataclass
class NgramDrafter:
    """vLLM's ``ngram`` method (prompt lookup); its draft costs no model pass."""

    min_n: int = 2
    max_n: int = 4

    def propose(
        self, context: list[int], k: int, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        return ngram_propose(context, k, self.min_n, self.max_n), None


@dataclass
class SpecResult:
    tokens: list[int]
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    per_pass: list[int] = field(default_factory=list)  # tokens emitted by each target pass

    @property
    def acceptance(self) -> float:
        """Accepted / drafted tokens (what vLLM reports as its draft acceptance rate)."""
        return self.accepted / self.drafted if self.drafted else 0.0


@torch.no_grad()
def speculative_generate(
    target: Llama,
    drafter: Drafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    k: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_id: int | None = None,
) -> SpecResult:
    """Decode ``max_new_tokens`` with speculation of ``k`` tokens per target pass (the reference loop)."""
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens; give a non-empty prompt")
    if k < 1:
        raise ValueError(f"k={k}: speculation needs at least one drafted token per pass")
    if len(prompt_ids) + max_new_tokens + k > target.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + k ({k}) exceeds the "
            f"target's context of {target.max_seq_len} tokens; shorten the prompt or the output"
        )
    gen = torch.Generator().manual_seed(seed)
    was_training = target.training
    target.eval()
    ctx, res = list(prompt_ids), SpecResult([])
    while len(res.tokens) < max_new_tokens:
        drafted, q = drafter.propose(ctx, k, gen)
        logits = target(torch.tensor([ctx + drafted]))[0, len(ctx) - 1 :]
        verdict = verify(target_probs(logits, temperature), q, drafted, gen)
        res.target_passes += 1
        res.drafted += len(drafted)
        res.accepted += verdict.accepted
        res.per_pass.append(len(verdict.tokens))
        for t in verdict.tokens:
            if (stop_id is not None and t == stop_id) or len(res.tokens) == max_new_tokens:
                target.train(was_training)
                return res
            res.tokens.append(t)
            ctx.append(t)
    target.train(was_training)
    return res
