"""Cross-key checks of a loaded config, one function per section, and the error they raise.

A single field's rules (type, range, choices) are checked as the value is read
(``raysc.config.load``); what needs several keys is checked here, after every value is in.
Each check raises ``ConfigError`` naming the keys, their values and a fix. ``validate`` runs
them in a fixed order, so a config with several problems always reports the same first one.
Everything they need is in config: the mixture and n-gram syntaxes (``syntax``), the fault
spec (``faults``) and the pipeline schedules (``dims``).
"""

from __future__ import annotations

from collections.abc import Callable

from raysc.config.dims import MULTI_STAGE
from raysc.config.faults import parse_faults
from raysc.config.schema import Config, ModelConfig, ParallelConfig
from raysc.config.syntax import parse_ngram_limits, parse_schedule


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: key, origin, what is allowed."""


def check_data(cfg: Config, origin: str) -> None:
    """[data]: the mixture schedule parses (its domains are checked against the data later)."""
    if cfg.data.schedule:
        try:
            parse_schedule(cfg.data.schedule)
        except ValueError as e:
            raise ConfigError(f"{origin}: data.schedule: {e}") from None


def check_dedup(cfg: Config, origin: str) -> None:
    """[dedup]: the LSH bands × rows use every MinHash function."""
    d = cfg.dedup
    if d.bands * d.rows != d.num_perm:
        raise ConfigError(
            f"{origin}: dedup.bands × dedup.rows = {d.bands} × {d.rows} = {d.bands * d.rows} must "
            f"equal dedup.num_perm = {d.num_perm}; e.g. 14 × 8 = 112."
        )


def check_quality(cfg: Config, origin: str) -> None:
    """[quality]: the n-gram limits parse; a perplexity filter has a reference model to score with."""
    q = cfg.quality
    for key in ("top_ngram_max", "dup_ngram_max"):
        try:
            parse_ngram_limits(getattr(q, key))
        except ValueError as e:
            raise ConfigError(f"{origin}: quality.{key}: {e}") from None
    if not q.reference_run and (q.keep_top_percent < 100 or q.max_perplexity):
        raise ConfigError(
            f"{origin}: quality.keep_top_percent = {q.keep_top_percent} / quality.max_perplexity = "
            f"{q.max_perplexity} filter by a reference model's perplexity, but quality.reference_run "
            f"is empty; set it to the run directory of a model trained on text you trust, or leave "
            f"keep_top_percent = 100 and max_perplexity = 0"
        )


def check_model(cfg: Config, origin: str) -> None:
    """[model]: head shapes, a rotary table that covers train.seq_len, μP only for raysc's own Llama."""
    m, t = cfg.model, cfg.train
    if m.dim % m.n_heads and not m.attn_head_dim:
        raise ConfigError(
            f"{origin}: model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; change one, "
            f"or set model.head_dim (heads need not be dim / n_heads wide)."
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"{origin}: the head dim (model.head_dim, or model.dim/model.n_heads) = {m.head_dim} must be even for "
            f"rotary embeddings."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"{origin}: model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
            f"(grouped-query attention shares each KV head among n_heads/n_kv_heads query heads)."
        )
    if m.max_seq_len and m.max_seq_len < t.seq_len:
        raise ConfigError(
            f"{origin}: model.max_seq_len={m.max_seq_len} is shorter than train.seq_len={t.seq_len}; "
            f"raise it or set it to 0 (= train.seq_len)."
        )
    if m.mup and (m.attention_bias or m.qk_norm or m.rope_scaling != "none"):
        raise ConfigError(
            f"{origin}: model.mup = true with a public family's switches (model.attention_bias = "
            f"{str(m.attention_bias).lower()}, model.qk_norm = {str(m.qk_norm).lower()}, model.rope_scaling = "
            f"{m.rope_scaling!r}) is not supported: μP's "
            f"rules cover raysc's own Llama (docs/scaling.md); set model.mup = false to continue a public "
            f"checkpoint in its standard parametrisation."
        )


def check_moe(cfg: Config, origin: str) -> None:
    """[model] moe_*: top-k within the experts; at least one MoE layer; what MoE does not run with yet;
    parallel.ep."""
    m, par = cfg.model, cfg.parallel
    if not m.moe_experts:
        if par.ep > 1:
            raise ConfigError(
                f"{origin}: parallel.ep={par.ep} splits the routed experts of a mixture of experts, but "
                f"model.moe_experts = 0 (a dense model); set parallel.ep = 1, or model.moe_experts > 0."
            )
        return
    if m.moe_top_k > m.moe_experts:
        raise ConfigError(
            f"{origin}: model.moe_top_k={m.moe_top_k} is more than model.moe_experts={m.moe_experts}; "
            f"a token is routed to at most every expert."
        )
    if not m.moe_layers:
        raise ConfigError(
            f"{origin}: model.moe_experts={m.moe_experts} but no layer is MoE (model.moe_first_dense_layers="
            f"{m.moe_first_dense_layers}, model.moe_every_n_layers={m.moe_every_n_layers}, model.n_layers="
            f"{m.n_layers}); lower the first two, or set model.moe_experts = 0 for a dense model."
        )
    if m.mup:
        raise ConfigError(
            f"{origin}: model.mup = true with a mixture of experts is not supported (μP's rules are for raysc's "
            f"dense Llama, docs/scaling.md); set model.mup = false."
        )
    check_ep(m, par, origin)


def check_ep(m: ModelConfig, par: ParallelConfig, origin: str) -> None:
    """parallel.ep: carved from dp_shard, dividing the experts; not the dim an elastic run resizes."""
    if par.ep == 1:
        return
    if par.dp_shard % par.ep:
        raise ConfigError(
            f"{origin}: parallel.ep={par.ep} does not divide parallel.dp_shard={par.dp_shard}: expert-parallel "
            f"groups are carved from the FSDP ranks (docs/moe.md); make dp_shard a multiple of ep."
        )
    if m.moe_experts % par.ep:
        raise ConfigError(
            f"{origin}: parallel.ep={par.ep} does not divide model.moe_experts={m.moe_experts}: every rank of an "
            f"expert-parallel group holds the same number of experts; choose ep among the divisors of "
            f"{m.moe_experts}."
        )
    if par.elastic and par.elastic_dim == "dp_shard":
        raise ConfigError(
            f"{origin}: parallel.elastic with parallel.elastic_dim = 'dp_shard' and parallel.ep={par.ep}: "
            f"resizing dp_shard would split the expert-parallel groups; resize dp_replicate instead "
            f"(parallel.elastic_dim = 'dp_replicate')."
        )


def check_checkpoint(cfg: Config, origin: str) -> None:
    """[checkpoint]: kept steps fall on saved steps."""
    if (
        cfg.checkpoint.keep_every_steps
        and cfg.checkpoint.every_steps
        and cfg.checkpoint.keep_every_steps % cfg.checkpoint.every_steps
    ):
        raise ConfigError(
            f"{origin}: checkpoint.keep_every_steps={cfg.checkpoint.keep_every_steps} is not a multiple of "
            f"checkpoint.every_steps={cfg.checkpoint.every_steps}, so no checkpoint would match it."
        )


def check_batch(cfg: Config, origin: str) -> None:
    """[train]: one global batch size, split evenly over data-parallel ranks and micro-batches."""
    t, par = cfg.train, cfg.parallel
    if bool(t.global_batch) == bool(t.global_batch_tokens):
        raise ConfigError(
            f"{origin}: set exactly one of train.global_batch (sequences) or train.global_batch_tokens "
            f"(got global_batch={t.global_batch}, global_batch_tokens={t.global_batch_tokens})."
        )
    if t.global_batch_tokens and t.global_batch_tokens % t.seq_len:
        raise ConfigError(
            f"{origin}: train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
            f"train.seq_len={t.seq_len}; use {max(1, t.global_batch_tokens // t.seq_len) * t.seq_len}."
        )
    gb, dp = t.global_batch_sequences, par.dp
    if gb % dp:
        raise ConfigError(
            f"{origin}: the global batch of {gb} sequences is not divisible by the data-parallel size "
            f"dp_replicate×dp_shard={dp}."
        )
    local = gb // dp
    if t.micro_batch and local % t.micro_batch:
        raise ConfigError(
            f"{origin}: train.micro_batch={t.micro_batch} does not divide the {local} sequences each "
            f"data-parallel rank processes per step (global batch {gb} / dp {dp})."
        )


def check_layout(cfg: Config, origin: str) -> None:
    """[parallel]: the layout against the model and batch, each check naming the numbers and a fix."""
    m, t, par = cfg.model, cfg.train, cfg.parallel
    if par.tp > 1:
        for what, n in (
            ("model.n_heads", m.n_heads),
            ("model.n_kv_heads", m.n_kv_heads),
            ("model.vocab_size", m.vocab_size),
            ("the SwiGLU hidden size", m.hidden_ffn_dim),
            *([("a routed expert's hidden size (model.moe_ffn_dim)", m.moe_hidden_dim)] if m.moe_experts else []),
        ):
            if n % par.tp:
                raise ConfigError(
                    f"{origin}: {what}={n} is not divisible by parallel.tp={par.tp}; pick a tp that divides it."
                )
    if par.sequence_parallel and par.tp == 1:
        raise ConfigError(f"{origin}: parallel.sequence_parallel needs parallel.tp > 1.")
    if par.cp > 1 and t.seq_len % (2 * par.cp):
        raise ConfigError(
            f"{origin}: train.seq_len={t.seq_len} is not divisible by 2×parallel.cp={2 * par.cp} "
            f"(context parallelism gives each rank an early and a late chunk)."
        )
    v = par.pp_virtual_stages
    if v > 1 and par.pp_schedule not in MULTI_STAGE:
        raise ConfigError(
            f"{origin}: parallel.pp_virtual_stages={v} needs an interleaved schedule "
            f"(parallel.pp_schedule = {' or '.join(map(repr, MULTI_STAGE))})."
        )
    if par.pp == 1:
        return
    if m.n_layers % (par.pp * v):
        raise ConfigError(
            f"{origin}: model.n_layers={m.n_layers} is not divisible by parallel.pp×"
            f"pp_virtual_stages={par.pp}×{v}={par.pp * v}; change either so each stage gets "
            f"the same number of layers."
        )
    if m.tie_embeddings:
        raise ConfigError(
            f"{origin}: model.tie_embeddings cannot be used with parallel.pp={par.pp} "
            f"(the embedding and output live on different stages); set it to false."
        )
    if par.pp_schedule in MULTI_STAGE and v < 2:
        raise ConfigError(f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs parallel.pp_virtual_stages >= 2.")
    micro = par.pp_microbatches or par.pp
    local = t.global_batch_sequences // par.dp
    if local % micro:
        raise ConfigError(
            f"{origin}: the global batch of {t.global_batch_sequences} sequences is not divisible by "
            f"dp×microbatches={par.dp}×{micro}; each data-parallel rank's {local} sequences must "
            f"split into parallel.pp_microbatches={micro} equal microbatches."
        )
    if t.micro_batch and t.micro_batch * micro != local:
        raise ConfigError(
            f"{origin}: train.micro_batch={t.micro_batch} disagrees with the pipeline's microbatches: each "
            f"data-parallel rank's {local} sequences split into parallel.pp_microbatches={micro} microbatches "
            f"of {local // micro}; with pipeline parallelism set parallel.pp_microbatches and leave "
            f"train.micro_batch at 0."
        )
    if par.pp_schedule != "gpipe" and micro < par.pp:
        raise ConfigError(
            f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs at least pp={par.pp} "
            f"microbatches, got parallel.pp_microbatches={micro}."
        )
    rounds = max(1, micro // par.pp)
    if par.pp_schedule in MULTI_STAGE and micro % rounds:
        raise ConfigError(
            f"{origin}: parallel.pp_schedule='{par.pp_schedule}' needs pp_microbatches to be a "
            f"multiple of {rounds} (pp_microbatches // pp); use {rounds * par.pp}."
        )


def check_elastic(cfg: Config, origin: str) -> None:
    """parallel.elastic: min_dp within the configured size of the dimension that may change."""
    par = cfg.parallel
    if par.elastic and par.min_dp > getattr(par, par.elastic_dim):
        raise ConfigError(
            f"{origin}: parallel.min_dp={par.min_dp} is larger than parallel.{par.elastic_dim}="
            f"{getattr(par, par.elastic_dim)}, the size an elastic run starts from and grows back "
            f"to; set min_dp <= {getattr(par, par.elastic_dim)}."
        )


def check_supervisor(cfg: Config, origin: str) -> None:
    """[supervisor]: the fault-injection spec parses and names ranks that exist."""
    par = cfg.parallel
    try:
        faults = parse_faults(cfg.supervisor.inject)
    except ValueError as e:
        raise ConfigError(f"{origin}: supervisor.inject: {e}") from None
    for f in faults:
        # an elastic run's world changes: a fault for a rank it lacks now fires once it has that rank again
        # (``raysc.fleet.elastic`` checks the ranks against the configured size)
        if f.rank >= par.world_size and not par.elastic:
            raise ConfigError(
                f"{origin}: supervisor.inject: rank {f.rank} in {f.spec!r} does not exist "
                f"(world size {par.world_size})."
            )


def check_precision(cfg: Config, origin: str) -> None:
    """[train] × [parallel]: bf16 needs CUDA; document positions need the document mask; compiled blocks
    are not tensor-parallel."""
    t, par = cfg.train, cfg.parallel
    if t.compile and par.tp > 1:  # torch 2.13: a compiled TP block fails on DTensor ('_local_tensor'), seen here
        raise ConfigError(
            f"{origin}: train.compile is not supported with parallel.tp={par.tp} yet (the compiled "
            f"tensor-parallel block fails in torch {_torch_version()}); set train.compile=false, or "
            f"use dp_shard / pp / cp for the model's parallelism."
        )
    if t.dtype == "bf16" and par.device == "cpu":
        raise ConfigError(f"{origin}: train.dtype='bf16' needs parallel.device='cuda'; use 'auto' or 'fp32'.")
    if t.document_positions and not t.document_mask:
        raise ConfigError(
            f"{origin}: train.document_positions restarts rotary positions per document, but "
            f"train.document_mask is off (documents would still see each other); set "
            f"train.document_mask=true too, or unset train.document_positions."
        )


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed)"


TRACKER_PACKAGES = {
    "tensorboard": ("track.tensorboard", "tensorboard"),
    "mlflow": ("track.mlflow_uri", "mlflow"),
    "wandb": ("track.wandb_project", "wandb"),
}


def check_track(cfg: Config, origin: str) -> None:
    """[track]: each tracker asked for is importable here (they are optional: raysc[track]). Not one
    of the ``SECTION_CHECKS``: a run's config names its trackers, and reading the run (export, status,
    serve) on a machine without them must still work; the training driver calls it before Ray."""
    import importlib.util

    tr = cfg.track
    asked = {"tensorboard": tr.tensorboard, "mlflow": bool(tr.mlflow_uri), "wandb": bool(tr.wandb_project)}
    for module, on in asked.items():
        if on and importlib.util.find_spec(module) is None:
            key, package = TRACKER_PACKAGES[module]
            raise ConfigError(
                f"{origin}: {key} is set but the {package!r} package is not installed; "
                f"`pip install 'raysc[track]'` (or `pip install {package}`), or unset {key}."
            )


SECTION_CHECKS: tuple[Callable[[Config, str], None], ...] = (
    check_data,
    check_dedup,
    check_quality,
    check_model,
    check_moe,
    check_checkpoint,
    check_batch,
    check_layout,
    check_elastic,
    check_supervisor,
    check_precision,
)


def validate(cfg: Config, origin: str = "config") -> None:
    """Cross-key checks that a single field's rules cannot express (``ConfigError`` on the first)."""
    for check in SECTION_CHECKS:
        check(cfg, origin)
