"""Document masking (``train.document_mask``): what it costs and what it changes.

Speed: the default model, plain causal attention against block-causal over packed documents (random
tokens, an EOS on average every 300 tokens, or every 5,000 as in the bundled corpus), two ``Trainer``s in
this process alternating step by step (same threads, same timing: the step's own ``step_time``), median
of ``BENCH_STEPS`` steps after warm-up, at three sequence lengths; the attention kernel each one ran
(from the torch profiler) is reported.

Effect: the same model trained on the bundled corpus with and without masking (with per-document
positions, ``train.document_positions``), ``BENCH_SEEDS`` seeds, equal tokens; validation loss on the
held-out rows with each model's own attention, over all of them and over those that cross a document
boundary (the only rows masking can change). Prints JSON on its last line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raysc.config import load_config  # noqa: E402
from raysc.data.prepare import prepare_data  # noqa: E402
from raysc.model.documents import document_ids  # noqa: E402
from raysc.train.trainer import Trainer  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", "15"))
SEEDS = [int(s) for s in os.environ.get("BENCH_SEEDS", "1,2,3").split(",")]
TRAIN_STEPS = int(os.environ.get("BENCH_TRAIN_STEPS", "300"))
MASK = ["train.document_mask=true", "train.document_positions=true"]


def kernels(trainer: Trainer) -> list[str]:
    from torch.profiler import profile

    with profile() as prof:
        trainer.train_step()
    return sorted(
        {
            e.name
            for e in prof.events()
            if "scaled_dot_product" in e.name
            and "backward" not in e.name
            and e.name != "aten::scaled_dot_product_attention"
        }
    )


def speed(seq: int, batch: int, doc_tokens: int) -> dict:
    common = [f"train.seq_len={seq}", f"train.global_batch={batch}", f"train.steps={STEPS + 10}"]
    rng = np.random.default_rng(0)
    rows = rng.integers(1, 2048, size=(batch * (STEPS + 10), seq + 1))
    rows[rng.random(rows.shape) < 1 / doc_tokens] = 0
    plain = Trainer(load_config(None, common), rows, None, measure_peak=False)
    masked = Trainer(load_config(None, [*common, *MASK]), rows, None, measure_peak=False, eos_id=0)
    out = {
        "seq_len": seq,
        "batch": batch,
        "doc_tokens": doc_tokens,
        "kernel_plain": kernels(plain),
        "kernel_masked": kernels(masked),
    }
    for t in (plain, masked):
        t.train_step()
    times: dict[str, list[float]] = {"plain": [], "masked": []}
    for _ in range(STEPS):
        times["plain"].append(plain.train_step()["step_time"])
        times["masked"].append(masked.train_step()["step_time"])
    out.update({f"{k}_step_s": round(statistics.median(v), 4) for k, v in times.items()})
    out["masked_over_plain"] = round(out["masked_step_s"] / out["plain_step_s"], 3)
    return out


def boundary_rows(rows: np.ndarray, eos: int) -> np.ndarray:
    """Held-out rows whose inputs hold more than one document."""
    docs = document_ids(torch.from_numpy(rows[:, :-1].astype(np.int64)), eos)
    return rows[(docs[:, -1] > 0).numpy()]


def effect(cache: str) -> dict:
    common = [
        "train.seq_len=256",
        "train.global_batch=8",
        f"train.steps={TRAIN_STEPS}",
        "data.val_fraction=0.02",
        f'data.cache_dir="{cache}"',
    ]
    packed, _, info = prepare_data(load_config(None, common))
    eos = info["special_tokens"]["eos_id"]
    crossing = boundary_rows(packed.val, eos)
    runs = []
    for seed in SEEDS:
        for masked in (False, True):
            cfg = load_config(None, [*common, f"train.seed={seed}", *(MASK if masked else [])])
            trainer = Trainer(cfg, packed.train, packed.val, measure_peak=False, eos_id=eos)
            for _ in range(TRAIN_STEPS):
                trainer.train_step()
            val = trainer.val_loss(max_sequences=len(packed.val))
            trainer.val_rows = crossing
            runs.append(
                {
                    "seed": seed,
                    "masked": masked,
                    "val_loss": round(val, 4),
                    "val_loss_crossing": round(trainer.val_loss(max_sequences=len(crossing)), 4),
                }
            )
            print(json.dumps(runs[-1]), flush=True)

    def mean(masked: bool, key: str) -> float:
        return round(statistics.mean(r[key] for r in runs if r["masked"] == masked), 4)

    return {
        "train_steps": TRAIN_STEPS,
        "tokens": TRAIN_STEPS * 8 * 256,
        "val_rows": len(packed.val),
        "val_rows_crossing": len(crossing),
        "runs": runs,
        "mean": {k: {"plain": mean(False, k), "masked": mean(True, k)} for k in ("val_loss", "val_loss_crossing")},
    }


def main() -> None:
    torch.set_num_threads(2)
    cases = [(128, 16, 300), (512, 4, 300), (2048, 1, 300), (512, 4, 5000), (2048, 1, 5000)]
    result = {"speed": [speed(seq, batch, every) for seq, batch, every in cases]}
    for row in result["speed"]:
        print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        result["effect"] = effect(cache)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
