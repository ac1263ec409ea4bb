"""gpt-oss: the llama decoder with biased q/k/v/o projections, attention sinks (a learned logit per head in each
softmax's denominator), sliding-window layers alternating with full ones (``layer_types``), YaRN rope, and a
mixture of experts in every layer: a biased router whose top ``num_experts_per_tok`` logits are softmaxed,
biased experts gated by the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).

Hugging Face stores each layer's experts as ``gate_up_proj`` [experts, hidden, 2 width], gate and up in
alternate columns, and ``down_proj`` [experts, width, hidden] (x @ W): laid out once here as the expert
ops read them ([experts, out, in])."""

from __future__ import annotations

from typing import Any

import numpy as np

from lse_core.errors import StartupError
from lse_core.graph.ir import Graph
from lse_core.model.arch import llama
from lse_core.model.arch._moe import Experts, moe_block, route
from lse_core.model.model import Model


def build(model: Model) -> Graph:
    config = model.config
    for key in ("num_local_experts", "num_experts_per_tok"):
        if not config.get(key):
            raise StartupError(f"{model.source}: config.json has no {key!r} (needed by gpt_oss)")
    n_experts, k = int(config["num_local_experts"]), int(config["num_experts_per_tok"])
    activation = {"alpha": float(config.get("swiglu_alpha", 1.702)), "limit": float(config.get("swiglu_limit", 7.0))}

    def mlp(b: llama.GraphBuilder, args: llama.ModelArgs, i: int, x: str) -> str:
        routes = route(b, i, x, f"model.layers.{i}.mlp.router", hidden=args.hidden_size, n_experts=n_experts, k=k,
                       mode="topk_softmax", bias=True)
        experts = _experts(b, i, n_experts, args.intermediate_size, args.hidden_size)
        return moe_block(b, i, x, routes, experts, k, "clamped_swiglu", **activation)

    return llama.build(model, mlp=mlp, sinks=True)


def _experts(b: llama.GraphBuilder, i: int, n_experts: int, width: int, hidden: int) -> Experts:
    prefix = f"model.layers.{i}.mlp.experts"
    gate_up = _float(b, f"{prefix}.gate_up_proj", (n_experts, hidden, 2 * width))
    gate_up_bias = _float(b, f"{prefix}.gate_up_proj_bias", (n_experts, 2 * width))
    down = _float(b, f"{prefix}.down_proj", (n_experts, width, hidden))
    laid_out: dict[str, Any] = {
        "gate": gate_up[:, :, 0::2].transpose(0, 2, 1), "up": gate_up[:, :, 1::2].transpose(0, 2, 1),
        "down": down.transpose(0, 2, 1), "gate_bias": gate_up_bias[:, 0::2], "up_bias": gate_up_bias[:, 1::2],
        "down_bias": _float(b, f"{prefix}.down_proj_bias", (n_experts, hidden)),
    }
    for role, array in laid_out.items():
        b.weights[f"{prefix}.{role}"] = np.ascontiguousarray(array)
    return Experts(**{role: f"{prefix}.{role}" for role in laid_out})


def _float(b: llama.GraphBuilder, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The checked float32 tensor, left out of the graph's weights (its laid-out forms go in)."""
    array = np.asarray(b.model.weights[b.weight(name, shape)], np.float32)
    del b.weights[name]
    return array
