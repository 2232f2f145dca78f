"""Peak FLOP/s of a device and model FLOPs utilisation (MFU).

GPUs use their published dense bf16 peak (table below). CPUs have no useful
published figure, so the peak is measured: the best of a few fp32 matmuls at the
worker's thread count. MFU on CPU therefore reads "share of achievable matmul
throughput"; ``train.peak_flops`` overrides either.
"""

from __future__ import annotations

import time

import torch

# dense bf16 tensor-core peaks, FLOP/s
GPU_PEAK_BF16 = {
    "H200": 989e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12, "B200": 2250e12,
    "A100": 312e12, "A800": 312e12, "A10G": 125e12, "L40S": 362e12, "L4": 121e12, "V100": 125e12,
}


def measure_cpu_peak(size: int = 512, repeats: int = 5) -> float:
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, override: float = 0.0) -> float:
    if override:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAK_BF16.items():
            if key in name:
                return peak
        return 312e12  # unknown GPU: assume A100-class and say so in the docs
    return measure_cpu_peak()
