"""Phi-3 / Phi-3.5 / Phi-4-mini: llama's decoder with q, k and v in one matrix (qkv_proj) and gate and
up in one (gate_up_proj), split here into llama's names as views; optional partial rotary and longrope.

LongRoPE divides the frequencies by short or long factors (the long ones once the context passes the
trained one, see ir.rope_inv_freq) and scales cos and sin by an attention factor, so the rotated part
of each query and key head comes out that much larger. Rotation is linear, so the factor is folded
into the q and k rows that feed the rotated dimensions.
"""

from __future__ import annotations

import dataclasses
import math
from collections import ChainMap
from typing import Any

import numpy as np

from lse_core.graph import ir
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> ir.Graph:
    args = llama.ModelArgs.from_config(model)
    hd, inter = args.head_dim, args.intermediate_size
    q_width, kv_width = args.num_attention_heads * hd, args.num_key_value_heads * hd
    factor = _attention_factor(model.config, args.rope.get("scaling"))
    split: dict[str, Any] = {}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        qkv = model.weights[f"{p}.self_attn.qkv_proj.weight"]
        q, k = qkv[:q_width], qkv[q_width:q_width + kv_width]
        split[f"{p}.self_attn.q_proj.weight"] = _scale_rotated(q, hd, args.rope["rotary_dim"], factor)
        split[f"{p}.self_attn.k_proj.weight"] = _scale_rotated(k, hd, args.rope["rotary_dim"], factor)
        split[f"{p}.self_attn.v_proj.weight"] = qkv[q_width + kv_width:q_width + 2 * kv_width]
        gate_up = model.weights[f"{p}.mlp.gate_up_proj.weight"]
        split[f"{p}.mlp.gate_proj.weight"], split[f"{p}.mlp.up_proj.weight"] = gate_up[:inter], gate_up[inter:]
    return llama.build(dataclasses.replace(model, weights=ChainMap(split, model.weights)))


def _scale_rotated(w: np.ndarray, head_dim: int, rotary_dim: int, factor: float) -> np.ndarray:
    """``w``'s rows that feed each head's first ``rotary_dim`` dimensions, times ``factor`` (a copy)."""
    if factor == 1.0:
        return w
    heads = np.array(w, dtype=np.float32).reshape(-1, head_dim, w.shape[-1])
    heads[:, :rotary_dim] *= np.float32(factor)
    return heads.reshape(w.shape)


def _attention_factor(config: dict, scaling: dict | None) -> float:
    """LongRoPE's cos/sin scale: given, or sqrt(1 + ln(factor) / ln(trained context)) as transformers sets it."""
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config["max_position_embeddings"] / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
