"""Mistral (7B, Nemo, Ministral): llama's decoder; a sliding_window in config.json bounds every layer."""

from lse_core.model.arch.llama import build

__all__ = ["build"]
