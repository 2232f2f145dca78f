#!/usr/bin/env bash
# One GPU's figures, for the docs: the environment (torch, CUDA, GPU), `make test-gpu`, and MFU,
# tokens/s and peak memory of jobs/configs/llama-1b.toml in bf16 against the planner's estimate.
# Under 8 minutes on one H100/H200-class GPU; the last line of output is one JSON object.
# Without CUDA it prints the environment and "gpu": null with a note, and exits 0 (no GPU work).
# The work is done by benchmarks/gpu_bench.py (its docstring says how each figure is measured).
#   PYTHON=...             the interpreter (default .venv/bin/python, the one `make test-gpu` uses)
#   BENCH_STEPS=10         training steps (the first 2 are left out of the timing)
#   BENCH_MFU_TIMEOUT_S=270, BENCH_TESTS_TIMEOUT_S=180   limits of the two parts
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ]; then PY=python3; fi
exec "$PY" benchmarks/gpu_bench.py "$@"
