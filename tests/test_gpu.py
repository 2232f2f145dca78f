"""On a CUDA device: bf16 training, the supervisor over NCCL with exact resume, the planner's memory estimate.

Every test here is marked ``gpu``: ``make test`` deselects them (and says so in one line),
``make test-gpu`` (``pytest -m gpu``) runs them and fails at collection where torch sees no CUDA
device (tests/conftest.py). They use one GPU.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from raysc.data.prepare import prepare_data
from raysc.fleet.records import read_jsonl
from raysc.plan.layout import Layout
from raysc.plan.memory import estimate_memory
from raysc.train.memory import PeakMemory
from raysc.train.throughput import GPU_PEAK_BF16
from raysc.train.trainer import Trainer

pytestmark = pytest.mark.gpu

CUDA_BF16 = ['parallel.device="cuda"', 'train.dtype="bf16"']

# The memory check's model: big enough (~1.6-3.2 GB at the peak) that what the estimate leaves out on
# purpose (CUDA context, cuBLAS workspaces, the batch, RoPE tables: tens of MB) stays well inside the
# tolerance, small enough to run in seconds.
MEMORY_MODEL = [
    "model.vocab_size=8192",
    "model.dim=512",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "train.seq_len=1024",
    "train.global_batch=16",
    "train.micro_batch=8",
]
MEMORY_TOLERANCE = 0.25  # the same bound tests/test_plan.py holds the estimate to on CPU


@pytest.fixture(scope="module")
def ray_cuda():
    """A Ray instance whose worker processes run torch in deterministic mode (the same bits for the
    same inputs: flash attention's backward otherwise accumulates in a varying order), so that an
    interrupted and resumed run can be compared with an uninterrupted one bit for bit."""
    import ray

    if ray.is_initialized():  # another module's session instance: this one needs the setup hook
        ray.shutdown()

    def deterministic_torch() -> None:  # nested: cloudpickle ships it by value to every worker
        import torch

        torch.use_deterministic_algorithms(True)

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},  # cuBLAS's deterministic mode
            "worker_process_setup_hook": deterministic_torch,
        },
    )
    assert ray.cluster_resources().get("GPU", 0) >= 1, f"Ray sees no GPU: {ray.cluster_resources()}"
    yield ray
    ray.shutdown()


def test_tiny_model_trains_on_cuda_in_bf16(make_cfg):
    """fp32 master weights on the GPU, bf16 autocast compute, the same first loss as fp32 on CPU
    (same seed, same batch) to bf16's precision, and the loss falls on a batch it can memorise."""
    fixed = [
        "train.steps=150",
        "optim.lr=1e-2",
        "schedule.warmup_steps=10",
        'schedule.decay="constant"',
        "optim.weight_decay=0.0",
    ]
    cfg = make_cfg(*CUDA_BF16, *fixed)
    packed, _, _ = prepare_data(cfg)
    rows = packed.train[:8]  # the same 8 sequences every step
    trainer = Trainer(cfg, rows)
    assert trainer.device.type == "cuda"
    assert all(p.is_cuda and p.dtype == torch.float32 for p in trainer.params)
    with torch.no_grad(), trainer._autocast():
        logits = trainer.model(torch.from_numpy(rows[:2, :-1].astype(np.int64)).cuda())
    assert logits.dtype == torch.bfloat16
    name = torch.cuda.get_device_name(0)
    assert trainer.peak_flops == next((v for k, v in GPU_PEAK_BF16.items() if k in name), 312e12), name

    cpu = Trainer(make_cfg(*fixed, run="cpu"), rows, measure_peak=False)  # fp32 on CPU
    first_cpu = cpu.train_step()["loss"]
    metrics = [trainer.train_step() for _ in range(150)]
    losses = [m["loss"] for m in metrics]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(first_cpu, rel=2e-2), (losses[0], first_cpu)
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    assert all(0 < m["mfu"] < 1 for m in metrics[1:])


def test_supervised_nccl_run_checkpoints_and_resumes_bit_exactly(ray_cuda, make_cfg):
    """The supervisor and one TrainWorker on one GPU: an NCCL process group of world size 1, bf16,
    checkpoints; a second run resumed from the first one's step-10 checkpoint reproduces its steps
    11-20 and its final parameters bit for bit."""
    from raysc.checkpoint.store import CheckpointStore
    from raysc.export.restore import load_run
    from raysc.fleet.driver import train

    common = [*CUDA_BF16, "train.steps=20", "checkpoint.every_steps=10"]
    full = make_cfg(*common, run="full")
    summary = train(full, progress=False)
    run_dir = Path(full.run_dir)
    events = read_jsonl(run_dir / "events.jsonl")
    ready = [e for e in events if e["kind"] == "workers_ready"]
    assert ready and ready[0]["device"].startswith("cuda"), ready  # device cuda <=> backend nccl (worker.py)
    assert ready[0]["workers"] == 1
    assert CheckpointStore(full.checkpoint_uri).steps() == [10, 20]
    ref = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(ref) == list(range(1, 21))
    assert ref[20]["loss"] < ref[1]["loss"]
    assert summary["peak_memory_gb"] and summary["peak_memory_gb"][0] > 0  # always measured on CUDA
    assert summary["restarts"] == 0

    part = make_cfg(*common, run="part")
    shutil.copytree(Path(full.checkpoint_uri) / "step_00000010", Path(part.checkpoint_uri) / "step_00000010")
    resumed = train(part, resume=True, progress=False)
    got = read_jsonl(Path(part.run_dir) / "metrics.jsonl")
    assert [m["step"] for m in got] == list(range(11, 21))
    for m in got:
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert m[key] == ref[m["step"]][key], (m["step"], key, m[key], ref[m["step"]][key])
    assert resumed["steps_run"] == 10
    assert "resumed" in [e["kind"] for e in read_jsonl(Path(part.run_dir) / "events.jsonl")]
    a, b = load_run(full.run_dir).model, load_run(part.run_dir).model
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def measure_peak(cfg, steps: int = 4) -> dict:
    """The median per-step peak of ``steps`` steps (from the second: AdamW's state exists), measured
    as a TrainWorker measures it (``raysc.train.memory.PeakMemory``), less what this process held on
    the device before (tensors an earlier test left for the garbage collector)."""
    packed, _, _ = prepare_data(cfg)
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    trainer = Trainer(cfg, packed.train, measure_peak=False)
    memory = PeakMemory(trainer.model_parts, trainer.optimizer, trainer.device)
    try:
        for _ in range(steps):
            memory.before_step()
            trainer.train_step()
            memory.after_step()
        report = memory.report()
        return {**report, "peak_bytes": report["peak_bytes"] - before, "held_before": before}
    finally:
        memory.close()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_memory_estimate_matches_the_cuda_peak(make_cfg, recompute):
    """The planner's bf16 estimate of one GPU's peak (raysc/plan/memory.py) against the CUDA caching
    allocator's ``max_memory_allocated`` of the same layout, within ``MEMORY_TOLERANCE``."""
    cfg = make_cfg(*CUDA_BF16, *MEMORY_MODEL, f'parallel.recompute="{recompute}"', "train.steps=4")
    lay = Layout.from_config(cfg)
    est = estimate_memory(cfg.model, cfg.train.seq_len, cfg.train.global_batch_sequences, lay, "bf16")
    got = measure_peak(cfg)
    assert got["method"] == "cuda allocator" and got["steps"] == 4
    ratio = got["peak_bytes"] / est["total"]
    print(
        f"{lay.describe()}: estimated {est['total'] / 1e9:.3f} GB, measured {got['peak_bytes'] / 1e9:.3f} GB, "
        f"ratio {ratio:.3f}"
    )
    assert abs(ratio - 1) <= MEMORY_TOLERANCE, (lay.describe(), est, got)
