"""Post-training quantization of a run's checkpoint into a format vLLM serves (``raysc quantize``).

``rtn`` (the grid and round-to-nearest), ``gptq``, ``awq``: the methods on one linear;
``sequential``: block by block over the model; ``calibration``: rows of the training split;
``quality``: held-out perplexity; ``writer``: the compressed-tensors folder; ``manifest``: its
record; ``run``: all of it for a run directory; ``command``: the CLI entry; ``vllm_check``: load
and generate with vLLM.
"""
