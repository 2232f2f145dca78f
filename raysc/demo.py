"""``raysc demo`` (what ``make run`` calls): the whole path on one machine.

Builds the bundled corpus, trains the tokenizer and a tiny Llama through the
supervisor and a worker actor, checkpoints, exports a Hugging Face folder and
prints sample generations and a summary. The last line is the JSON summary.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from raysc.config.load import load_config

DEMO_CONFIG = Path(__file__).with_name("demo.toml")
PROMPTS = ["def read_config(path):\n", "The built-in function"]


def run_demo(overrides: list[str] = ()) -> dict:
    from raysc.data.corpus import build_bundled_corpus, corpus_meta
    from raysc.export.hf import export_hf
    from raysc.export.restore import load_run, sample_text
    from raysc.fleet.driver import train

    t0 = time.time()
    cfg = load_config(DEMO_CONFIG, overrides)
    print("== 1/4 corpus: Python standard library docs (prose) and source (code)", flush=True)
    meta = corpus_meta(build_bundled_corpus(Path(cfg.data.cache_dir), cfg.data.max_corpus_mb))
    for domain, s in meta.get("domains", {}).items():
        print(f"   {domain:6s} {s['documents']:5d} documents {s['bytes'] / 1e6:6.2f} MB", flush=True)

    print(f"== 2/4 training {cfg.train.steps} steps (supervisor + TrainWorker actor)", flush=True)
    summary = train(cfg, overwrite=True)  # each demo replaces the previous demo run's checkpoints

    print("== 3/4 export to Hugging Face format", flush=True)
    hf_dir = Path(summary["run_dir"]) / "hf"
    run = load_run(summary["run_dir"])
    export_hf(run.model, run.tokenizer_path, hf_dir)
    print(f"   {hf_dir} (model.safetensors, config.json, tokenizer.json)", flush=True)

    print("== 4/4 samples (greedy)", flush=True)
    samples = {}
    for prompt in PROMPTS:
        samples[prompt] = sample_text(summary["run_dir"], prompt, 48, 0.0, 0, 0)
        print("   ---\n" + "\n".join("   " + line for line in samples[prompt].splitlines()), flush=True)

    summary = {**summary, "export": str(hf_dir), "demo_wall_s": round(time.time() - t0, 1)}
    print("== summary", flush=True)
    val = "missing" if summary["val_loss"] is None else f"{summary['val_loss']:.3f}"  # (validation_missing)
    print(
        f"   loss {summary['final_loss']:.3f} (val {val}) after {summary['steps']} steps, "
        f"{summary['tokens_per_s']:.0f} tokens/s, MFU {summary['mfu']:.1%} of measured CPU matmul peak, "
        f"{summary['demo_wall_s']} s",
        flush=True,
    )
    print(json.dumps(summary), flush=True)
    return summary
