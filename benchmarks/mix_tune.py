"""Does a tuned domain mixture pay? ``raysc mix tune`` against the natural proportions (issue 17 §3).

The corpus is shaped like a crawl: the bundled corpus's prose (stdlib documentation) dealt into
``prose`` (a third, kept clean: the high-quality domain) and ``web`` (the rest, degraded the way
crawled text goes bad, alternately letter noise and word salad, as in ``quality_score.py``), and its
``code`` as it is. ``raysc curate`` (rules off, so ``web`` stays) and ``raysc pack`` make the packed
directory; the natural proportions are then roughly code 1/2, web 1/3, prose 1/6.

``raysc mix tune`` with target ``prose``: ``--proxies`` runs of ``jobs/configs/tiny.toml`` for
``--steps`` steps on Dirichlet draws around the natural mixture, two at a time (one core each), the
regression, the tuned schedule, and validation runs of the natural, tuned and two-phase schedules
for ``--validate-steps`` steps on each of ``--seeds`` (same token budget and seeds for every arm).
Printed: each arm's held-out loss per domain (the trade-off), the fit's leave-one-out error and rank
correlation, the tuned weights. JSON on the last line. Run it under ``flock /tmp/raysc-ray.lock``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import degrade  # noqa: E402

CACHE = ROOT / ".cache" / "mix-bench"
CONFIG = str(ROOT / "jobs/configs/tiny.toml")


def crawl_like(max_mb: float) -> list[dict]:
    from raysc.data.corpus import iter_documents

    rng, docs, n_prose = random.Random(0), [], 0
    for d in iter_documents(max_mb):
        if d["domain"] == "code":
            docs.append({"id": d["id"], "text": d["text"], "domain": "code"})
            continue
        n_prose += 1
        if n_prose % 3 == 0:
            docs.append({"id": d["id"], "text": d["text"], "domain": "prose"})
        else:
            kind = ("noise", "salad")[n_prose % 2]
            docs.append({"id": f"{d['id']}-{kind}", "text": degrade(d["text"], kind, rng), "domain": "web"})
    return docs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus-mb", type=float, default=6.0)
    ap.add_argument("--proxies", type=int, default=12)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--validate-steps", type=int, default=300)
    ap.add_argument("--seeds", default="1,2,3")
    args = ap.parse_args()

    import ray

    from raysc.config import load_config
    from raysc.curate.pack import pack_curated
    from raysc.curate.pipeline import curate
    from raysc.mix.tune import TuneOptions, tune_mixture

    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    t0 = time.perf_counter()
    corpus = CACHE / "corpus" / "part-0.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text("".join(json.dumps(d) + "\n" for d in crawl_like(args.corpus_mb)), encoding="utf-8")
    base = [
        f'run.dir="{CACHE / "run"}"',
        f'data.cache_dir="{CACHE / "cache"}"',
        "parallel.cpus_per_worker=1",
        "data.val_fraction=0.05",
    ]
    cfg = load_config(
        CONFIG,
        [
            *base,
            f'curate.input="{corpus.parent}"',
            f'curate.output="{CACHE / "curated"}"',
            "quality.enabled=false",
            "dedup.near=false",
        ],
    )
    curate(cfg, log=lambda *_: None)
    packed = str(CACHE / "curated" / "packed")
    index = pack_curated(
        str(CACHE / "curated"),
        None,
        cfg.model.vocab_size,
        cfg.train.seq_len,
        packed,
        log=lambda *_: None,
        sample_mb=cfg.data.tokenizer_sample_mb,
        seed=cfg.train.seed,
    )
    print(json.dumps({d: m["tokens"] for d, m in index["domains"].items()}), flush=True)
    opts = TuneOptions(
        target="prose",
        proxies=args.proxies,
        steps=args.steps,
        validate_seeds=[int(s) for s in args.seeds.split(",")],
        validate_steps=args.validate_steps,
        out=str(CACHE / "tune"),
    )
    report = tune_mixture(CONFIG, [*base, f'data.source="{packed}"'], opts, log=lambda m: print(m, flush=True))
    v = report["validation"]
    print("\n| schedule | " + " | ".join(f"{d} held-out loss" for d in report["domains"]) + " |")
    print("|---|" + "---|" * len(report["domains"]))
    for arm, a in v["arms"].items():
        cells = " | ".join(
            f"{a['mean'][d]:.4f} ({', '.join(f'{p[d]:.3f}' for p in a['per_seed'])})" for d in report["domains"]
        )
        print(f"| {arm} `{a['schedule']}` | {cells} |")
    print(
        json.dumps(
            {
                "tokens": {d: m["tokens"] for d, m in index["domains"].items()},
                "natural": report["natural"],
                "tuned": report["tuned"],
                "fit": report["fit"],
                "fits": report["fits"],
                "proxies": len(report["proxies"]),
                "proxy_steps": args.steps,
                "validation": {
                    k: v[k]
                    for k in (
                        "steps",
                        "seeds",
                        "tuned_minus_natural",
                        "two_phase_minus_natural",
                        "tuned_lower_on_target",
                        "tuned_lower_every_seed",
                    )
                },
                "target_loss": {arm: a["target_loss"] for arm, a in v["arms"].items()},
                "plot": report["plot"],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
