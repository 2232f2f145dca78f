"""Distil a draft model from its target on soft targets, and measure what it buys in acceptance.

The draft's architecture, optimizer, schedule, batch and steps come from a draft config (e.g.
``jobs/configs/draft.toml``); instead of the corpus's next token it learns the target's whole
next-token distribution on the target's *training* rows: loss = KL(p_target ‖ q_draft) at
temperature 1 (Hinton et al. 2015; DistillSpec, Zhou et al. 2024, shows that matching the target's
distribution is what raises speculative acceptance). The validation rows, where ``raysc spec tune``
measures α, are never used. Then both drafts — the run trained on the same data and the distilled
one — are measured against the target on the same held-out prompts and continuations.

A one-process loop of our own, not ``raysc train``: the fleet's step has no second (teacher) model,
and a ~0.3M-parameter draft needs no parallelism. The distilled draft is written as a Hugging Face
folder (``raysc.export.hf``), which vLLM takes as a speculative draft model.

    python -m raysc.serve.spec_distill runs/demo jobs/configs/draft.toml --baseline runs/draft \
        --out runs/draft-distilled-hf
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from raysc.model.llama import Llama, build_model
from raysc.serve.spec_tune import acceptance, continue_prompts, greedy_passes, held_out_prompts


def training_rows(target_cfg) -> np.ndarray:
    """The target's training rows (n, seq_len + 1); never its validation rows."""
    from raysc.data.prepare import prepare_data

    packed, _, _ = prepare_data(target_cfg)
    train = packed.train
    return train if isinstance(train, np.ndarray) else np.concatenate(list(train.values()))


def distill(
    target: Llama, draft_cfg, rows: np.ndarray, log_every: int = 50, loss_kind: str = "kl"
) -> tuple[Llama, list[dict]]:
    """A fresh draft (``draft_cfg``'s model, seed, optimizer, schedule, batch and steps) trained on
    KL(p_target ‖ q_draft) over ``rows`` (``loss_kind="ce"``: on the rows' next tokens instead, the
    same-data control with everything else equal); returns it and its loss log."""
    if loss_kind not in ("kl", "ce"):
        raise ValueError(f"loss_kind {loss_kind!r}: use 'kl' (distillation) or 'ce' (the data's next tokens)")
    from raysc.train.optim import build_optimizer, build_scheduler

    t = draft_cfg.train
    if rows.shape[1] - 1 > draft_cfg.rope_len:
        raise ValueError(f"rows of {rows.shape[1] - 1} tokens exceed the draft's context {draft_cfg.rope_len}")
    draft = build_model(draft_cfg.model, draft_cfg.rope_len, t.seed)
    opt = build_optimizer(list(draft.named_parameters()), draft_cfg.optim, draft_cfg.model)
    sched = build_scheduler(opt, t.steps, draft_cfg.schedule)
    order = np.random.default_rng(t.seed).permutation(len(rows))
    target.eval()
    log, t0 = [], time.perf_counter()
    for step in range(t.steps):
        idx = np.take(order, range(step * t.global_batch, (step + 1) * t.global_batch), mode="wrap")
        x = torch.from_numpy(rows[idx, :-1]).long()
        q_log = F.log_softmax(draft(x).float(), -1)
        if loss_kind == "ce":
            loss = F.nll_loss(q_log.flatten(0, 1), torch.from_numpy(rows[idx, 1:]).long().flatten())
        else:
            with torch.no_grad():
                p_log = F.log_softmax(target(x).float(), -1)
            loss = F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), draft_cfg.optim.clip_norm)
        opt.step()
        sched.step()
        if (step + 1) % log_every == 0 or step + 1 == t.steps:
            log.append({"step": step + 1, loss_kind: float(loss.detach()), "time": time.perf_counter() - t0})
    return draft.eval(), log


def compare(
    target: Llama,
    drafts: dict[str, Llama],
    target_cfg,
    prompts: int = 32,
    prompt_len: int = 32,
    new_tokens: int = 64,
    max_k: int = 8,
) -> dict:
    """α (T = 0 and T = 1) and T = 0 tokens per target pass at each k, per draft, on held-out prompts."""
    x = held_out_prompts(target_cfg, prompts, prompt_len)
    out: dict = {}
    for temperature in (0.0, 1.0):
        seqs = continue_prompts(target, x, new_tokens + max_k + 1, temperature, 0)
        for name, d in drafts.items():
            beta = acceptance(target, d, seqs, prompt_len, temperature)  # k + 1 positions past new_tokens
            entry = out.setdefault(name, {})
            entry[f"alpha_T{temperature:g}"] = float(beta[:, :new_tokens].mean())
            if temperature == 0:
                match = (beta > 0.5).numpy()
                entry["tokens_per_pass_T0"] = {
                    k: sum(sum(greedy_passes(m, k, new_tokens)) for m in match)
                    / sum(len(greedy_passes(m, k, new_tokens)) for m in match)
                    for k in range(1, max_k + 1)
                }
    return out


def main(argv: list[str] | None = None) -> int:
    from raysc.config.load import load_config
    from raysc.export.hf import export_hf
    from raysc.export.restore import load_run

    ap = argparse.ArgumentParser(description="distil a draft from its target (soft targets) and compare acceptance")
    ap.add_argument("target_run")
    ap.add_argument("draft_config", help="the draft's TOML config (model, optim, schedule, train.steps/batch/seed)")
    ap.add_argument("--baseline", help="a draft run trained on the same data, compared on the same prompts")
    ap.add_argument("--out", help="write the distilled draft here as a Hugging Face folder")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--loss",
        choices=["kl", "ce"],
        default="kl",
        help="kl: distil the target's distribution; ce: the data's next tokens (same-loop control)",
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = load_run(a.target_run)
    cfg = load_config(a.draft_config, a.overrides)
    if cfg.model.vocab_size != target.cfg.model.vocab_size:
        raise ValueError(f"draft model.vocab_size {cfg.model.vocab_size} != the target's {target.cfg.model.vocab_size}")
    drafts = {}
    if a.baseline:
        baseline = load_run(a.baseline)
        if baseline.tokenizer_path.read_bytes() != target.tokenizer_path.read_bytes():
            raise ValueError(f"{a.baseline} and {a.target_run} use different tokenizers; a draft needs the target's")
        drafts["same_data"] = baseline.model.eval()
    distilled, log = distill(target.model, cfg, training_rows(target.cfg), loss_kind=a.loss)
    drafts["distilled" if a.loss == "kl" else "same_data_loop"] = distilled
    if a.out:
        export_hf(distilled, target.tokenizer_path, a.out)
    loss = "KL(p_target || q_draft), T=1" if a.loss == "kl" else "cross-entropy on the data's next tokens"
    result = {
        "recipe": f"{loss}, {cfg.train.steps} steps x {cfg.train.global_batch} rows "
        f"of the target's training data, model/optim/schedule of {a.draft_config}",
        "distill_log": log,
        "compare": compare(target.model, drafts, target.cfg, a.prompts),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
