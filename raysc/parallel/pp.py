"""Pipeline parallelism through ``torch.distributed.pipelining``.

The layer stack is split into ``pp × virtual_stages`` stages balanced by layer
count; the embedding lives on the first stage, the final norm and output
projection on the last. Rank ``r`` of the pipeline holds stages
``r, r + pp, r + 2·pp, …`` (the "loop" placement the interleaved schedules
expect). Layer names keep their global index (``layers.7``), so checkpoints are
independent of the split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from raysc.config.dims import MULTI_STAGE, PP_SCHEDULES


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    return [pp_rank + k * pp for k in range(virtual)]


def split_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of ``model`` holding only the layers (and ends) of ``stage``."""
    n = len(model.layers)
    per = n // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    chunk = copy.deepcopy(model)
    for name in list(chunk.layers):
        if name not in keep:
            del chunk.layers[name]
    if stage != 0:
        chunk.embed = None
    if stage != num_stages - 1:
        chunk.norm = None
        chunk.output = None
    return chunk


def build_stages(model: nn.Module, pp_rank: int, pp: int, virtual: int) -> tuple[list[nn.Module], list[int]]:
    ids = stage_ids(pp_rank, pp, virtual)
    return [split_stage(model, s, pp * virtual) for s in ids], ids


def build_schedule(
    chunks: list[nn.Module],
    ids: list[int],
    num_stages: int,
    schedule: str,
    microbatches: int,
    loss_fn: Callable,
    device: torch.device,
    pp_group,
):
    # imported here, not at the top: torch.distributed.pipelining loads TorchDynamo (about 1 s of CPU
    # per process), which every worker, supervisor and driver would pay on runs without pipelining
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    stages = [
        PipelineStage(chunk, stage_index=s, num_stages=num_stages, device=device, group=pp_group)
        for chunk, s in zip(chunks, ids)
    ]
    cls = getattr(torch_schedules, PP_SCHEDULES[schedule].torch_class)
    if schedule in MULTI_STAGE:
        return cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
