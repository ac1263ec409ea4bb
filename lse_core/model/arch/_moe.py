"""The mixture-of-experts feed-forward block the MoE architectures share:

    routes = moe_route(router(n))                       each row's k experts and their weights
    y      = down_e(act(gate_e(n), up_e(n)))            for each chosen expert e (expert_linear)
    out    = moe_combine(y, routes)                     the k rows weighted and summed

Expert matrices are one [n_experts, out, in] weight: a GGUF stores them so (ffn_*_exps, imported under
``mlp.experts.<proj>.weight``); a Hugging Face checkpoint may store one matrix per expert, stacked here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lse_core.errors import StartupError
from lse_core.model.arch.llama import GraphBuilder


@dataclass(frozen=True)
class Experts:
    """A mixture's weights, by name in the builder: gate and up [experts, width, hidden], down [experts, hidden,
    width], and the biases [experts, out] where the model has them."""

    gate: str
    up: str
    down: str
    gate_bias: str | None = None
    up_bias: str | None = None
    down_bias: str | None = None


def stacked_experts(b: GraphBuilder, i: int, n_experts: int, width: int, hidden: int) -> Experts:
    """Layer i's ``mlp.experts`` gate_proj, up_proj and down_proj, each stacked ([experts, out, in])."""
    prefix = f"model.layers.{i}.mlp.experts"

    def stacked(proj: str, shape: tuple[int, int]) -> str:
        name = f"{prefix}.{proj}.weight"
        if name in b.model.weights:
            return b.weight(name, (n_experts, *shape))
        names = [b.weight(f"{prefix}.{e}.{proj}.weight", shape) for e in range(n_experts)]
        b.weights[name] = np.stack([np.asarray(b.weights.pop(n), np.float32) for n in names])
        return name

    return Experts(stacked("gate_proj", (width, hidden)), stacked("up_proj", (width, hidden)),
                   stacked("down_proj", (hidden, width)))


def route(b: GraphBuilder, i: int, x: str, router: str, *, hidden: int, n_experts: int, k: int, mode: str,
          bias: bool = False, normalize: bool = False) -> str:
    """The routes of layer i's rows: the ``router`` linear's logits, then moe_route (ir.py's modes)."""
    if not 0 < k <= n_experts:
        raise StartupError(f"{b.model.source}: {k} experts per token of {n_experts} experts")
    logits = b.linear(x, router, (n_experts, hidden), f"l{i}.router", i, bias)
    return b.emit("moe_route", (logits,), f"l{i}.routes", (), i, k=k, mode=mode, normalize=normalize)


def moe_block(b: GraphBuilder, i: int, x: str, routes: str, experts: Experts, k: int, activation: str = "silu",
              **activation_attrs: float) -> str:
    """Layer i's chosen experts on the normed input x, gated by ``activation`` (silu, as act(gate) * up, or
    clamped_swiglu); returns the combined output [T, hidden]."""

    def product(x: str, weight: str, bias: str | None, output: str, **attrs: str) -> str:
        params = (weight,) if bias is None else (weight, bias)
        return b.emit("expert_linear", (x, routes), output, params, i, k=k, **attrs)

    gate = product(x, experts.gate, experts.gate_bias, f"l{i}.gate")
    up = product(x, experts.up, experts.up_bias, f"l{i}.up")
    if activation == "clamped_swiglu":
        mixed = b.emit("clamped_swiglu", (gate, up), f"l{i}.mixed", (), i, **activation_attrs)
    else:
        mixed = b.emit("mul", (b.emit(activation, (gate,), f"l{i}.act", (), i), up), f"l{i}.mixed", (), i)
    down = product(mixed, experts.down, experts.down_bias, f"l{i}.experts_out", mlp="down")
    return b.emit("moe_combine", (down, routes), f"l{i}.mlp_out", (), i)
