"""The mixture-of-experts feed-forward block the MoE architectures share:

    routes = moe_route(router(n))                       each row's k experts and their weights
    y      = down_e(act(gate_e(n)) * up_e(n))           for each chosen expert e (expert_linear)
    out    = moe_combine(y, routes)                     the k rows weighted and summed

Expert matrices are one [n_experts, out, in] weight: a GGUF stores them so (ffn_*_exps, imported under
``mlp.experts.<proj>.weight``); a Hugging Face checkpoint stores one matrix per expert, stacked here."""

from __future__ import annotations

import numpy as np

from lse_core.errors import StartupError
from lse_core.model.arch.llama import GraphBuilder


def expert_weight(b: GraphBuilder, prefix: str, proj: str, n_experts: int, shape: tuple[int, ...]) -> str:
    """The name of ``prefix``.experts' stacked ``proj`` weight [n_experts, *shape], checked against the config."""
    stacked = f"{prefix}.experts.{proj}"
    if stacked in b.model.weights:
        return b.weight(stacked, (n_experts, *shape))
    names = [b.weight(f"{prefix}.experts.{e}.{proj}", shape) for e in range(n_experts)]
    b.weights[stacked] = np.stack([np.asarray(b.weights.pop(name), np.float32) for name in names])
    return stacked


def moe_block(b: GraphBuilder, i: int, x: str, *, hidden: int, width: int, n_experts: int, k: int,
              mode: str, normalize: bool = False, activation: str = "silu") -> str:
    """The experts of layer i on the normed input x: a router of n_experts, k chosen per token, each a
    gated MLP of ``width``; returns the combined output [T, hidden]."""
    if not 0 < k <= n_experts:
        raise StartupError(f"{b.model.source}: {k} experts per token of {n_experts} experts")
    p = f"model.layers.{i}.mlp"
    router = b.linear(x, f"{p}.gate", (n_experts, hidden), f"l{i}.router", i, False)
    routes = b.emit("moe_route", (router,), f"l{i}.routes", (), i, k=k, mode=mode, normalize=normalize)
    gate = b.emit("expert_linear", (x, routes), f"l{i}.gate",
                  (expert_weight(b, p, "gate_proj.weight", n_experts, (width, hidden)),), i, k=k)
    up = b.emit("expert_linear", (x, routes), f"l{i}.up",
                (expert_weight(b, p, "up_proj.weight", n_experts, (width, hidden)),), i, k=k)
    act = b.emit(activation, (gate,), f"l{i}.act", (), i)
    mixed = b.emit("mul", (act, up), f"l{i}.mixed", (), i)
    down = b.emit("expert_linear", (mixed, routes), f"l{i}.experts_out",
                  (expert_weight(b, p, "down_proj.weight", n_experts, (hidden, width)),), i, k=k, mlp="down")
    return b.emit("moe_combine", (down, routes), f"l{i}.mlp_out", (), i)
