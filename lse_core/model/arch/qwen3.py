"""Qwen3 (dense): the llama decoder with a per-head rms_norm on q and k before rope, and no biases
unless config.json's attention_bias asks for them."""

from __future__ import annotations

from lse_core.graph.ir import Graph
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> Graph:
    return llama.build(model, qk_norm=True)
