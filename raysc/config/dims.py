"""The parallel layout's one authority: the mesh dimensions, the pipeline schedules and ``ParallelDims``.

``DIM_NAMES`` is the order of the device mesh and of the rank layout: row-major over
``(pp, dp_replicate, dp_shard, cp, tp)``, so ``tp`` varies fastest (a TP group is a run of
consecutive ranks) and ``pp`` slowest. ``ParallelDims`` holds one degree per name and is the
only place that computes ``world_size``, ``dp`` and a rank's coordinates; ``ParallelConfig``
and ``plan.Layout`` hand out theirs as ``.dims``. ``PP_SCHEDULES`` names the pipeline
schedules the config accepts. Plain Python, so the config layer can use it; the mesh itself is
built in ``raysc.parallel.dims``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class PipelineSchedule(NamedTuple):
    torch_class: str  # its class in torch.distributed.pipelining.schedules
    multi_stage: bool  # each pipeline rank holds several stages (parallel.pp_virtual_stages >= 2)


PP_SCHEDULES: dict[str, PipelineSchedule] = {
    "gpipe": PipelineSchedule("ScheduleGPipe", False),
    "1f1b": PipelineSchedule("Schedule1F1B", False),
    "interleaved_1f1b": PipelineSchedule("ScheduleInterleaved1F1B", True),
    "interleaved_zero_bubble": PipelineSchedule("ScheduleInterleavedZeroBubble", True),
}
MULTI_STAGE = tuple(name for name, s in PP_SCHEDULES.items() if s.multi_stage)


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, holder: Any) -> ParallelDims:
        """The degrees of anything that carries them as attributes (``ParallelConfig``, ``plan.Layout``)."""
        return cls(**{name: getattr(holder, name) for name in DIM_NAMES})

    def as_dict(self) -> dict[str, int]:
        """Degree by dimension name, in mesh order."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.as_dict().values())

    @property
    def world_size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks that shard parameters with FSDP: dp_shard × cp (CP ranks hold the same weights)."""
        return self.dp_shard * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of ``rank`` (row-major over DIM_NAMES)."""
        out = {}
        for name, size in zip(reversed(DIM_NAMES), reversed(self.shape)):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIM_NAMES}

    def shard_of(self, rank: int) -> tuple[tuple[str, int], ...]:
        """``rank``'s coordinates but ``dp_replicate``: the ranks with the same hold replicas of its state."""
        return tuple((k, v) for k, v in self.coords(rank).items() if k != "dp_replicate")

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in self.as_dict().items() if s > 1) or "single worker"
