"""gpt-oss: the llama decoder with biased q/k/v/o projections, attention sinks (a learned logit per head in each
softmax's denominator), sliding-window layers alternating with full ones (``layer_types``), YaRN rope, and a
mixture of experts in every layer: a biased router whose top ``num_experts_per_tok`` logits are softmaxed,
biased experts gated by the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).

Experts come in three layouts, each made [experts, out, in] here: a GGUF's ffn_{gate,up,down}_exps (imported
as ``mlp.experts.{gate,up,down}_proj``); a Hugging Face checkpoint's ``gate_up_proj`` [experts, hidden,
2 width], gate and up in alternate columns, and ``down_proj`` [experts, width, hidden] (x @ W); or OpenAI's
MXFP4 release of them, ``*_blocks`` [experts, out, in / 32, 16] (two e2m1 values a byte, the lower element in
the low nibble) and ``*_scales`` [experts, out, in / 32] (e8m0 exponents), repacked as GGUF's MXFP4 blocks."""

from __future__ import annotations

import numpy as np

from lse_core.errors import StartupError
from lse_core.graph.ir import Graph
from lse_core.model.arch import llama
from lse_core.model.arch._moe import Experts, moe_block, route
from lse_core.model.model import Model, QuantTensor, Weight


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
    shapes = {"gate": (n_experts, width, hidden), "up": (n_experts, width, hidden), "down": (n_experts, hidden, width)}
    if f"{prefix}.gate_proj.weight" in b.model.weights:   # a GGUF's, already apart and [experts, out, in]
        return Experts(**{role: b.weight(f"{prefix}.{role}_proj.weight", shape) for role, shape in shapes.items()},
                       **{f"{role}_bias": b.weight(f"{prefix}.{role}_proj.bias", shape[:2])
                          for role, shape in shapes.items()})
    gate_up = _matrices(b, f"{prefix}.gate_up_proj", (n_experts, 2 * width, hidden))
    down = _matrices(b, f"{prefix}.down_proj", shapes["down"])
    gate_up_bias = _bias(b, f"{prefix}.gate_up_proj_bias", (n_experts, 2 * width))
    laid_out: dict[str, Weight] = {
        "gate": _rows(gate_up, 0), "up": _rows(gate_up, 1), "down": down, "gate_bias": gate_up_bias[:, 0::2],
        "up_bias": gate_up_bias[:, 1::2], "down_bias": _bias(b, f"{prefix}.down_proj_bias", (n_experts, hidden)),
    }
    for role, weight in laid_out.items():
        b.weights[f"{prefix}.{role}"] = weight if isinstance(weight, QuantTensor) else np.ascontiguousarray(weight)
    return Experts(**{role: f"{prefix}.{role}" for role in laid_out})


def _matrices(b: llama.GraphBuilder, name: str, shape: tuple[int, int, int]) -> Weight:
    """The experts' matrices ``name`` as [experts, out, in] (``shape``): from MXFP4 blocks and scales, or the
    float32 tensor stored [experts, in, out]."""
    weights, n_experts, out, in_ = b.model.weights, *shape
    if f"{name}_blocks" not in weights:
        return _bias(b, name, (n_experts, in_, out)).transpose(0, 2, 1)
    blocks, scales = weights[f"{name}_blocks"], weights.get(f"{name}_scales")
    if (getattr(blocks, "dtype", None) != np.uint8 or tuple(blocks.shape) != (n_experts, out, in_ // 32, 16)
            or scales is None or getattr(scales, "dtype", None) != np.uint8
            or tuple(scales.shape) != (n_experts, out, in_ // 32)):
        raise StartupError(f"{b.model.source}: {name}_blocks and {name}_scales are not MXFP4 bytes of "
                           f"[{n_experts}, {out}, {in_ // 32}, 16] and [{n_experts}, {out}, {in_ // 32}]")
    values = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(n_experts, out, in_ // 32, 32)
    packed = values[..., :16] | (values[..., 16:] << 4)   # GGUF's order: element j low, j + 16 high
    data = np.concatenate([scales[..., None], packed], axis=-1).reshape(n_experts * out, -1)
    return QuantTensor("MXFP4", data, (n_experts, out, in_))


def _rows(gate_up: Weight, parity: int) -> Weight:
    """gate (parity 0) or up (1): the alternate rows of every expert's [2 width, in] matrix."""
    if isinstance(gate_up, QuantTensor):
        n_experts, rows, in_ = gate_up.shape
        data = gate_up.data.reshape(n_experts, rows, -1)[:, parity::2].reshape(n_experts * rows // 2, -1)
        return QuantTensor(gate_up.qtype, np.ascontiguousarray(data), (n_experts, rows // 2, in_))
    return gate_up[:, parity::2]


def _bias(b: llama.GraphBuilder, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The checked float32 tensor, left out of the graph's weights (its laid-out forms go in)."""
    array = np.asarray(b.model.weights[b.weight(name, shape)], np.float32)
    del b.weights[name]
    return array
