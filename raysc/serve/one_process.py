"""``OneProcessEngine``: Ray Serve LLM's vLLM engine, with a one-rank CPU model run inside vLLM's
engine-core process instead of a worker process of its own.

Ray Serve LLM gives vLLM ``distributed_executor_backend = "mp"`` on CPU (``VLLMEngineConfig.
get_initialization_kwargs``; vLLM's CPU platform turns "uni" back into "mp" too, for the OpenMP
thread binding of several ranks), so each CPU replica starts three processes, each importing torch
and vLLM: the Serve replica, vLLM's EngineCore, and one Worker under it. With one rank (tensor and
pipeline parallel 1) the Worker process does nothing the EngineCore process could not: this engine
hands vLLM its ``UniProcExecutor`` there, which runs the same ``CPUWorker`` (the same thread binding,
as the first thing in a freshly spawned process) in the EngineCore process. Measured on the 2-core
dev machine (docs/serving.md): a test deployment ready in 49.7 s instead of 63.3 s, greedy tokens
equal to transformers' either way.

The replicas load it through Ray Serve LLM's own hook for the engine class, the
``RAYLLM_VLLM_ENGINE_CLS`` variable in the replica's ``runtime_env`` (``raysc.serve.engine.ONE_PROCESS``,
set by ``llm_config_dict`` for a one-rank CPU engine), so the same LLMConfig under ``serve deploy``
gets it too. GPU engines and several ranks keep Ray's executor. Importing this module imports vLLM:
only replicas do.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine


class OneProcessEngine(VLLMEngine):
    def _start_async_llm_engine(self, vllm_engine_args: Any, vllm_engine_config: Any, placement_group: Any) -> Any:
        parallel = vllm_engine_config.parallel_config
        if vllm_engine_config.device_config.device_type == "cpu" and parallel.world_size == 1:
            parallel.distributed_executor_backend = "uni"
        return super()._start_async_llm_engine(vllm_engine_args, vllm_engine_config, placement_group)
