"""One GPU's figures: the environment, ``make test-gpu``, and MFU, tokens/s and peak memory of
``jobs/configs/llama-1b.toml`` in bf16 against the planner's estimate. Run by ``benchmarks/gpu.sh``.

Without CUDA it does no GPU work: it prints the environment, the planner's figures for the config
(parameters, FLOPs/token, estimated peak memory: pure arithmetic) and ``"gpu": null`` with a note,
and exits 0.

With CUDA, two parts, each in a child process with a time limit (together under 8 minutes):

1. MFU: the config's model (Llama-3.2-1B-shaped, 1.04 B parameters; seq 2048, 128 sequences per
   step in micro-batches of 8, bf16 autocast over fp32 master weights, AdamW) trained on the
   bundled corpus by ``raysc.train.trainer.Trainer`` — the object a ``TrainWorker`` runs — in the
   child process, world size 1 (the supervisor/NCCL path is covered by ``make test-gpu``; the actor
   path costs ~2 % over this loop, benchmarks/train_overhead.py). Each step is timed between
   ``torch.cuda.synchronize()`` calls; tokens/s is tokens per step over the median step time after
   ``WARMUP`` steps, MFU is tokens/s × FLOPs/token (6·N + 12·L·H·Q·T, ``raysc.model.flops``) over the
   GPU's dense bf16 peak (``raysc.train.throughput``). Peak memory: the CUDA caching allocator's
   maximum in each step (``raysc.train.memory.PeakMemory``, the median over steps) against
   ``raysc.plan.memory.estimate_memory`` for the same layout. The child writes its figures after
   every step, so a run cut by the time limit still reports the steps it finished.
2. ``make test-gpu`` (with ``PYTHON`` set: ``$PYTHON -m pytest -m gpu``): its pytest counts.

The last line printed is one JSON object. Environment: BENCH_STEPS (default 10 steps),
BENCH_MFU_TIMEOUT_S (270), BENCH_TESTS_TIMEOUT_S (180), BENCH_CONFIG (jobs/configs/llama-1b.toml).
The config compiles its blocks (``train.compile = true``); ``--set train.compile=false`` measures eager.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = os.environ.get("BENCH_CONFIG", str(ROOT / "jobs/configs/llama-1b.toml"))
STEPS = int(os.environ.get("BENCH_STEPS", "10"))
WARMUP = 2  # steps left out of the timing: CUDA/cuBLAS start-up, AdamW state allocation
MFU_TIMEOUT_S = float(os.environ.get("BENCH_MFU_TIMEOUT_S", "270"))
TESTS_TIMEOUT_S = float(os.environ.get("BENCH_TESTS_TIMEOUT_S", "180"))
MFU_TARGET = 0.5  # issue 14, on an H100/H200-class GPU


def environment() -> dict:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    return env


def planner(config: str, overrides: list[str]) -> dict:
    """The config's size and the planner's memory estimate for its own layout (no device needed)."""
    from raysc.config import load_config
    from raysc.model.flops import flops_per_token, param_count
    from raysc.plan.layout import Layout
    from raysc.plan.memory import estimate_memory

    cfg = load_config(config, overrides)
    lay = Layout.from_config(cfg)
    dtype = cfg.compute_dtype
    est = estimate_memory(cfg.model, cfg.train.seq_len, cfg.train.global_batch_sequences, lay, dtype)
    return {
        "config": os.path.relpath(config, ROOT),
        "params": param_count(cfg.model)["total"],
        "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len),
        "layout": lay.describe(),
        "dtype": dtype,
        "tokens_per_step": cfg.train.global_batch_sequences * cfg.train.seq_len,
        "memory_estimate_gb": round(est["total"] / 1e9, 3),
        "memory_estimate_breakdown_gb": {
            k: round(est[k] / 1e9, 3)
            for k in ("weights", "grads", "optimizer", "unsharded", "activations", "loss_head")
        },
    }


# ---- the child: train the config for a few steps and write its figures ----
def measure(config: str, overrides: list[str], steps: int, out: Path) -> None:
    import torch

    from raysc.config import load_config
    from raysc.data.prepare import prepare_data
    from raysc.train.memory import PeakMemory
    from raysc.train.trainer import Trainer

    result: dict = {"steps_done": 0}

    def write() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)

    try:
        t0 = time.perf_counter()
        cfg = load_config(config, overrides)
        packed, _, _ = prepare_data(cfg)
        result["data_s"] = round(time.perf_counter() - t0, 1)
        result["train_sequences"] = int(len(packed.train))
        t0 = time.perf_counter()
        trainer = Trainer(cfg, packed.train)
        result["compiled"] = cfg.train.compile
        memory = PeakMemory(trainer.model_parts, trainer.optimizer, trainer.device)
        result["model_s"] = round(time.perf_counter() - t0, 1)
        result.update(
            device=str(trainer.device),
            peak_flops=trainer.peak_flops,
            flops_per_token=trainer.flops_per_token,
            tokens_per_step=trainer.tokens_per_step,
        )
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        times, losses = [], []
        write()
        for _ in range(steps):
            memory.before_step()
            sync()
            t0 = time.perf_counter()
            m = trainer.train_step()
            sync()
            times.append(time.perf_counter() - t0)
            memory.after_step()
            losses.append(round(m["loss"], 4))
            timed = times[WARMUP:] or times[-1:]
            tps = trainer.tokens_per_step / statistics.median(timed)
            result.update(
                steps_done=len(times),
                step_times_s=[round(t, 3) for t in times],
                losses=losses,
                tokens_per_s=round(tps, 1),
                mfu=round(tps * trainer.flops_per_token / trainer.peak_flops, 4),
                memory=memory.report(),
            )
            write()
        memory.close()
    except Exception as e:  # an OOM on a smaller GPU, say: reported, not a traceback instead of the JSON
        result["error"] = f"{type(e).__name__}: {e}"[:500]
        write()
        raise


def run_measure(config: str, overrides: list[str], steps: int, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="raysc-gpu-bench-")) / "measure.json"
    cmd = [sys.executable, __file__, "--measure", str(out), "--config", config, "--steps", str(steps)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        rc, tail = proc.returncode, proc.stdout.strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        rc, tail = None, [f"stopped after the {timeout:.0f} s limit"]
    got = json.loads(out.read_text()) if out.is_file() else {}
    got.update(rc=rc, wall_s=round(time.perf_counter() - t0, 1))
    if rc != 0:
        got["output_tail"] = tail
    return got


def tests_command() -> list[str]:
    """``make test-gpu``, which builds .venv from the package registries; where ``PYTHON`` names another
    interpreter (a GPU image's own CUDA torch, with the other dependencies on its path, on a machine
    that cannot reach a registry), the same selection (``pytest -m gpu``) run by that interpreter on
    tests/test_gpu.py, the module that holds them (collecting all of tests/ there stops at the modules
    whose test-only dependencies such an image lacks: moto, vllm, openai)."""
    if os.environ.get("PYTHON"):
        return [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]
    return ["make", "test-gpu"]


def run_tests(timeout: float) -> dict:
    """The GPU tests (``tests_command``): pytest's counts from its summary line."""
    cmd = tests_command()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        rc, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc = None
        text = (
            e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        ) + f"\nstopped after the {timeout:.0f} s limit"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), None)
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
    for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary or ""):
        counts["errors" if kind.startswith("error") else kind] += int(n)
    return {
        "command": " ".join(cmd),
        "rc": rc,
        **counts,
        "summary": summary or " | ".join(lines[-2:]),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--set", dest="overrides", action="append", default=[], help="a config override, KEY=VALUE")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--measure", help=argparse.SUPPRESS)  # the child's output file
    p.add_argument("--skip-tests", action="store_true", help="leave out make test-gpu")
    args = p.parse_args()
    if args.measure:
        measure(args.config, args.overrides, args.steps, Path(args.measure))
        return
    t_start = time.perf_counter()
    env = environment()
    plan = planner(args.config, args.overrides)
    out: dict = {"benchmark": "gpu", "environment": env, "gpu": env["gpu"], "planner": plan}
    if not env["cuda_available"]:
        out["note"] = (
            f"no CUDA device (torch {env['torch']}, CUDA build: {env['cuda']}): the environment and "
            f"the planner's estimate only; run benchmarks/gpu.sh on a GPU machine with a CUDA build "
            f"of torch for make test-gpu, MFU, tokens/s and measured peak memory"
        )
        out.update(tests=None, mfu=None, wall_s=round(time.perf_counter() - t_start, 1))
        print(json.dumps(out))
        return
    print(
        f"gpu: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}; training {plan['config']} for "
        f"{args.steps} steps (limit {MFU_TIMEOUT_S:.0f} s)",
        flush=True,
    )
    run = run_measure(args.config, args.overrides, args.steps, MFU_TIMEOUT_S)
    mem = run.get("memory") or {}
    peak = mem.get("peak_bytes")
    out["train"] = {
        k: run.get(k)
        for k in (
            "compiled",
            "steps_done",
            "tokens_per_s",
            "mfu",
            "step_times_s",
            "losses",
            "data_s",
            "model_s",
            "wall_s",
            "rc",
            "error",
            "output_tail",
        )
        if run.get(k) is not None
    }
    out.update(
        mfu=run.get("mfu"),
        mfu_target=MFU_TARGET,
        meets_target=None if run.get("mfu") is None else run["mfu"] >= MFU_TARGET,
        tokens_per_s=run.get("tokens_per_s"),
        peak_memory_gb=None if peak is None else round(peak / 1e9, 3),
        memory_estimate_gb=plan["memory_estimate_gb"],
        memory_measured_over_estimate=None if peak is None else round(peak / 1e9 / plan["memory_estimate_gb"], 3),
    )
    print(f"train: {json.dumps(out['train'])}", flush=True)
    if not args.skip_tests:
        print(f"{' '.join(tests_command())} (limit {TESTS_TIMEOUT_S:.0f} s)", flush=True)
        out["tests"] = run_tests(TESTS_TIMEOUT_S)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
