"""Quantization quality table (issue 16): held-out perplexity, bytes per parameter, file size and
decode tokens/s of one trained ``small`` run at every precision raysc writes.

1. The run: ``jobs/configs/small.toml`` (6.5M parameters, vocab 8192, 6 layers of 256) trained
   ``STEPS`` steps of 4,096 tokens on the bundled corpus with its learning-rate schedule shortened to
   match (warm-up 30, cosine to 10%), in one ``raysc train`` (Ray, one 2-core worker; measured:
   742 s of training, 760 s in all, while a pip build shared the 2 cores; 2026-12-02: 1,811 s with a
   restart, beside the test suite). Cached in ``.cache/quantize-bench/small``: a rerun that finds its final checkpoint
   skips training. Why that is enough to be worth quantizing: the perplexity is far below the
   unigram perplexity of the same held-out tokens (``unigram_perplexity``; measured 84.7 vs 874),
   so the weights encode learned structure that rounding can destroy, not initial noise. The table
   also prints the held-out loss at 1/3, 2/3 and all of the steps (``train_curve``): the run is
   still learning (perplexity 214, 109, 84.7), far from converged, which a 2-core CPU cannot afford.
2. Hugging Face folders: fp32 and bf16 (``raysc export``'s writer) and ``raysc quantize`` int8,
   rtn4, gptq and awq (4-bit in groups of ``GROUP``: the 704 MLP width takes 64, not 128),
   16,384 calibration tokens of the training split, perplexity on the same ``EVAL_TOKENS``
   validation tokens for all (torch; 4-bit from the dequantized weights, int8 with int8
   activations as W8A8 runs). Decode tokens/s by vLLM (CPU build) where it runs the folder:
   fp32, bf16, int8 here; 4-bit W4A16 needs an AVX-512 CPU (``raysc.quantize.vllm_check``),
   so those rows say so unless this CPU has it.
3. GGUF files run by llama.cpp (``llama-cpp-python``): F32, Q8_0, Q4_0 (raysc's writer), Q4_0 with
   GPTQ's rounding (``--method gptq``), and llama.cpp's own Q4_0 of the F32 file
   (``llama_model_quantize``): perplexity on the same validation tokens, decode tokens/s.

Decode tokens/s: one sequence at a time, greedy, ``DECODE_TOKENS`` new tokens after a short prompt,
end-of-sequence ignored, one thread (the cores vLLM's CPU engine binds on this 2-core machine, and
llama.cpp's ``n_threads=1``), median of ``--reps`` runs. Orderings the issue states are checked and
reported (``orderings``), not asserted. Each measured row is kept in ``.cache/quantize-bench/rows.json``
as it is measured, so a rerun (after an interruption) measures only what is missing; ``--fresh``
measures all again. Prints a markdown table, then JSON on its last line. Run it under
``flock /tmp/raysc-ray.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CACHE = ROOT / ".cache" / "quantize-bench"
STEPS = 300
TRAIN = [
    "train.global_batch_tokens=4096",
    f"train.steps={STEPS}",
    "schedule.warmup_steps=30",
    f"checkpoint.every_steps={STEPS // 3}",
    "checkpoint.keep_last=3",
    "train.log_every=50",
    f'run.dir="{CACHE / "small"}"',
]
GROUP = 64
EVAL_TOKENS = 16384
CALIB_TOKENS = 16384
DECODE_TOKENS = 128
PROMPT = "def main():\n    "


def trained_run() -> Path:
    """The small run, trained unless its final checkpoint is already there."""
    from raysc.export.restore import run_store

    run = CACHE / "small"
    if (run / "config.toml").is_file() and STEPS in run_store(run)[1]:
        return run
    cmd = [
        sys.executable,
        "-m",
        "raysc.cli",
        "train",
        str(ROOT / "jobs/configs/small.toml"),
        "--no-progress",
        "--overwrite",
        *[a for o in TRAIN for a in ("--set", o)],
    ]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    print(f"trained {STEPS} steps in {time.perf_counter() - start:.0f} s", flush=True)
    return run


def vllm_decode(folder: str, reps: int) -> dict:
    """(in a child process) vLLM's decode tokens/s on ``folder``: median of ``reps`` single-sequence runs."""
    from common import exported_dtype
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, enforce_eager=True, dtype=exported_dtype(folder), max_model_len=256, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        out = llm.generate([PROMPT], params)
        rates.append(len(out[0].outputs[0].token_ids) / (time.perf_counter() - start))
    try:
        dtype = str(llm.llm_engine.vllm_config.model_config.dtype)
    except AttributeError:
        dtype = "?"
    return {"decode_tok_s": statistics.median(rates), "runs": rates, "vllm_dtype": dtype}


def vllm_row(folder: Path, reps: int) -> dict:
    from common import run_vllm_child

    got = run_vllm_child(__file__, ["--vllm-child", str(folder), "--reps", str(reps)], timeout=600)
    return {"decode_error": got["error"].splitlines()[-1][:300]} if "error" in got else got


def llama_cpp_row(path: Path, rows, reps: int) -> dict:
    """llama.cpp's perplexity of ``path`` on ``rows`` and its decode tokens/s."""
    import llama_cpp
    import numpy as np
    import torch
    import torch.nn.functional as F

    seq = rows.shape[1] - 1
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(seq, DECODE_TOKENS + 16),
        n_batch=seq,
        n_threads=1,
        logits_all=True,
        seed=0,
        verbose=False,
    )
    try:
        nll = 0.0
        for row in rows.numpy():
            llm.reset()
            llm.eval(row[:-1].tolist())
            logits = torch.from_numpy(np.array(llm.scores[:seq], dtype=np.float32))
            nll += F.cross_entropy(logits, torch.from_numpy(row[1:].astype(np.int64)), reduction="sum").item()
        prompt = llm.tokenize(PROMPT.encode(), add_bos=False)
        rates = []
        for _ in range(reps):
            llm.reset()
            start = time.perf_counter()
            llm.eval(prompt)
            for _ in range(DECODE_TOKENS):
                llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
            rates.append(DECODE_TOKENS / (time.perf_counter() - start))
    finally:
        llm.close()
    return {
        "perplexity": math.exp(nll / rows[:, 1:].numel()),
        "decode_tok_s": statistics.median(rates),
        "runs": rates,
        "bytes": path.stat().st_size,
    }


def held_out_loss(run: Path, step: int, rows) -> float:
    from raysc.export.restore import load_run
    from raysc.quantize.quality import perplexity
    from raysc.quantize.run import plain_model

    return math.log(perplexity(plain_model(load_run(run, step).model), rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--train-only", action="store_true", help="train (or find) the cached run and stop")
    ap.add_argument("--fresh", action="store_true", help="measure every row again (default: reuse rows.json's)")
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train_only:
        print(json.dumps({"run": str(trained_run())}))
        return
    if args.vllm_child:
        print(json.dumps(vllm_decode(args.vllm_child, args.reps)), flush=True)
        return
    import numpy as np
    import torch

    from raysc.data.prepare import prepare_data
    from raysc.export.gguf import export_gguf
    from raysc.export.hf import export_hf
    from raysc.export.restore import load_run
    from raysc.quantize.calibration import heldout_rows, train_rows
    from raysc.quantize.gguf_gptq import export_gguf_gptq
    from raysc.quantize.quality import perplexity
    from raysc.quantize.run import plain_model, quantize_run
    from raysc.quantize.vllm_check import w4a16_supported
    from raysc.quantize.writer import file_bytes

    torch.set_num_threads(2)
    run_dir = trained_run()
    run = load_run(run_dir, STEPS)
    packed, _, _ = prepare_data(run.cfg)
    rows = heldout_rows(packed, -(-EVAL_TOKENS // packed.seq_len))
    params = sum(p.numel() for p in run.model.parameters())
    counts = np.bincount(train_rows(packed).reshape(-1), minlength=run.cfg.model.vocab_size) + 1.0
    unigram = math.exp(-float(np.log(counts / counts.sum())[rows[:, 1:].numpy()].mean()))
    done_path = CACHE / "rows.json"  # rows measured on this run by an earlier, interrupted invocation
    done = {} if args.fresh or not done_path.is_file() else json.loads(done_path.read_text())

    def cached(key: str, measure) -> dict:
        if key not in done:
            done[key] = measure()
            done_path.write_text(json.dumps(done, indent=1))
        return done[key]

    curve = {
        s: cached(f"curve:{s}", lambda s=s: {"val_loss": held_out_loss(run_dir, s, rows)})["val_loss"]
        for s in (STEPS // 3, 2 * STEPS // 3, STEPS)
    }
    out = CACHE / "out"
    table: dict[str, dict] = {}

    def export(name: str, dtype) -> dict:
        folder = export_hf(run.model, run.tokenizer_path, out / name, dtype)
        return {
            "perplexity": perplexity(plain_model(run.model).to(dtype), rows),
            "bytes": file_bytes(folder),
            "folder": str(folder),
        }

    def quantize(method: str) -> dict:
        folder = out / method
        if folder.exists():
            shutil.rmtree(folder)
        start = time.perf_counter()
        man = quantize_run(
            run_dir,
            method,
            group_size=GROUP,
            calib_tokens=CALIB_TOKENS,
            eval_tokens=EVAL_TOKENS,
            out=folder,
            step=STEPS,
        )
        ratio = sum(v["error"] for v in man["layers"].values()) / sum(v["rtn_error"] for v in man["layers"].values())
        return {
            "perplexity": man["quality"]["perplexity_after"],
            "bytes": man["bytes"],
            "folder": str(folder),
            "error_vs_rtn": ratio,
            "quantize_s": time.perf_counter() - start,
        }

    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        table[name] = dict(cached(name, lambda name=name, dtype=dtype: export(name, dtype)))
    for method in ("int8", "rtn4", "gptq", "awq"):
        table[method] = dict(cached(method, lambda method=method: quantize(method)))
    four_bit_runs = w4a16_supported()
    for name, row in table.items():
        if name in ("rtn4", "gptq", "awq") and not four_bit_runs:
            row["decode_error"] = "vLLM's CPU W4A16 kernel needs AVX-512; this CPU has AVX2 only"
        else:
            row.update(cached(f"vllm:{name}", lambda row=row: vllm_row(Path(row["folder"]), args.reps)))
    import llama_cpp

    files = {t: out / f"model-{t}.gguf" for t in ("f32", "q8_0", "q4_0", "q4_0-gptq", "q4_0-llama.cpp")}
    if any(f"gguf:{t}" not in done for t in files):
        for t in ("f32", "q8_0", "q4_0"):
            export_gguf(run.model, run.tokenizer_path, files[t], t)
        export_gguf_gptq(run, files["q4_0-gptq"], CALIB_TOKENS)
        qp = llama_cpp.llama_model_quantize_default_params()
        qp.ftype, qp.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, 2
        assert (
            llama_cpp.llama_model_quantize(str(files["f32"]).encode(), str(files["q4_0-llama.cpp"]).encode(), qp) == 0
        )
    gguf = {t: cached(f"gguf:{t}", lambda path=path: llama_cpp_row(path, rows, args.reps)) for t, path in files.items()}
    report(table, gguf, params, unigram, curve, rows)


def report(table: dict, gguf: dict, params: int, unigram: float, curve: dict, rows) -> None:
    fp32 = table["fp32"]["perplexity"]
    print("\n| format | perplexity | vs fp32 | bytes/param | file bytes | decode tok/s |\n|---|---|---|---|---|---|")
    for name, r in [*table.items(), *((f"GGUF {k}", v) for k, v in gguf.items())]:
        speed = f"{r['decode_tok_s']:.0f}" if "decode_tok_s" in r else r.get("decode_error", "")
        print(
            f"| {name} | {r['perplexity']:.3f} | {r['perplexity'] / fp32 - 1:+.2%} | {r['bytes'] / params:.2f} | "
            f"{r['bytes']:,} | {speed} |"
        )
    ppl = {k: v["perplexity"] for k, v in table.items()}
    g = {k: v["perplexity"] for k, v in gguf.items()}
    orderings = {
        "rtn4 > gptq": ppl["rtn4"] > ppl["gptq"],
        "rtn4 > awq": ppl["rtn4"] > ppl["awq"],
        "gptq > fp32": ppl["gptq"] > ppl["fp32"],
        "awq > fp32": ppl["awq"] > ppl["fp32"],
        "int8 within 1% of fp32": abs(ppl["int8"] / ppl["fp32"] - 1) < 0.01,
        "GGUF q8_0 within 1% of f32": abs(g["q8_0"] / g["f32"] - 1) < 0.01,
        "GGUF q4_0-gptq < llama.cpp q4_0": g["q4_0-gptq"] < g["q4_0-llama.cpp"],
    }
    print(
        json.dumps(
            {
                "parameters": params,
                "eval_tokens": int(rows[:, 1:].numel()),
                "unigram_perplexity": unigram,
                "train_curve": {str(k): {"val_loss": v, "perplexity": math.exp(v)} for k, v in curve.items()},
                "hf": table,
                "gguf": gguf,
                "orderings": orderings,
            }
        )
    )


if __name__ == "__main__":
    main()
