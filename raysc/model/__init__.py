"""The Llama model in plain torch, its μP parametrisation, its FLOP accounting and text generation."""

from raysc.model.flops import flops_per_token, param_count
from raysc.model.llama import Llama, build_model

__all__ = ["Llama", "build_model", "flops_per_token", "param_count"]
