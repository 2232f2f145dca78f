"""``raysc curate --audit``: measure near-dedup recall and precision on injected duplicates.

Takes documents of the input (at least ``MIN_WORDS`` words, chosen with ``train.seed``),
gives each one a rewritten copy at a target Jaccard similarity between 0.3 and 1.0 (random
words replaced; the exact shingle Jaccard is measured, not assumed), runs the whole curation
pipeline on input + copies (quality rules off, so only dedup removes), and reports per
similarity band: pairs, copies removed (recall) next to the LSH theory 1-(1-s^r)^b, and the
removals at or below similarity 0.5 (false positives). Copies get ids that sort after their
original's, so a detected pair keeps the original.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np

from raysc.config.schema import Config
from raysc.curate.minhash import candidate_probability, jaccard
from raysc.curate.words import words

TARGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)
BANDS = ((0.0, 0.5), (0.5, 0.7), (0.7, 0.85), (0.85, 0.95), (0.95, 1.01))
MIN_WORDS = 150


def rewrite(text: str, target: float, shingle: int, rng: random.Random) -> str:
    """``text`` with a share of its words replaced so that the shingle Jaccard is near ``target``:
    a replaced word breaks the ``shingle`` shingles covering it, so a share q = 2J/(1+J) of
    shingles survives when a share 1 - q^(1/shingle) of words is replaced."""
    if target >= 1.0:
        return text
    q = 2 * target / (1 + target)
    frac = 1 - q ** (1 / shingle)
    return " ".join(f"audit{rng.getrandbits(40):x}" if rng.random() < frac else w for w in text.split(" "))


def inject_pairs(docs: list[dict], shingle: int, seed: int, per_target: int = 8) -> tuple[list[dict], list[dict]]:
    """Rewritten copies of seeded documents (``per_target`` per similarity in ``TARGETS``):
    the pairs (original id, copy id, target, measured shingle Jaccard) and the copy documents,
    whose ids sort after their original's."""
    rng = random.Random(seed)
    candidates = [r for r in docs if len(words(r["text"])) >= MIN_WORDS]
    need = per_target * len(TARGETS)
    if len(candidates) < need:
        raise ValueError(
            f"the audit needs {need} documents of at least {MIN_WORDS} words; the input has {len(candidates)}"
        )
    pairs, copies = [], []
    for i, base in enumerate(rng.sample(candidates, need)):
        target = TARGETS[i % len(TARGETS)]
        text = rewrite(base["text"], target, shingle, rng)
        copy_id = f"{base['id']}~audit{i:04d}"
        pairs.append(
            {"original": base["id"], "copy": copy_id, "target": target, "jaccard": jaccard(base["text"], text, shingle)}
        )
        copies.append({"id": copy_id, "text": text, "domain": base["domain"]})
    return pairs, copies


def run_audit(cfg: Config, log=print, pairs_per_target: int = 8) -> dict:
    from raysc.curate.inputs import list_inputs, parse_file
    from raysc.curate.pipeline import curate

    c = cfg.curate
    out = cfg.curated_uri + "/audit"
    prefix, options, files = list_inputs(cfg)
    docs = [r for f in files for r in parse_file(f, options, c.text_field, c.id_field, c.domain_field) if not r["bad"]]
    for i, r in enumerate(docs):  # inputs without ids get stable ones, so copies sort after them
        r["id"] = r["id"] or f"doc{i:07d}"
    pairs, copies = inject_pairs(docs, cfg.dedup.shingle, cfg.train.seed, pairs_per_target)
    import fsspec

    fs, root = fsspec.core.url_to_fs(out, **options)
    fs.makedirs(root, exist_ok=True)
    lines = [json.dumps({"id": r["id"], "text": r["text"], "domain": r["domain"]}) for r in docs + copies]
    fs.pipe_file(f"{root}/input.jsonl", ("\n".join(lines) + "\n").encode())
    run_cfg = copy.deepcopy(cfg)
    run_cfg.curate.input = f"{out}/input.jsonl"
    run_cfg.curate.output = f"{out}/run"
    run_cfg.curate.id_field, run_cfg.curate.text_field, run_cfg.curate.domain_field = "id", "text", "domain"
    run_cfg.quality.enabled = False
    log(f"curate --audit: {len(docs)} documents + {len(copies)} rewritten copies")
    report = curate(run_cfg, log=log)
    import pyarrow.parquet as pq

    from raysc.curate.output import arrow_fs

    survivors = set(pq.read_table(f"{root}/run/documents", filesystem=arrow_fs(out, options)).column("id").to_pylist())
    rows = []
    d = cfg.dedup
    for lo, hi in BANDS:
        inside = [p for p in pairs if lo <= p["jaccard"] < hi]
        removed = [p for p in inside if pair_detected(p, survivors)]
        s = np.array([p["jaccard"] for p in inside]) if inside else np.zeros(0)
        rows.append(
            {
                "similarity": f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}",
                "pairs": len(inside),
                "removed": len(removed),
                "recall": round(len(removed) / len(inside), 3) if inside else None,
                "lsh_theory": round(float(candidate_probability(s, d.bands, d.rows).mean()), 3) if inside else None,
            }
        )
    removed_copies = [p for p in pairs if pair_detected(p, survivors)]
    false = [p for p in removed_copies if p["jaccard"] <= 0.5]
    audit = {
        "pairs": len(pairs),
        "bands": rows,
        "removed_at_or_below_0.5": len(false),
        "precision": round(1 - len(false) / len(removed_copies), 3) if removed_copies else None,
        "recall_at_or_above_0.85": _recall([p for p in pairs if p["jaccard"] >= 0.85], survivors),
        "dedup": {
            "minhash": d.minhash,
            "num_perm": d.num_perm,
            "bands": d.bands,
            "rows": d.rows,
            "shingle": d.shingle,
            "threshold": d.threshold,
        },
        "pipeline": {k: report[k] for k in ("documents", "removed")},
    }
    fs.pipe_file(f"{root}/audit.json", json.dumps({**audit, "pair_list": pairs}, indent=1).encode())
    log(
        f"curate --audit: recall at similarity >= 0.85: {audit['recall_at_or_above_0.85']}, "
        f"removed at <= 0.5: {len(false)} -> {out}/audit.json"
    )
    return audit


def _recall(pairs: list[dict], survivors: set) -> float | None:
    if not pairs:
        return None
    return round(sum(pair_detected(p, survivors) for p in pairs) / len(pairs), 3)


def pair_detected(pair: dict, survivors: set) -> bool:
    """The pair was treated as duplicates: not both kept (the survivor of their cluster may be a
    third document of the corpus, when the original itself had a near-duplicate)."""
    return not (pair["copy"] in survivors and pair["original"] in survivors)
