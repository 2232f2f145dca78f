"""Step time of a layout: compute, TP/CP/DP communication and the pipeline bubble.

- Compute: FLOPs per token (``raysc.model.flops``: 6·N + attention; full recomputation adds
  one more forward, 2·N + the attention forward) × tokens per GPU ÷ (peak × efficiency).
- Tensor parallelism: per block and micro-batch, two all-reduces forward and two backward of
  the ``s·b·h`` activations (reduce-scatter + all-gather under sequence parallelism: the same
  bytes), each moving ``2(t−1)/t`` of the buffer (ring all-reduce, as nccl-tests' bus bandwidth
  counts it), on the intra-node links when the TP group fits in a node, else inter-node.
  Exposed: TP collectives sit on the critical path between matmuls.
- Context parallelism: ring attention passes K and V around the ``cp`` ring, forward and
  twice backward; assumed half hidden behind the attention compute.
- Data parallelism: the gradient all-reduce (fp32, ``2(d−1)/d``) or, with FSDP, a reduce-scatter
  of gradients plus two all-gathers of bf16 weights (forward and backward); overlapped with the
  backward pass (two thirds of the compute), only the excess is exposed.
- Expert parallelism: per MoE layer and micro-batch, four all-to-alls (dispatch and combine,
  forward and backward; six with full recomputation) of the ``s·b·k`` routed rows of ``h``
  values, ``(ep−1)/ep`` of them leaving the rank, over the links of the EP group (``tp·cp·ep``
  consecutive ranks); exposed, as TP's. FSDP then gathers and reduces the routed experts over
  ``dp_shard·cp/ep`` ranks instead of ``dp_shard·cp``.
- Pipeline: bubble ``(p−1)/(m+p−1)`` for GPipe and 1F1B, divided by ``v`` for interleaved
  1F1B, and a third of the 1F1B bubble for zero-bubble schedules (Qi et al. 2023, ZB-H1);
  stage-to-stage sends of ``s·b·h`` per micro-batch.
"""

from __future__ import annotations

from raysc.config.schema import ModelConfig
from raysc.model.flops import flops_per_token, param_count
from raysc.plan.layout import Cluster, Layout


def bubble_fraction(lay: Layout, microbatches: int) -> float:
    p = lay.pp
    if p == 1:
        return 0.0
    base = (p - 1) / (microbatches + p - 1)
    if lay.pp_schedule == "interleaved_1f1b":
        return (p - 1) / (lay.pp_virtual_stages * microbatches + p - 1)
    if lay.pp_schedule == "interleaved_zero_bubble":
        return base / 3
    return base


def _bw(group_span: int, cluster: Cluster) -> float:
    """Bytes/s of a group whose ranks span ``group_span`` consecutive ranks."""
    inside = group_span <= cluster.gpus_per_node
    return (cluster.intra_gbps if inside else cluster.inter_gbps) * 1e9


def estimate_step(
    m: ModelConfig, seq_len: int, global_batch: int, lay: Layout, cluster: Cluster, dtype: str = "bf16"
) -> dict:
    """Seconds per optimizer step and its parts; tokens/s and MFU of the whole cluster."""
    act = 2 if dtype == "bf16" else 4
    n = lay.world_size
    tokens = global_batch * seq_len
    fpt = flops_per_token(m, seq_len)
    model_flops = tokens * fpt
    work = model_flops
    if lay.recompute == "full":
        work += model_flops / 3  # one more forward
    compute = work / (n * cluster.peak_tflops * 1e12 * cluster.efficiency)
    micro = lay.microbatches(global_batch)
    s = seq_len // lay.cp
    layers_per_stage = m.n_layers / lay.pp
    sbh_bytes = s * lay.micro_batch * m.dim * act
    tp_comm = 0.0
    if lay.tp > 1:
        per_op = 2 * (lay.tp - 1) / lay.tp * sbh_bytes / _bw(lay.tp, cluster)
        tp_comm = 4 * layers_per_stage * micro * per_op
        # an MoE layer's routed experts sum k rows per token over the TP group, forward and backward,
        # where a dense MLP sums one
        tp_comm += 2 * (m.moe_top_k - 1) * len(m.moe_layers) / lay.pp * micro * per_op
    cp_comm = 0.0
    if lay.cp > 1:
        kv = 2 * s * lay.micro_batch * m.n_kv_heads * m.head_dim * act / lay.tp
        cp_comm = 0.5 * 3 * (lay.cp - 1) * kv * layers_per_stage * micro / _bw(lay.tp * lay.cp, cluster)
    ep_comm = 0.0
    n_moe = len(m.moe_layers) / lay.pp
    if lay.ep > 1 and n_moe:
        rows = s * lay.micro_batch * m.moe_top_k * m.dim * act * (lay.ep - 1) / lay.ep
        exchanges = 6 if lay.recompute == "full" else 4
        ep_comm = n_moe * micro * exchanges * rows / _bw(lay.tp * lay.cp * lay.ep, cluster)
    pc = param_count(m)
    local_params = pc["total"] / (lay.tp * lay.pp)
    experts = pc["routed_experts"] / (lay.tp * lay.pp)
    dp_comm = 0.0
    fs = lay.dp_shard * lay.cp
    if fs > 1:  # FSDP over dp_shard × cp: reduce-scatter fp32 grads, all-gather bf16 weights twice
        span = lay.tp * fs
        efs = fs // lay.ep  # the routed experts: over the ranks of the other EP groups
        dense = (local_params - experts) * (fs - 1) / fs
        dp_comm += (dense + experts * (efs - 1) / efs) * (4 + 2 * act) / _bw(span, cluster)
    if lay.dp_replicate > 1:
        span = lay.tp * fs * lay.dp_replicate
        dp_comm += 2 * (lay.dp_replicate - 1) / lay.dp_replicate * local_params / fs * 4 / _bw(span, cluster)
    exposed_dp = max(0.0, dp_comm - 2 / 3 * compute)
    pp_comm = 0.0
    if lay.pp > 1:
        pp_comm = (
            2 * micro * sbh_bytes / (lay.tp if lay.sequence_parallel else 1) / _bw(n, cluster)
        )  # stages sit in different nodes once the cluster has several
    bubble = bubble_fraction(lay, micro)
    busy = compute + tp_comm + cp_comm + pp_comm + ep_comm
    step = busy / (1 - bubble) + exposed_dp
    tps = tokens / step
    mfu = model_flops / step / (n * cluster.peak_tflops * 1e12)
    return {
        "step_s": step,
        "compute_s": compute,
        "tp_comm_s": tp_comm,
        "cp_comm_s": cp_comm,
        "dp_comm_s": dp_comm,
        "dp_exposed_s": exposed_dp,
        "pp_comm_s": pp_comm,
        "ep_comm_s": ep_comm,
        "bubble": bubble,
        "tokens_per_s": tps,
        "mfu": mfu,
    }
