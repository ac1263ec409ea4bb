"""Hugging Face names Gemma 3's text-only checkpoints "gemma3_text"; the graph is gemma3's."""

from lse_core.model.arch.gemma3 import build

__all__ = ["build"]
