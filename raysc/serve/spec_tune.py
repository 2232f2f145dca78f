"""Choose the speculation length k from measurements (``raysc spec tune TARGET DRAFT``).

Three measurements, all on the target's held-out rows (the validation rows of its data, which
neither the target nor a draft trained on the same data has seen):

- α, the acceptance rate: the target continues each prompt (greedy at temperature 0, else sampled);
  one teacher-forced pass of target and drafter over the result gives, at every position, the chance
  that a drafted token is accepted, Σ_x min(p(x), q(x)) (1 when the argmaxes agree at T = 0). For
  prompt lookup q is a point mass on the token the lookup proposes (0 when it proposes none).
- c, the draft/target step-cost ratio: one-token forward passes at batch 1 (the work of one decode
  step with a KV cache, less its attention over the cache), target and draft timed alternately, ratio
  of the fastest of each (the least disturbed by other processes); for prompt lookup the time of one
  lookup over the context.
- at T = 0 the tokens each target pass really emits, k by k: a drafted run is accepted up to the
  first position where the drafter's greedy token differs from the target's, so one teacher-forced
  pass gives every k's outcome exactly (``greedy_passes``); prompt lookup is replayed token by token.

Then, with Leviathan et al. (2023): expected tokens per target pass E(k) = (1 − α^(k+1)) / (1 − α)
and predicted speed-up S(k) = E(k) / (k·c + 1); k is the one maximising S (i.i.d. acceptance is the
formula's assumption; the measured column shows how far it holds). The winner of draft model vs
prompt lookup goes into ``<target run>/serve_speculative.json``, which ``raysc serve --draft`` reads.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from raysc.model.llama import Llama
from raysc.serve.speculative import ngram_propose, target_probs

SPEC_FILE = "serve_speculative.json"


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target pass with k drafted tokens, each accepted i.i.d. with prob. alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speedup(alpha: float, cost_ratio: float, k: int) -> float:
    """Leviathan et al.'s expected wall-time improvement: E(k) / (k·c + 1)."""
    return expected_tokens(alpha, k) / (k * cost_ratio + 1.0)


def best_k(alpha: float, cost_ratio: float, max_k: int) -> tuple[int, float]:
    """The k in 1..max_k with the highest predicted speed-up, and that speed-up."""
    return max(((k, speedup(alpha, cost_ratio, k)) for k in range(1, max_k + 1)), key=lambda t: t[1])


def greedy_passes(match: np.ndarray, k: int, limit: int | None = None) -> list[int]:
    """Tokens emitted per target pass at T = 0 given ``match[t]``: the drafter's greedy token at
    position t (after the target's own tokens before it) equals the target's. Each pass accepts the run
    of matches from its start, up to k, then emits the target's token (correction or bonus). Passes
    start before ``limit`` (default: the end); ``match`` reaching k + 1 past it keeps every counted pass
    whole instead of cut short by the end of the output."""
    out, t, n = [], 0, len(match)
    while t < (n if limit is None else limit):
        a = 0
        while a < k and t + a < n and match[t + a]:
            a += 1
        emitted = min(a + 1, n - t)
        out.append(emitted)
        t += emitted
    return out


def ngram_passes(
    prompt: list[int], continuation: list[int], k: int, min_n: int, max_n: int, limit: int | None = None
) -> list[int]:
    """Tokens emitted per target pass when prompt lookup drafts for ``continuation`` (T = 0); passes
    start before ``limit`` as in ``greedy_passes``."""
    out, t, n = [], 0, len(continuation)
    while t < (n if limit is None else limit):
        proposal = ngram_propose(prompt + continuation[:t], k, min_n, max_n)
        a = 0
        while a < len(proposal) and t + a < n and proposal[a] == continuation[t + a]:
            a += 1
        emitted = min(a + 1, n - t)
        out.append(emitted)
        t += emitted
    return out


@torch.no_grad()
def continue_prompts(
    target: Llama, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int
) -> torch.Tensor:
    """(n, prompt_len + new_tokens): the prompts and the target's continuations (one batch)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = prompts
    for _ in range(new_tokens):
        p = target_probs(target(seqs)[:, -1], temperature)
        nxt = p.argmax(-1, keepdim=True) if temperature == 0 else torch.multinomial(p, 1, generator=gen)
        seqs = torch.cat([seqs, nxt], dim=1)
    return seqs


@torch.no_grad()
def acceptance(target: Llama, draft: Llama, seqs: torch.Tensor, prompt_len: int, temperature: float) -> torch.Tensor:
    """(n, new_tokens): Σ_x min(p, q) at every continuation position (the draft model's α per token)."""
    sl = slice(prompt_len - 1, seqs.shape[1] - 1)
    p = target_probs(target(seqs)[:, sl], temperature)
    q = target_probs(draft(seqs)[:, sl], temperature)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def ngram_acceptance(
    target: Llama, seqs: torch.Tensor, prompt_len: int, temperature: float, min_n: int, max_n: int
) -> torch.Tensor:
    """(n, new_tokens): p(x) for the token x prompt lookup proposes at each position, 0 when none."""
    p = target_probs(target(seqs)[:, prompt_len - 1 : seqs.shape[1] - 1], temperature)
    beta = torch.zeros(p.shape[:2])
    rows = seqs.tolist()
    for i, row in enumerate(rows):
        for t in range(p.shape[1]):
            proposal = ngram_propose(row[: prompt_len + t], 1, min_n, max_n)
            if proposal:
                beta[i, t] = p[i, t, proposal[0]]
    return beta


@torch.no_grad()
def step_seconds(model: Llama, reps: int = 30, warmup: int = 5) -> float:
    """Fastest of ``reps`` one-token forward passes at batch 1: the minimum is the time least disturbed
    by other processes (``timeit``'s advice); medians on a shared 2-core machine varied 2x run to run."""
    return paired_step_seconds(model, model, reps, warmup)[0]


@torch.no_grad()
def paired_step_seconds(a: Llama, b: Llama, reps: int = 60, warmup: int = 5) -> tuple[float, float]:
    """Fastest one-token forward times of ``a`` and ``b`` (as ``step_seconds``), timed alternately so
    that both see the same machine load."""
    x = torch.zeros(1, 1, dtype=torch.long)
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + reps):
        for model, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            model(x)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return min(times[0]), min(times[1])


def lookup_seconds(context: list[int], k: int, min_n: int, max_n: int, reps: int = 30) -> float:
    """Fastest of ``reps`` prompt lookups over ``context``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ngram_propose(context, k, min_n, max_n)
        times.append(time.perf_counter() - t0)
    return min(times)


@dataclass
class MethodReport:
    """One drafter's measurements and its row per k."""

    method: str  # "draft_model" | "ngram"
    alpha: float
    cost_ratio: float
    k: int  # chosen: the highest predicted speed-up
    predicted_speedup: float
    rows: list[dict]  # k, expected tokens/pass, measured tokens/pass (T = 0), predicted and measured speed-up


def method_report(
    method: str, alpha: float, cost_ratio: float, max_k: int, measured: dict[int, float] | None
) -> MethodReport:
    rows = []
    for k in range(1, max_k + 1):
        m = measured.get(k) if measured else None
        rows.append(
            {
                "k": k,
                "expected_tokens_per_pass": expected_tokens(alpha, k),
                "measured_tokens_per_pass": m,
                "predicted_speedup": speedup(alpha, cost_ratio, k),
                "measured_speedup": m / (k * cost_ratio + 1.0) if m is not None else None,
            }
        )
    k, s = best_k(alpha, cost_ratio, max_k)
    return MethodReport(method, alpha, cost_ratio, k, s, rows)


def held_out_prompts(target_cfg, n: int, prompt_len: int) -> torch.Tensor:
    """The first ``prompt_len`` tokens of ``n`` validation rows of the target's data (never trained on)."""
    from raysc.data.prepare import prepare_data

    packed, _, _ = prepare_data(target_cfg)
    val = packed.val
    if len(val) < n:
        raise ValueError(
            f"the target's data holds {len(val)} validation rows, fewer than --prompts {n}; "
            f"ask for fewer prompts or raise data.val_fraction"
        )
    if val.shape[1] < prompt_len:
        raise ValueError(f"validation rows have {val.shape[1]} tokens, fewer than --prompt-len {prompt_len}")
    return torch.from_numpy(np.ascontiguousarray(val[:n, :prompt_len])).long()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tune(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    prompts: int = 32,
    max_k: int = 8,
    prompt_len: int = 32,
    new_tokens: int = 64,
    temperature: float = 0.0,
    ngram_min: int = 2,
    ngram_max: int = 4,
    seed: int = 0,
) -> dict:
    """Measure both drafters against the target; return the report (``write_spec`` stores the winner)."""
    from raysc.export.restore import load_run

    target = load_run(target_dir)
    target.model.eval()
    if prompt_len + new_tokens + max_k + 1 > target.model.max_seq_len:
        raise ValueError(
            f"--prompt-len {prompt_len} + --new-tokens {new_tokens} + --max-k {max_k} + 1 exceeds the "
            f"target's context of {target.model.max_seq_len} tokens; lower one of them"
        )
    torch.manual_seed(seed)
    x = held_out_prompts(target.cfg, prompts, prompt_len)
    # max_k + 1 tokens past new_tokens: a pass starting before new_tokens is never cut short
    seqs = continue_prompts(target.model, x, new_tokens + max_k + 1, temperature, seed)
    t_target = step_seconds(target.model)
    methods: list[MethodReport] = []
    out: dict = {
        "target_run": str(Path(target_dir).resolve()),
        "target_step": target.step,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "temperature": temperature,
        "target_step_s": t_target,
    }
    if draft_dir is not None:
        draft = load_run(draft_dir)
        draft.model.eval()
        if _sha(draft.tokenizer_path) != _sha(target.tokenizer_path):
            raise ValueError(
                f"draft run {draft_dir} has a different tokenizer from target run {target_dir}; "
                f'train the draft with the target\'s (--set data.tokenizer="{target.tokenizer_path}", '
                f"or the same corpus, model.vocab_size and train.seed)"
            )
        beta = acceptance(target.model, draft.model, seqs, prompt_len, temperature)
        t_target, t_draft = paired_step_seconds(target.model, draft.model)
        measured = None
        if temperature == 0:
            match = (beta > 0.5).numpy()
            measured = {k: _per_pass(greedy_passes(m, k, new_tokens) for m in match) for k in range(1, max_k + 1)}
        methods.append(
            method_report("draft_model", float(beta[:, :new_tokens].mean()), t_draft / t_target, max_k, measured)
        )
        out.update(
            draft_run=str(Path(draft_dir).resolve()),
            draft_step=draft.step,
            draft_step_s=t_draft,
            target_step_s=t_target,
        )
    beta_ng = ngram_acceptance(target.model, seqs, prompt_len, temperature, ngram_min, ngram_max)
    rows = seqs.tolist()
    t_lookup = lookup_seconds(rows[0][: prompt_len + new_tokens // 2], max_k, ngram_min, ngram_max)
    measured_ng = None
    if temperature == 0:
        measured_ng = {
            k: _per_pass(
                ngram_passes(r[:prompt_len], r[prompt_len:], k, ngram_min, ngram_max, new_tokens) for r in rows
            )
            for k in range(1, max_k + 1)
        }
    methods.append(
        method_report("ngram", float(beta_ng[:, :new_tokens].mean()), t_lookup / t_target, max_k, measured_ng)
    )
    out.update(
        ngram={"prompt_lookup_min": ngram_min, "prompt_lookup_max": ngram_max},
        lookup_s=t_lookup,
        methods=[asdict(m) for m in methods],
    )
    return out


def _per_pass(runs) -> float:
    """Tokens per target pass over all prompts: total tokens / total passes."""
    tokens = passes = 0
    for r in runs:
        tokens += sum(r)
        passes += len(r)
    return tokens / passes


def choose(report: dict) -> dict:
    """The serving fragment: the method with the highest predicted speed-up at its best k."""
    best = max(report["methods"], key=lambda m: m["predicted_speedup"])
    frag = {
        "method": best["method"],
        "num_speculative_tokens": best["k"],
        "alpha": best["alpha"],
        "cost_ratio": best["cost_ratio"],
        "predicted_speedup": best["predicted_speedup"],
        "pays": best["predicted_speedup"] > 1.0,
        "temperature": report["temperature"],
        "target_step": report["target_step"],
    }
    if best["method"] == "draft_model":
        frag.update(draft_run=report["draft_run"], draft_step=report["draft_step"])
    else:
        frag.update(report["ngram"])
    frag["candidates"] = {
        m["method"]: {
            "num_speculative_tokens": m["k"],
            "alpha": m["alpha"],
            "cost_ratio": m["cost_ratio"],
            "predicted_speedup": m["predicted_speedup"],
        }
        for m in report["methods"]
    }
    return frag


def write_spec(target_dir: str | Path, fragment: dict) -> Path:
    path = Path(target_dir) / SPEC_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(fragment, indent=2) + "\n")
    tmp.replace(path)
    return path


def format_table(report: dict) -> str:
    """One block per method: k, expected and measured tokens per target pass, predicted speed-up."""
    lines = []
    for m in report["methods"]:
        lines.append(
            f"{m['method']}: alpha={m['alpha']:.3f}  cost ratio c={m['cost_ratio']:.3f}  "
            f"chosen k={m['k']} (predicted speed-up {m['predicted_speedup']:.2f}x)"
        )
        lines.append(f"  {'k':>2}  {'E[tokens/pass]':>14}  {'measured':>8}  {'speed-up':>8}  {'measured':>8}")
        for r in m["rows"]:
            meas = (
                f"{r['measured_tokens_per_pass']:8.2f}" if r["measured_tokens_per_pass"] is not None else " " * 7 + "-"
            )
            msp = f"{r['measured_speedup']:7.2f}x" if r["measured_speedup"] is not None else " " * 7 + "-"
            mark = " <" if r["k"] == m["k"] else ""
            lines.append(
                f"  {r['k']:>2}  {r['expected_tokens_per_pass']:14.2f}  {meas}  "
                f"{r['predicted_speedup']:7.2f}x  {msp}{mark}"
            )
    return "\n".join(lines)
