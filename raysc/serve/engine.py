"""``serve.*`` settings → a Ray Serve LLM ``LLMConfig`` for vLLM: one place maps each raysc knob onto
the engine argument it sets, and checks the combinations vLLM would reject late (or not at all).

Kept free of vLLM and Ray imports at module level: the mapping is plain dictionaries, built and
checked in the driver before anything starts (``engine_kwargs``, ``llm_config_dict``).
"""

from __future__ import annotations

import math
from typing import Any

from raysc.config.schema import ServeConfig
from raysc.serve.source import ServedModel

# Ray Serve LLM's hook for the engine class a replica builds: ours runs a one-rank CPU model in vLLM's
# engine-core process, not a worker process of its own (raysc.serve.one_process)
ONE_PROCESS = {"RAYLLM_VLLM_ENGINE_CLS": "raysc.serve.one_process:OneProcessEngine"}


class ServeConfigError(ValueError):
    """A ``serve.*`` setting (or combination) the engine cannot run; the message names the fix."""


def on_cpu(cfg: ServeConfig) -> bool:
    """No GPU per replica: the CPU build of vLLM (laptops, CI)."""
    return cfg.gpus_per_replica == 0


def check(cfg: ServeConfig, speculative: dict | None = None) -> None:
    """Raise ``ServeConfigError`` for settings vLLM cannot honour, before anything is deployed."""
    ranks = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if on_cpu(cfg) and cfg.pipeline_parallel_size > 1:
        raise ServeConfigError(
            "serve.pipeline_parallel_size > 1 needs GPUs (serve.gpus_per_replica = 1); "
            "the CPU build of vLLM runs one pipeline stage"
        )
    if on_cpu(cfg) and cfg.block_size % 32:
        raise ServeConfigError(
            f"serve.block_size = {cfg.block_size}: vLLM's CPU attention needs a multiple of 32 "
            f"(set 32, 64 or 128, or 0 for vLLM's choice)"
        )
    if cfg.autoscale_max and cfg.autoscale_min > cfg.autoscale_max:
        raise ServeConfigError(
            f"serve.autoscale_min ({cfg.autoscale_min}) > serve.autoscale_max "
            f"({cfg.autoscale_max}); use --autoscale MIN,MAX with MIN <= MAX"
        )
    if cfg.max_num_batched_tokens and cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise ServeConfigError(
            f"serve.max_num_batched_tokens ({cfg.max_num_batched_tokens}) < serve.max_num_seqs "
            f"({cfg.max_num_seqs}): every running sequence needs a token per step"
        )
    if cfg.gpus_per_replica and cfg.gpus_per_replica < 1 and ranks > 1:
        raise ServeConfigError(
            "fractional serve.gpus_per_replica with tensor/pipeline parallelism: give each rank a whole GPU"
        )
    if speculative and speculative.get("num_speculative_tokens", 0) < 1:
        raise ServeConfigError(
            "speculative decoding needs num_speculative_tokens >= 1 "
            "(serve.num_speculative_tokens, or `raysc spec tune`)"
        )


def engine_kwargs(cfg: ServeConfig, speculative: dict | None = None) -> dict[str, Any]:
    """vLLM ``EngineArgs`` for ``cfg`` (only the ones raysc sets; vLLM's defaults for the rest)."""
    kw: dict[str, Any] = {
        "dtype": cfg.dtype,
        "max_num_seqs": cfg.max_num_seqs,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        # the CPU build has no CUDA graphs to capture
        "enforce_eager": cfg.enforce_eager or on_cpu(cfg),
    }
    if cfg.block_size:
        kw["block_size"] = cfg.block_size
    if cfg.max_model_len:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not on_cpu(cfg):  # on CPU the KV cache is sized by VLLM_CPU_KVCACHE_SPACE (runtime_env)
        kw["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
    if speculative:
        kw["speculative_config"] = dict(speculative)
    return kw


def speculative_config(cfg: ServeConfig, draft_path: str | None, tuned: dict | None) -> dict | None:
    """vLLM's ``speculative_config`` from ``serve.*`` and a ``raysc spec tune`` result (``tuned``, which
    wins for k and the method unless serve.num_speculative_tokens is set)."""
    k = cfg.num_speculative_tokens or int((tuned or {}).get("num_speculative_tokens", 0))
    method = (
        (tuned or {}).get("method", cfg.speculative_method)
        if not cfg.num_speculative_tokens
        else cfg.speculative_method
    )
    if draft_path is None and method == "draft_model" and k:
        raise ServeConfigError(
            "speculative decoding with a draft model needs --draft DRAFT_RUN; or set "
            'serve.speculative_method="ngram" (prompt lookup, no draft model)'
        )
    if not k:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k}


def llm_config_dict(
    model: ServedModel,
    cfg: ServeConfig,
    model_id: str,
    speculative: dict | None = None,
    env: dict[str, str] | None = None,
    actor_cpus: float | None = None,
) -> dict[str, Any]:
    """The ``LLMConfig`` of one served model, as the dictionary ``ray.serve.llm.LLMConfig`` validates
    (also what ``jobs/serve_config.yaml`` holds for ``serve deploy``); ``env``: environment variables
    for the replicas' model download (``raysc.serve.store_env.replica_env``: how a node reaches an
    object-store export), handed to ``raysc.serve.replica_setup``; ``actor_cpus``: the replica
    actor's CPUs when Serve's default of 1 does not fit the cluster (``raysc.serve.fit``)."""
    check(cfg, speculative)
    source: Any = model.path
    if model.remote:  # each replica's node mirrors the folder from the object store
        source = {"bucket_uri": model.path}
    ranks = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    bundle: dict[str, float] = {"CPU": cfg.cpus_per_replica}
    if cfg.gpus_per_replica:
        bundle["GPU"] = cfg.gpus_per_replica
    if cfg.autoscale_max:
        deployment = {
            "autoscaling_config": {
                "min_replicas": cfg.autoscale_min,
                "max_replicas": cfg.autoscale_max,
                "target_ongoing_requests": max(1, cfg.max_num_seqs // 2),
            }
        }
    else:
        deployment = {"num_replicas": cfg.replicas}
    if actor_cpus is not None:  # each replica's own actor (merged into its first bundle): raysc.serve.fit
        deployment["ray_actor_options"] = {"num_cpus": actor_cpus}
    out: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": engine_kwargs(cfg, speculative),
        "placement_group_config": {"bundles": [bundle] * ranks},
        "deployment_config": deployment,
        "log_engine_metrics": True,
    }
    if on_cpu(cfg):
        # vLLM's CPU backend sizes its KV cache from this variable, in whole GiB
        out["runtime_env"] = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(cfg.kv_cache_gb)))}}
        if ranks == 1:  # the model in vLLM's engine-core process, not a worker process of its own
            out["runtime_env"]["env_vars"].update(ONE_PROCESS)
    if env:  # set in each node's download task (not the runtime_env: Ray logs that, credentials included)
        out["callback_config"] = {
            "callback_class": "raysc.serve.replica_setup:StoreSettings",
            "callback_kwargs": {"env": dict(env)},
        }
    return out
