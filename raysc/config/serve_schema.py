"""The ``[serve]`` section: how a trained model is served (``raysc serve``: vLLM inside Ray Serve LLM)
and in which precision (``raysc preflight`` item 7, ``raysc quantize``)."""

from __future__ import annotations

from dataclasses import dataclass

from raysc.config.options import opt


@dataclass
class ServeConfig:
    quantization: str = opt(
        "",
        "the precision the model will be served in (checked by raysc preflight against "
        "the training precision); empty = not decided",
        choices=["", "bf16", "fp16", "fp8", "int8", "int4"],
    )
    max_quality_loss: float = opt(
        0.05,
        "largest relative held-out perplexity increase a quantized checkpoint may "
        "cost against the training precision (raysc quantize, preflight item 7)",
        min=0.0,
    )
    # raysc serve: Ray Serve LLM + vLLM (docs/serving.md); each knob below maps onto one vLLM engine argument
    host: str = opt(
        "127.0.0.1",
        "address the OpenAI-compatible endpoint binds; 0.0.0.0 exposes it to the network (set serve.api_key first)",
    )
    port: int = opt(8000, "HTTP port of the endpoint", min=1, max=65535)
    model_id: str = opt("", "the model name clients send ('model' in a request); empty = run.name")
    api_key: str = opt(
        "",
        "when set (or RAYSC_API_KEY), requests without 'Authorization: Bearer <key>' get 401; "
        "never written to logs or exported configs",
    )
    replicas: int = opt(1, "fixed number of vLLM replicas (ignored when autoscale_max > 0)", min=1)
    autoscale_min: int = opt(1, "autoscaling: fewest replicas", min=0)
    autoscale_max: int = opt(0, "autoscaling: most replicas; 0 = no autoscaling (serve.replicas fixed)", min=0)
    cpus_per_replica: float = opt(1.0, "CPUs reserved for each replica's engine (its placement-group bundle)", gt=0.0)
    ready_timeout_s: float = opt(
        300.0,
        "raysc serve: longest wait for the application to answer; then it stops "
        "with what it waited for and removes what it deployed",
        gt=0.0,
    )
    gpus_per_replica: float = opt(
        0.0, "GPUs per tensor/pipeline rank; 0 on a laptop or CI (the CPU build of vLLM), 1 on a GPU cluster", min=0.0
    )
    dtype: str = opt(
        "auto",
        "weights/activations precision in vLLM; auto = the exported dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
    )
    max_model_len: int = opt(0, "longest prompt + completion in tokens; 0 = the model's max_position_embeddings", min=0)
    max_num_seqs: int = opt(32, "vLLM: most sequences batched together (continuous batching)", min=1)
    max_num_batched_tokens: int = opt(
        0, "vLLM: most tokens per engine step (chunked prefill budget); 0 = vLLM's default", min=0
    )
    block_size: int = opt(
        0,
        "vLLM: tokens per paged KV-cache block; 0 = vLLM's choice for the attention backend "
        "(the CPU backend needs a multiple of 32)",
        choices=[0, 8, 16, 32, 64, 128],
    )
    kv_cache_gb: float = opt(
        1.0, "KV-cache memory per replica in GiB (VLLM_CPU_KVCACHE_SPACE on CPU, kv_cache_memory_bytes on GPU)", gt=0.0
    )
    enable_prefix_caching: bool = opt(True, "vLLM: reuse KV blocks of shared prompt prefixes")
    tensor_parallel_size: int = opt(1, "vLLM tensor-parallel ranks per replica (a model bigger than one GPU)", min=1)
    pipeline_parallel_size: int = opt(1, "vLLM pipeline-parallel stages per replica", min=1)
    enforce_eager: bool = opt(False, "no CUDA graphs (always on for the CPU build)")
    num_speculative_tokens: int = opt(
        0,
        "speculative decoding length k; 0 = off, or the tuned value from serve_speculative.json when --draft is given",
        min=0,
    )
    speculative_method: str = opt(
        "draft_model", "how tokens are drafted when num_speculative_tokens > 0", choices=["draft_model", "ngram"]
    )
