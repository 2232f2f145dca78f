"""A candidate parallel layout and the cluster it runs on: the planner's two inputs.

``Layout`` holds every knob the planner varies (the ``[parallel]`` degrees, sequence
parallelism, the pipeline schedule, the micro-batch and recomputation) and turns into the
``--set`` overrides and the TOML fragment that run it. ``Cluster`` holds what the planner
assumes about the hardware; defaults are an H100 SXM node (989 dense bf16 TFLOP/s, 80 GB,
NVLink ~450 GB/s per direction, 8 × 400 Gb/s InfiniBand = 50 GB/s per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from raysc.config.dims import DIM_NAMES, ParallelDims


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    intra_gbps: float = 450.0  # GB/s per GPU inside a node (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU between nodes
    peak_tflops: float = 989.0  # dense bf16 per GPU
    efficiency: float = 0.5  # achieved share of peak in the matmuls (calibrated by --profile)
    headroom: float = 0.1  # share of memory left free (fragmentation, spikes)
    overhead_gb: float = 3.0  # CUDA context, NCCL buffers, allocator slack per GPU
    device: str = "cuda"

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"--gpus {self.gpus} and --gpus-per-node {self.gpus_per_node} must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus {self.gpus} is not a whole number of nodes of --gpus-per-node {self.gpus_per_node}"
            )

    @property
    def usable_bytes(self) -> float:
        return self.gpu_mem_gb * 1e9 * (1 - self.headroom) - self.overhead_gb * 1e9


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert-parallel groups carved from dp_shard (a mixture of experts)
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    micro_batch: int = 1  # sequences per forward pass on one rank
    recompute: str = "none"

    @classmethod
    def from_config(cls, cfg) -> Layout:
        """The layout a config runs (its micro-batch: train.micro_batch, or the pipeline's)."""
        par, t = cfg.parallel, cfg.train
        micro = par.micro_batch(t.global_batch_sequences, t.micro_batch)
        return cls(
            **par.dims.as_dict(),
            ep=par.ep,
            sequence_parallel=par.sequence_parallel,
            pp_schedule=par.pp_schedule,
            pp_virtual_stages=par.pp_virtual_stages,
            micro_batch=micro,
            recompute=par.recompute,
        )

    @property
    def dims(self) -> ParallelDims:
        """The parallel degrees of this layout (the authority for ``world_size`` and ``dp``)."""
        return ParallelDims.of(self)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return max(1, global_batch // self.dp // self.micro_batch)

    def overrides(self, global_batch: int) -> list[str]:
        """``--set`` overrides that run this layout (with ``train.global_batch`` sequences)."""
        out = [
            f"parallel.{f.name}={_value(getattr(self, f.name))}" for f in fields(self) if f.name not in ("micro_batch",)
        ]
        if self.pp > 1:
            out.append(f"parallel.pp_microbatches={self.microbatches(global_batch)}")
            out.append("train.micro_batch=0")
        else:
            out.append(f"train.micro_batch={self.micro_batch}")
        return out

    def fragment(self, global_batch: int) -> str:
        """The ``[parallel]`` (and ``[train]``) TOML that runs this layout."""
        par, train = [], []
        for item in self.overrides(global_batch):
            key, value = item.split("=", 1)
            section, name = key.split(".")
            (par if section == "parallel" else train).append(f"{name} = {value}")
        return "[parallel]\n" + "\n".join(par) + "\n\n[train]\n" + "\n".join(train) + "\n"

    def describe(self) -> str:
        parts = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if (f.name in DIM_NAMES or f.name == "ep") and getattr(self, f.name) > 1
        ]  # in field order
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.pp_schedule + (f"×{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""))
        parts.append(f"mb={self.micro_batch}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        return ",".join(parts)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)
