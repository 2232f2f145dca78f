"""vLLM's own acceptance counts next to ``raysc spec tune``'s prediction (issue 15).

``raysc spec tune`` predicts speculative decoding from raysc's models: α, the chance a drafted token
is accepted, and at T = 0 an exact replay of the passes a greedy drafter makes (``greedy_passes``,
``ngram_passes``). This benchmark asks vLLM the same question on the same prompts and compares:

1. raysc side (torch, in this process): the target's greedy continuation of ``--prompts`` held-out
   prompts (the first ``--prompt-len`` tokens of its validation rows, as ``spec tune`` takes them),
   α for the draft run and for prompt lookup, and the replayed passes for each k: drafts (passes
   that drafted anything), drafted tokens, accepted tokens, accepted per draft position.
2. vLLM side (offline ``vllm.LLM`` in a child process: vLLM spawns its engine and must start under
   ``__main__``): the exported target in its exported dtype with ``speculative_config`` exactly as
   ``raysc serve`` builds them (``raysc.serve.engine.speculative_config``), the same token-id prompts, greedy, ``--new-tokens``
   tokens, end-of-sequence ignored, ``disable_log_stats=False``; ``LLM.get_metrics()`` gives vLLM's
   counters ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and
   ``..._num_accepted_tokens_per_pos`` (the ones Ray Serve LLM exports to Prometheus when
   ``log_engine_metrics`` is on).

What is compared, per case (draft model at k = 1 and 3, prompt lookup 2-4 at k = 4):
- vLLM's acceptance at draft position 1 (accepted there / drafts) against ``spec tune``'s α: the
  same quantity when acceptances are independent of where a pass starts;
- vLLM's mean tokens per target pass (1 + accepted / drafts) against the replay's and against
  Leviathan's E(k) from α;
- whether vLLM's speculative output equals raysc's greedy continuation (prompts agreeing token for
  token), since a greedy replay only predicts vLLM's counts where the two greedy texts agree.
vLLM counts a pass only when it drafted something; prompt lookup proposes nothing when no suffix
recurs, so its vLLM rates are conditional on a proposal, while ``spec tune``'s α for it counts a
missing proposal as a rejection. Both are printed (``alpha_given_proposal``).

Run after ``make run`` (``runs/demo``) and ``raysc train jobs/configs/draft.toml`` (``runs/draft``);
prints a markdown table, then JSON on its last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def vllm_child(job: dict) -> dict:
    """(in a child process) vLLM's outputs and speculative-decoding counters for one case."""
    from common import exported_dtype
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["folder"],
        enforce_eager=True,
        dtype=exported_dtype(job["folder"]),
        max_model_len=job["max_model_len"],
        seed=0,
        disable_log_stats=False,
        speculative_config=job["speculative"],
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    got: dict = {"outputs": [list(o.outputs[0].token_ids) for o in outs]}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_"):
            key = m.name.removeprefix("vllm:spec_decode_num_")
            got[key] = list(m.values) if hasattr(m, "values") else m.value
    return got


def run_vllm(job: dict) -> dict:
    from common import run_vllm_child

    return run_vllm_child(__file__, ["--vllm-child", json.dumps(job)], timeout=900)


def counts(passes: list[tuple[int, int]], k: int) -> dict:
    """vLLM's counters from replayed passes, each (drafted tokens, accepted tokens)."""
    drafted = [(d, a) for d, a in passes if d]
    per_pos = [sum(1 for _, a in drafted if a > i) for i in range(k)]
    return {
        "drafts": len(drafted),
        "draft_tokens": sum(d for d, _ in drafted),
        "accepted_tokens": sum(a for _, a in drafted),
        "accepted_tokens_per_pos": per_pos,
    }


def replay_draft(match, k: int, limit: int) -> list[tuple[int, int]]:
    """Passes of a greedy draft model: k drafted, accepted up to the first mismatch (``greedy_passes``)."""
    out, t = [], 0
    while t < limit:
        a = 0
        while a < k and match[t + a]:
            a += 1
        out.append((k, a))
        t += a + 1
    return out


def replay_ngram(row: list[int], prompt_len: int, k: int, min_n: int, max_n: int, limit: int) -> list[tuple[int, int]]:
    """Passes of prompt lookup over the target's own continuation (``ngram_passes``), with draft lengths."""
    from raysc.serve.speculative import ngram_propose

    out, t = [], 0
    while t < limit:
        proposal = ngram_propose(row[: prompt_len + t], k, min_n, max_n)
        a = 0
        while a < len(proposal) and proposal[a] == row[prompt_len + t + a]:
            a += 1
        out.append((len(proposal), a))
        t += a + 1
    return out


def summary(c: dict, k: int) -> dict:
    drafts = max(c.get("drafts", 0), 1)
    per_pos = c.get("accepted_tokens_per_pos") or [0] * k
    return {
        "drafts": c.get("drafts", 0),
        "acceptance_rate": c.get("accepted_tokens", 0) / max(c.get("draft_tokens", 0), 1),
        "alpha_position_1": per_pos[0] / drafts,
        "per_position": [p / drafts for p in per_pos],
        "tokens_per_pass": 1 + c.get("accepted_tokens", 0) / drafts,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / "runs/demo"))
    ap.add_argument("--draft", default=str(ROOT / "runs/draft"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-ks", default="1,3")
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_child:
        print(json.dumps(vllm_child(json.loads(args.vllm_child))))
        return

    import torch

    from raysc.config.schema import ServeConfig
    from raysc.export.restore import load_run
    from raysc.serve.engine import speculative_config
    from raysc.serve.source import resolve
    from raysc.serve.spec_tune import acceptance, continue_prompts, expected_tokens, held_out_prompts, ngram_acceptance

    ks = [int(k) for k in args.draft_ks.split(",")]
    n_new, plen = args.new_tokens, args.prompt_len
    target, draft = load_run(args.target), load_run(args.draft)
    target.model.eval()
    draft.model.eval()
    torch.manual_seed(0)
    x = held_out_prompts(target.cfg, args.prompts, plen)
    # k + 1 tokens past n_new: a pass that starts before n_new is replayed whole
    seqs = continue_prompts(target.model, x, n_new + max(ks + [args.ngram_k]) + 1, 0.0, 0)
    rows = seqs.tolist()
    beta = acceptance(target.model, draft.model, seqs, plen, 0.0)
    alpha_draft = float(beta[:, :n_new].mean())
    match = (beta > 0.5).numpy()
    alpha_ng = float(ngram_acceptance(target.model, seqs, plen, 0.0, 2, 4)[:, :n_new].mean())
    cfg = ServeConfig()
    folder = resolve(args.target).path
    draft_folder = resolve(args.draft).path
    prompts = [r[:plen] for r in rows]
    reference = [r[plen : plen + n_new] for r in rows]
    max_len = plen + n_new + max(ks + [args.ngram_k]) + 8
    cases = [("draft_model", k, alpha_draft) for k in ks] + [("ngram", args.ngram_k, alpha_ng)]
    results = []
    for method, k, alpha in cases:
        cfg.num_speculative_tokens, cfg.speculative_method = k, method
        spec = speculative_config(cfg, draft_folder, None)
        if method == "draft_model":
            passes = [p for m in match for p in replay_draft(m, k, n_new)]
        else:
            passes = [
                p
                for r in rows
                for p in replay_ngram(r, plen, k, spec["prompt_lookup_min"], spec["prompt_lookup_max"], n_new)
            ]
        rep = counts(passes, k)
        got = run_vllm(
            {"folder": folder, "speculative": spec, "prompts": prompts, "new_tokens": n_new, "max_model_len": max_len}
        )
        row = {
            "method": method,
            "k": k,
            "alpha_spec_tune": alpha,
            "expected_tokens_per_pass": expected_tokens(alpha, k),
            "replay": {**summary(rep, k), **rep},
        }
        if "error" in got:
            row["vllm"] = got
        else:
            same = sum(o == r for o, r in zip(got.pop("outputs"), reference))
            row["vllm"] = {**summary(got, k), **got, "outputs_equal_raysc_greedy": f"{same}/{len(prompts)}"}
        results.append(row)
        print(json.dumps(row), flush=True)
    print(
        "| drafter | k | α (spec tune) | position 1, replay | position 1, vLLM | E(k) | tokens/pass replay "
        "| tokens/pass vLLM | vLLM acceptance rate | drafts replay / vLLM | outputs equal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        v = r["vllm"]
        if "error" in v:
            print(f"| {r['method']} | {r['k']} | {r['alpha_spec_tune']:.3f} | – | error | – | – | – | – | – | – |")
            continue
        print(
            f"| {r['method']} | {r['k']} | {r['alpha_spec_tune']:.3f} | {r['replay']['alpha_position_1']:.3f} "
            f"| {v['alpha_position_1']:.3f} | {r['expected_tokens_per_pass']:.2f} | {r['replay']['tokens_per_pass']:.2f} "
            f"| {v['tokens_per_pass']:.2f} | {v['acceptance_rate']:.3f} | {r['replay']['drafts']} / {v['drafts']} "
            f"| {v['outputs_equal_raysc_greedy']} |"
        )
    print(
        json.dumps(
            {
                "prompts": args.prompts,
                "prompt_len": plen,
                "new_tokens": n_new,
                "target_step": target.step,
                "draft_step": draft.step,
                "cases": results,
            }
        )
    )


if __name__ == "__main__":
    main()
