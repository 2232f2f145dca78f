"""Does the model-based quality score pay? Top-k% by reference perplexity against a random k% (issue 17 §2).

CCNet's claim, measured on this machine: keeping the documents a reference model finds likely gives
a better model than keeping the same share at random, for the same training tokens.

1. Text. The bundled corpus's documents (stdlib prose and code), dealt by index into four parts:
   ``reference`` (text we trust: the reference model trains on it), ``heldout`` (the validation set
   no run trains on), ``clean`` and ``junk``. The corpus to curate is ``clean`` plus ``junk``
   degraded the way crawled text goes bad, alternately: *letter noise* (a third of the words
   replaced by random letters: OCR and encoding debris) and *word salad* (the document's words
   shuffled into one line: spun SEO text; its word-level statistics, e.g. Gopher's word count, mean
   word length and stop words, equal the original's, while the line-level rules see one long line).
2. The reference model: ``jobs/configs/tiny.toml`` trained on ``reference`` (its BPE tokenizer,
   trained on that text, is every later run's tokenizer).
3. ``raysc curate`` of the corpus with ``quality.reference_run`` (rules off, score only) gives every
   document's ``q_ppl``; the filtered arm is what the same curation keeps with
   ``quality.keep_top_percent = --keep`` (each domain's lowest-perplexity share), the random arm the
   same number of the scored documents drawn at random per seed.
4. Each arm trains ``tiny.toml`` for the same steps and tokens (``--steps``), one run per seed
   (``--seeds``; the random arm draws a new subset per seed), and is scored on ``heldout``: the mean
   over its documents of the next-token loss of their first ``model context`` tokens
   (``raysc.curate.perplexity.document_perplexities``), per domain too.

Also printed: the share of junk among the documents the filter drops (its precision), and how many
junk documents the rules alone (``quality.enabled``) would drop. Runs under one Ray instance; JSON
on the last line. Run it under ``flock /tmp/raysc-ray.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import degrade  # noqa: E402

CACHE = ROOT / ".cache" / "quality-bench"
CONFIG = str(ROOT / "jobs/configs/tiny.toml")


def write_jsonl(path: Path, docs: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return str(path)


def split_corpus(max_mb: float) -> dict[str, list[dict]]:
    from raysc.data.corpus import iter_documents

    parts: dict[str, list[dict]] = {"reference": [], "heldout": [], "clean": [], "junk": []}
    rng = random.Random(0)
    for i, d in enumerate(iter_documents(max_mb)):
        if len(d["text"].split()) < 50:
            continue
        name = ("reference", "heldout", "clean", "junk")[i % 4]
        doc = {"id": f"{name}-{i:05d}", "text": d["text"], "domain": d["domain"]}
        if name == "junk":
            kind = ("noise", "salad")[len(parts["junk"]) % 2]
            doc = {**doc, "id": f"junk-{kind}-{i:05d}", "text": degrade(d["text"], kind, rng)}
        parts[name].append(doc)
    return parts


def heldout_loss(run_dir: str, docs: list[dict]) -> dict:
    """Mean next-token loss (nats) over the held-out documents' first context tokens, overall and per domain."""
    from tokenizers import Tokenizer

    from raysc.curate.perplexity import document_perplexities
    from raysc.export.restore import load_run

    run = load_run(run_dir)
    tok = Tokenizer.from_file(str(run.tokenizer_path))
    ids = [e.ids[: run.model.max_seq_len] for e in tok.encode_batch([d["text"] for d in docs])]
    losses = [math.log(p) for p in document_perplexities(run.model.eval(), ids)]
    out = {"all": statistics.mean(losses)}
    for dom in sorted({d["domain"] for d in docs}):
        out[dom] = statistics.mean(x for x, d in zip(losses, docs) if d["domain"] == dom)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--keep", type=float, default=50.0, help="percent of each domain kept")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    import ray

    from raysc.config import load_config
    from raysc.curate.pipeline import curate
    from raysc.fleet.driver import train

    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    t0 = time.perf_counter()
    parts = split_corpus(args.corpus_mb)
    corpus_src = write_jsonl(CACHE / "corpus" / "part-0.jsonl", parts["clean"] + parts["junk"])
    ref_dir = CACHE / "reference"

    def quiet(*_a, **_k) -> None:
        pass

    ref_cfg = load_config(
        CONFIG,
        [
            f'data.source="{write_jsonl(CACHE / "reference.jsonl", parts["reference"])}"',
            f'run.dir="{ref_dir}"',
            f"train.steps={args.steps}",
        ],
    )
    train(ref_cfg, progress=False, overwrite=True)
    tokenizer = str(ref_dir / "tokenizer.json")
    print(f"reference trained ({time.perf_counter() - t0:.0f} s)", flush=True)

    def curated(name: str, *extra: str) -> tuple[dict, dict]:
        cfg = load_config(
            CONFIG,
            [
                f'curate.input="{Path(corpus_src).parent}"',
                f'curate.output="{CACHE / name}"',
                f'quality.reference_run="{ref_dir}"',
                *extra,
            ],
        )
        report = curate(cfg, log=quiet)
        return report, pq.read_table(CACHE / name / "documents").to_pydict()

    report, scored = curated("scored", "quality.enabled=false")
    _, filtered = curated("filtered", "quality.enabled=false", f"quality.keep_top_percent={args.keep}")
    _, ruled = curated("ruled", "quality.enabled=true")
    kept_ids = set(filtered["id"])
    n_keep = len(kept_ids)
    by_id = {d["id"]: d for d in parts["clean"] + parts["junk"]}
    junk_total = sum(i.startswith("junk") for i in scored["id"])
    dropped = [i for i in scored["id"] if i not in kept_ids]
    filter_stats = {
        "documents_after_dedup": len(scored["id"]),
        "kept": n_keep,
        "junk": junk_total,
        "dropped_junk_share": sum(i.startswith("junk") for i in dropped) / max(len(dropped), 1),
        "junk_kept": sum(i.startswith("junk") for i in kept_ids),
        "junk_dropped_by_rules": junk_total - sum(i.startswith("junk") for i in ruled["id"]),
        "salad_dropped_by_rules": sum(i.startswith("junk-salad") for i in scored["id"])
        - sum(i.startswith("junk-salad") for i in ruled["id"]),
        "perplexity_per_domain": report["quality"]["perplexity"]["per_domain"],
    }
    print(json.dumps(filter_stats), flush=True)

    results: dict[str, list] = {"filtered": [], "random": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        rng = random.Random(seed)
        arms = {"filtered": sorted(kept_ids), "random": rng.sample(sorted(scored["id"]), n_keep)}
        for arm, ids in arms.items():
            src = write_jsonl(CACHE / f"{arm}-{seed}.jsonl", [by_id[i] for i in ids])
            run_dir = CACHE / f"run-{arm}-{seed}"
            cfg = load_config(
                CONFIG,
                [
                    f'data.source="{src}"',
                    f'data.tokenizer="{tokenizer}"',
                    f'run.dir="{run_dir}"',
                    f"train.steps={args.steps}",
                    f"train.seed={seed}",
                ],
            )
            summary = train(cfg, progress=False, overwrite=True)
            loss = heldout_loss(str(run_dir), parts["heldout"])
            row = {
                "seed": seed,
                "heldout_loss": loss,
                "final_train_loss": summary.get("final_loss"),
                "junk_in_training_set": sum(i.startswith("junk") for i in ids),
            }
            results[arm].append(row)
            print(json.dumps({arm: row}), flush=True)
    mean = {arm: statistics.mean(r["heldout_loss"]["all"] for r in rows) for arm, rows in results.items()}
    print("\n| arm | held-out loss per seed | mean | junk documents trained on |\n|---|---|---|---|")
    for arm, rows in results.items():
        losses = ", ".join(f"{r['heldout_loss']['all']:.4f}" for r in rows)
        junk = ", ".join(str(r["junk_in_training_set"]) for r in rows)
        print(f"| {arm} | {losses} | {mean[arm]:.4f} | {junk} |")
    print(
        json.dumps(
            {
                "keep_percent": args.keep,
                "steps": args.steps,
                "filter": filter_stats,
                "arms": results,
                "mean_heldout_loss": mean,
                "filtered_lower": mean["filtered"] < mean["random"],
                "filtered_lower_every_seed": all(
                    f["heldout_loss"]["all"] < r["heldout_loss"]["all"]
                    for f, r in zip(results["filtered"], results["random"])
                ),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
