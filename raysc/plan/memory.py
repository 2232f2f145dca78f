"""Per-GPU memory of a layout: weights, gradients, AdamW state, FSDP buffers and activations.

Model state (bytes per parameter held by a rank): fp32 master weights 4, fp32 gradients 4,
AdamW moments 8 — all divided by the FSDP shard size (``dp_shard × cp``, raysc's
``dp_shard_cp`` mesh) and by ``tp``; a rank holds the parameters of its pipeline stage (the
first stage also holds the embedding, the last the output head). FSDP adds unsharded copies
in the compute dtype: the root module's (embedding, head) during forward and backward, and
two blocks (current + prefetched), plus one block's unsharded fp32 gradients before the
reduce-scatter. Without FSDP, bf16 autocast caches a bf16 copy of every weight it casts.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), recounted for raysc's Llama block — measured with
``saved_tensors_hooks``, per layer and micro-batch of ``b`` sequences of ``s`` tokens:

- outside the tensor-parallel region: each of the two RMSNorms saves its input, the
  normalised value and its output, ``6·sbh`` (fp32 upcast for two of the three under bf16);
  with sequence parallelism those shrink by ``tp`` but the all-gathered linear inputs
  (``2·sbh``) stay whole, since torch saves them for the weight gradient;
- inside it (÷ tp): q, k and v (GQA's k/v repeated to every query head), the attention output
  and the out-projection input, ``5·sba`` with ``a = n_heads·head_dim`` (``h`` unless
  ``model.head_dim`` widens the heads; Qwen3's q/k norms' few saved tensors are not counted); the SwiGLU gate, its SiLU, the up projection and
  their product, ``4·sbf``. Fused attention stores no ``s×s`` scores, so Korthikanti's
  ``5as²b`` term (the one selective recomputation removes) is absent. An MoE layer saves the SwiGLU
  terms for each of a token's ``k`` routed experts and each shared one (``4·sb(k + shared)F``), its
  routed rows in and out (``2·sbkh``) and its router's fp32 logits, scores and weights (``3·sbE``);
  with MoE layers among dense ones, the mean over the layers. Expert parallelism leaves this as it is
  (a rank computes ``sbk`` routed rows on average, balanced) and shrinks FSDP's gathered block: a
  block gathers its own ``E/ep`` experts, not all ``E``.
- ``recompute = full`` keeps only each block's input (÷ tp under sequence parallelism); the
  peak adds the larger of one block's recomputed activations and the loss head (the head's
  tensors are freed before the first block recomputes).

Micro-batches in flight per stage: 1 without pipelining (gradient accumulation frees each
micro-batch's activations), all ``m`` under GPipe, ``pp − stage`` under 1F1B (the first stage
holds ``pp``), times ``1 + (pp − 1)/(pp·v)`` for interleaved schedules (Narayanan et al. 2021).
The last stage adds the loss head: logits, their fp32 copy, the log-softmax cross-entropy saves
and the logits' gradient (÷ tp, vocabulary-parallel).

Start-up (``startup_memory``, the ``startup`` entry of the estimate): while a rank materialises its
shard (``raysc.parallel.materialise``) it holds its fp32 parameter shards, the rotary tables of each
of its pipeline chunks, and one block of the streamed initialisation (``INIT_BLOCK_VALUES`` fp32
values, drawn on the host: in the device's memory on CPU workers, in host memory beside a GPU). The
first step then adds gradients, AdamW state and activations, which the step estimate counts; the
fit check uses the larger of the two. Before meta-device construction this was the full model.
"""

from __future__ import annotations

from raysc.config.dims import MULTI_STAGE
from raysc.config.schema import ModelConfig
from raysc.model.flops import param_count
from raysc.plan.layout import Layout

INIT_BLOCK_VALUES = 1 << 22  # raysc.parallel.materialise.CHUNK_ELEMS (a test keeps them equal)


def startup_memory(m: ModelConfig, seq_len: int, lay: Layout, device: str = "cuda") -> dict:
    """Bytes one rank holds while materialising its shard (the worst pipeline stage): ``shards``,
    ``buffers`` (rotary tables), ``init_block`` (on ``device`` when it is the CPU, else 0 there) and
    ``host_block`` (the block in host memory beside a GPU), and the device ``total``."""
    pc = param_count(m)
    p, fs = lay.pp, lay.dp_shard * lay.cp
    head = pc["total"] - pc["embedding"] - m.n_layers * pc["per_layer"]  # final norm + output
    per_stage = m.n_layers / p * pc["per_layer"]
    worst = max(
        per_stage + (pc["embedding"] if s == 0 else 0) + (head if s == p - 1 else 0) for s in sorted({0, p - 1})
    )
    shards = 4 * worst / lay.tp / fs
    chunks = lay.pp_virtual_stages if p > 1 else 1
    buffers = chunks * 2 * (m.max_seq_len or seq_len) * m.head_dim * 4
    block = 4 * INIT_BLOCK_VALUES
    on_device = block if device == "cpu" else 0
    return {
        "shards": shards,
        "buffers": buffers,
        "init_block": on_device,
        "host_block": block - on_device,
        "total": shards + buffers + on_device,
    }


def ffn_width(m: ModelConfig, tp: int = 1) -> float:
    """Values per token a layer's feed-forward saves for backward on one of ``tp`` ranks, the mean over
    the layers: a dense SwiGLU's gate, SiLU, up and product (``4f/tp``); an MoE layer's for each of its
    ``k`` routed experts and each shared one (``4F/tp``: TP splits every expert's hidden dim) plus the
    routed rows in and out (``2h`` per routed copy, whole on every TP rank)."""
    n_moe = len(m.moe_layers)
    dense = 4 * m.hidden_ffn_dim / tp
    if not n_moe:
        return dense
    moe = 4 * (m.moe_top_k + m.moe_shared_experts) * m.moe_hidden_dim / tp + 2 * m.moe_top_k * m.dim
    return ((m.n_layers - n_moe) * dense + n_moe * moe) / m.n_layers


def expert_params_per_layer(m: ModelConfig) -> float:
    """Routed-expert parameters of a layer, the mean over the layers (0 for a dense model)."""
    return param_count(m)["routed_experts"] / m.n_layers


def activation_bytes_per_layer(m: ModelConfig, s: int, b: int, lay: Layout, act_bytes: int) -> float:
    """Bytes one block saves for backward for one micro-batch, without recomputation."""
    t, h = lay.tp, m.dim
    sbh = s * b * h
    upcast = 0 if act_bytes == 4 else 2 * sbh * (4 - act_bytes)  # RMSNorm's x.float() in each norm
    if lay.sequence_parallel and t > 1:
        outside = 4 * sbh / t * act_bytes + 2 * sbh * act_bytes + upcast / t
    else:
        outside = 6 * sbh * act_bytes + upcast
    # q, k, v (k/v repeated to every query head), the attention output and the out-projection input are
    # n_heads·head_dim wide: dim, unless model.head_dim says otherwise (Qwen3's heads are wider)
    inside = (5 * s * b * m.n_heads * m.head_dim / t + s * b * ffn_width(m, t)) * act_bytes
    # a router's fp32 logits, scores and top-k weights per token (the mean over the layers)
    router = 3 * s * b * m.moe_experts * 4 * len(m.moe_layers) / m.n_layers
    return outside + inside + router + 2 * s * b * 4  # + the norms' fp32 rsqrt per token


def inflight(lay: Layout, microbatches: int, stage: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    p = lay.pp
    if p == 1:
        return 1.0
    if lay.pp_schedule == "gpipe":
        return float(microbatches)
    held = float(min(microbatches, p - stage))
    if lay.pp_schedule in MULTI_STAGE:
        held *= 1 + (p - 1) / (p * lay.pp_virtual_stages)
    return held


def estimate_memory(
    m: ModelConfig, seq_len: int, global_batch: int, lay: Layout, dtype: str = "bf16", device: str = "cuda"
) -> dict:
    """Peak bytes per GPU of a training step (the worst pipeline stage) and their breakdown, with the
    start-up peak (``startup_memory``) under ``startup`` and the larger of the two as ``peak``."""
    pc = param_count(m)
    t, p = lay.tp, lay.pp
    act = 2 if dtype == "bf16" else 4
    fs = lay.dp_shard * lay.cp
    fsdp = lay.dp_replicate * fs > 1
    layers_per_stage = m.n_layers / p
    s = seq_len // lay.cp
    micro = lay.microbatches(global_batch)
    per_layer = activation_bytes_per_layer(m, s, lay.micro_batch, lay, act)
    vocab_head = m.vocab_size * m.dim
    best: dict | None = None
    for stage in sorted({0, p - 1}):
        first, last = stage == 0, stage == p - 1
        params = (
            layers_per_stage * pc["per_layer"]
            + (pc["embedding"] if first else 0)
            + ((pc["total"] - pc["embedding"] - m.n_layers * pc["per_layer"]) if last else 0)
        )
        local = params / t
        state = {"weights": 4 * local / fs, "grads": 4 * local / fs, "optimizer": 8 * local / fs}
        root = ((vocab_head if first else 0) + (0 if m.tie_embeddings or not last else vocab_head)) / t
        if fsdp:  # under EP a block gathers only its own experts (1/ep of them)
            gathered = pc["per_layer"] - expert_params_per_layer(m) * (1 - 1 / lay.ep)
            unsharded = act * root + 2 * act * gathered / t + 4 * gathered / t
        else:
            unsharded = (act * local) if act == 2 else 0.0  # autocast's cached bf16 weight copies
        n_held = inflight(lay, micro, stage)
        head = 0.0
        if last:
            sbv = s * lay.micro_batch * m.vocab_size / t
            head = sbv * (act + (4 if act < 4 else 0) + 4 + 4) + 3 * s * lay.micro_batch * m.dim * 4
        if lay.recompute == "full":
            kept = s * lay.micro_batch * m.dim * act / (t if lay.sequence_parallel and t > 1 else 1)
            activations = layers_per_stage * kept * n_held
            # the loss head's tensors are gone by the time the blocks recompute: the larger one counts
            transient = max(per_layer, head)
        else:
            activations = layers_per_stage * per_layer * n_held
            transient = head  # backward starts with every block's activations and the head's
        total = sum(state.values()) + unsharded + activations + transient
        row = {
            **state,
            "unsharded": unsharded,
            "activations": activations,
            "loss_head": head,
            "total": total,
            "stage": stage,
            "inflight": n_held,
        }
        if best is None or total > best["total"]:
            best = row
    startup = startup_memory(m, seq_len, lay, device)
    return {**best, "startup": startup, "peak": max(best["total"], startup["total"])}
