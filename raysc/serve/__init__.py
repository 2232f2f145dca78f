"""Serving a raysc model: vLLM inside Ray Serve LLM (``raysc serve``) and speculative decoding."""
