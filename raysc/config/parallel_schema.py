"""The ``[parallel]`` section: the layout of a run's workers (DP, FSDP, TP, PP, CP degrees, the
pipeline schedule, what each worker reserves) and whether its data-parallel size may change with the
cluster (``elastic``; ``raysc.fleet.elastic``, docs/resilience.md)."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.dims import PP_SCHEDULES, ParallelDims
from raysc.config.options import opt

ELASTIC_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class ParallelConfig:
    device: str = opt("cpu", "cpu (gloo) or cuda (NCCL, one GPU per worker)", choices=["cpu", "cuda"])
    dp_replicate: int = opt(1, "replicated data-parallel degree", min=1)
    dp_shard: int = opt(1, "sharded (FSDP) data-parallel degree", min=1)
    tp: int = opt(1, "tensor-parallel degree", min=1)
    pp: int = opt(1, "pipeline-parallel degree", min=1)
    cp: int = opt(1, "context-parallel degree", min=1)
    ep: int = opt(
        1,
        "expert-parallel degree (a mixture of experts): each group of ep consecutive dp_shard ranks "
        "splits the routed experts between them and sends every token to its experts' ranks by "
        "all-to-all; carved from dp_shard (ep divides dp_shard and model.moe_experts), so it adds no rank",
        min=1,
    )
    sequence_parallel: bool = opt(False, "shard norms and activations along the sequence inside TP groups")
    recompute: str = opt(
        "none",
        "activation recomputation: none, or full (each block keeps only its input and "
        "recomputes its forward in backward: ~+33% FLOPs, far less activation memory)",
        choices=["none", "full"],
    )
    pp_schedule: str = opt("1f1b", "pipeline schedule", choices=list(PP_SCHEDULES))
    pp_microbatches: int = opt(0, "microbatches per pipeline step; 0 = pp", min=0)
    pp_virtual_stages: int = opt(1, "model chunks per pipeline rank (interleaved schedules)", min=1)
    cpus_per_worker: float = opt(1.0, "CPU cores reserved for each worker actor (its torch thread count)", gt=0.0)
    tp_within_node: bool = opt(
        False,
        "require every tensor/context-parallel group (tp×cp consecutive ranks) to fit "
        "on one node: a layout that cannot fails before step 1, naming the node "
        "sizes (false: it runs, with a layout_warning)",
    )
    elastic: bool = opt(
        False,
        "let the data-parallel size follow the cluster: start with the largest size in "
        "[min_dp, the configured one] that the cluster can place, shrink when a lost node "
        "is not replaced within supervisor.node_wait_s, grow back at the next checkpoint "
        "once there is room; the global batch, learning-rate schedule and data order stay "
        "the run's own (gradient accumulation makes up the difference)",
    )
    elastic_dim: str = opt(
        "dp_replicate",
        "the data-parallel degree an elastic run may change (TP, PP and CP never do)",
        choices=list(ELASTIC_DIMS),
    )
    min_dp: int = opt(
        1,
        "the smallest size of parallel.elastic_dim an elastic run continues at (below it, it "
        "waits for nodes as a fixed run does)",
        min=1,
    )

    @property
    def dims(self) -> ParallelDims:
        """The degrees as the layout authority (``world_size``, ``dp``, coordinates)."""
        return ParallelDims.of(self)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    def micro_batch(self, global_batch_sequences: int, train_micro_batch: int) -> int:
        """Sequences per forward pass on one rank: the pipeline's microbatch under PP, else
        ``train.micro_batch`` (0: the whole local batch). The one rule the planner's ``Layout`` and an
        elastic run's size checks share."""
        local = global_batch_sequences // self.dp
        if self.pp > 1:
            return max(1, local // (self.pp_microbatches or self.pp))
        return train_micro_batch or local
