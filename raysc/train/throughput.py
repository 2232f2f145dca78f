"""Peak FLOP/s of a device and model FLOPs utilisation (MFU).

GPUs use their published dense bf16 peak (table below). CPUs have no useful
published figure, so the peak is measured: the best window of fp32 matmuls at the
worker's thread count. MFU on CPU therefore reads "share of achievable matmul
throughput"; ``train.peak_flops`` overrides either.

A rank measures while its neighbours start (on a 2-core laptop: other ranks importing torch, the
supervisor, Ray's own processes), so one short measurement can read 8x low and MFU then reads above
100%. The best figure seen on a machine (per CPU model and thread count) is therefore kept in the
run's cache directory (``cpu_peak.json`` beside the tokenizers and shards) and a rank uses the
larger of it and its own: the peak only moves up, toward what the machine can do.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# dense bf16 tensor-core peaks, FLOP/s
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
}


def measure_cpu_peak(size: int = 512, repeats: int = 5, min_s: float = 0.0) -> float:
    """FLOP/s of the best window of four ``size``² fp32 matmuls: at least ``repeats`` windows and
    at least ``min_s`` seconds of them (more windows, more chances of one that ran uncontended)."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    best = float("inf")
    windows, end = 0, time.perf_counter() + min_s
    while windows < repeats or time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 4)
        windows += 1
    return 2 * size**3 / best


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What a CPU peak figure is valid for: this host, its CPU model, torch's thread count."""
    return f"{platform.node()}|{_cpu_model()}|threads={torch.get_num_threads()}"


def cpu_peak(cache_file: Path | None = None) -> float:
    """This machine's CPU peak: a measurement, raised to the best one kept in ``cache_file`` for
    ``machine_key()``; a better measurement is written back. The first measurement on a machine
    takes 0.25 s of windows, later ones the minimum five (the kept figure covers a contended one)."""
    if cache_file is None:
        return measure_cpu_peak(min_s=0.25)
    key = machine_key()
    try:
        kept = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    best = float(kept.get(key, 0.0) or 0.0)
    measured = measure_cpu_peak(min_s=0.0 if best else 0.25)
    if measured > best:
        kept[key] = measured
        try:  # ranks on one node may write at once: each replaces the file whole, the last one wins
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
            tmp.write_text(json.dumps(kept, indent=1))
            tmp.replace(cache_file)
        except OSError:
            pass  # a read-only cache directory: this run's own measurement still serves
    return max(measured, best)


def device_peak_flops(device: torch.device, override: float = 0.0, cache_file: Path | None = None) -> float:
    """Peak FLOP/s of one device: ``override`` if set, a GPU's published figure, else the CPU's
    measured peak (``cpu_peak``, kept in ``cache_file``)."""
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak
        return 312e12  # unknown GPU: assume A100-class and say so in the docs
    return cpu_peak(cache_file)
