"""Gemma 3 (text) as an op graph, built from llama's pieces.

    h = embed(tokens) * sqrt(hidden)
    per layer:  h = h + post_attn_norm(o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)))  on input_norm(h)
                h = h + post_ffn_norm(down(gelu_tanh(gate(n)) * up(n)))                  n = pre_ffn_norm(h)
    logits = embed^T(final_norm(h)[sample rows])

Sliding-window layers use the local rope base; global layers the global base with any rope scaling.
Every Gemma norm multiplies by (1 + weight): the 1 is added once here, into float32 weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from lse_core.errors import StartupError
from lse_core.graph import ir
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> ir.Graph:
    for softcap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if model.config.get(softcap) is not None:
            raise StartupError(f"{model.source}: config.json {softcap} (Gemma 2 style) is not supported")
    args = llama.ModelArgs.from_config(model)
    global_rope, local_rope = _rope_attrs(model, args)
    eps, hidden = args.rms_norm_eps, args.hidden_size
    b = llama.GraphBuilder(model)

    def norm(x: str, name: str, output: str, layer: int) -> str:
        out = b.rms_norm(x, name, hidden, eps, output, layer)
        _fold_one(b, name)
        return out

    embed = b.weight("model.embed_tokens.weight", (args.vocab_size, hidden))
    h = b.emit("embedding", (), "embed", (embed,), scale=float(np.float32(math.sqrt(hidden))))
    # llama's attention scales scores by head_dim^-0.5; Gemma scales by query_pre_attn_scalar^-0.5.
    # q_norm's weight multiplies every query, so it carries the ratio (1 for the 270M model).
    query_ratio = math.sqrt(args.head_dim / float(model.config.get("query_pre_attn_scalar") or args.head_dim))
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        layer_args = dataclasses.replace(args, rope=local_rope if args.windows[i] else global_rope)
        n = norm(h, f"{p}.input_layernorm.weight", f"l{i}.attn_norm", i)
        attn = llama.attention_block(b, layer_args, i, n, qkv_bias=args.attention_bias, qk_norm=True)
        _fold_one(b, f"{p}.self_attn.q_norm.weight", query_ratio)
        _fold_one(b, f"{p}.self_attn.k_norm.weight")
        attn = norm(attn, f"{p}.post_attention_layernorm.weight", f"l{i}.attn_post", i)
        h = b.emit("add", (h, attn), f"l{i}.h_attn", (), i)
        n = norm(h, f"{p}.pre_feedforward_layernorm.weight", f"l{i}.mlp_norm", i)
        mlp = llama.mlp_block(b, args, i, n, activation="gelu")
        mlp = norm(mlp, f"{p}.post_feedforward_layernorm.weight", f"l{i}.mlp_post", i)
        h = b.emit("add", (h, mlp), f"l{i}.out", (), i)
    n = norm(h, "model.norm.weight", "final_norm", -1)
    rows = b.emit("last_rows", (n,), "last_rows")
    b.emit("linear", (rows,), "logits", (embed,))   # Gemma ties the output matrix to the embedding
    return b.graph(args.num_hidden_layers)


def _fold_one(b: llama.GraphBuilder, name: str, factor: float = 1.0) -> None:
    """Gemma's norm scales by (1 + w): store (1 + w) * factor once, so rms_norm stays plain."""
    b.weights[name] = ((np.asarray(b.weights[name], dtype=np.float32) + np.float32(1.0))
                       * np.float32(factor))


def _rope_attrs(model: Model, args: llama.ModelArgs) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rope attrs of global and sliding layers, from transformers 5's per-layer-type
    ``rope_parameters`` or the older rope_theta + rope_scaling (llama's reading) + rope_local_base_freq."""
    params = model.config.get("rope_parameters") or {}
    if "full_attention" in params:
        full = params["full_attention"]
        global_rope = dict(args.rope, theta=float(full["rope_theta"]), scaling=full)
        local_theta = (params.get("sliding_attention") or {}).get("rope_theta", 10000.0)
        try:
            ir.rope_inv_freq(global_rope)
        except (ValueError, KeyError) as e:
            raise StartupError(f"{model.source}: config.json rope settings are not supported: {e}") from None
    else:
        global_rope, local_theta = args.rope, model.config.get("rope_local_base_freq", 10000.0)
    return global_rope, dict(args.rope, theta=float(local_theta), scaling=None)
