"""raysc: an LLM pre-training runtime on Ray (see docs/ and ../shared/DESIGN.md)."""

__version__ = "0.1.0"
