"""Tensor and sequence parallelism for the Llama model through DTensor plans.

Megatron-style: ``wq/wk/wv`` and ``w_gate/w_up`` column-parallel, ``wo`` and
``w_down`` row-parallel, so each block needs one all-reduce (or, with sequence
parallelism, one all-gather + one reduce-scatter) per sub-layer. The embedding is
vocab-parallel (row-wise over the vocabulary), the output projection
column-parallel over the vocabulary with its logits left sharded for
``loss_parallel`` (cross-entropy without gathering the logits). With sequence
parallelism the norms work on sequence shards and the residual stream stays
sharded along the sequence between blocks.

A mixture-of-experts block (``raysc.model.moe``) takes its whole input on every TP rank (gathered
first under sequence parallelism, and its output cut back to this rank's part of the sequence); its
router is replicated, its shared experts are a column- then row-parallel MLP like the dense one, and
its routed experts are split by hidden dim from outside (``raysc.parallel.expert_parallel``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from raysc.model.moe import MoEFeedForward


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard ``model`` (a full model or a pipeline stage of it) over ``tp_mesh`` in place."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root: dict = {}
    if model.embed is not None:
        root["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if root:
        parallelize_module(model, tp_mesh, root)

    for block in model.layers.values():
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
        }
        moe = isinstance(block.mlp, MoEFeedForward)
        if not moe:
            plan.update(
                {
                    "mlp.w_gate": ColwiseParallel(),
                    "mlp.w_up": ColwiseParallel(),
                    "mlp.w_down": RowwiseParallel(output_layouts=seq),
                }
            )
        elif block.mlp.shared is not None:
            plan.update(
                {
                    "mlp.shared.w_gate": ColwiseParallel(),
                    "mlp.shared.w_up": ColwiseParallel(),
                    "mlp.shared.w_down": RowwiseParallel(),
                }
            )
        if block.attn.q_norm is not None:
            # Qwen3's q/k norms see the local heads (dim 2 of (batch, seq, heads, head_dim)): sharding their
            # input over the heads makes DTensor sum the replicated weights' gradients over the TP group
            plan.update(
                {
                    "attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                    "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                }
            )
        if sequence_parallel:
            plan.update(
                {
                    "attn_norm": SequenceParallel(),
                    "attn": PrepareModuleInput(
                        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                    ),
                    "mlp_norm": SequenceParallel(),
                    "mlp": (
                        PrepareModuleInputOutput(
                            input_layouts=(Shard(1),),
                            desired_input_layouts=(Replicate(),),
                            use_local_input=True,
                            output_layouts=(Replicate(),),
                            desired_output_layouts=(Shard(1),),
                        )
                        if moe
                        else PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                    ),
                }
            )
        parallelize_module(block, tp_mesh, plan)
