"""Qwen2 / Qwen2.5: the llama decoder with biases on the q, k and v projections (none on o_proj)."""

from __future__ import annotations

from lse_core.graph.ir import Graph
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> Graph:
    return llama.build(model, qkv_bias=True)
