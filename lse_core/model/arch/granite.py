"""IBM Granite 3.x: llama's decoder with four multipliers from config.json.

    h = embed(tokens) * embedding_multiplier
    per layer:  h = h + residual_multiplier * attention(...)      scores scaled by attention_multiplier
                h = h + residual_multiplier * mlp(...)
    logits = lm_head(rms_norm(h)) / logits_scaling                folded into the final norm's weight
"""

from __future__ import annotations

import numpy as np

from lse_core.graph import ir
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> ir.Graph:
    config = model.config
    args = llama.ModelArgs.from_config(model)
    residual = float(config.get("residual_multiplier", 1.0))
    eps, hidden = args.rms_norm_eps, args.hidden_size
    b = llama.GraphBuilder(model)
    embed = b.weight("model.embed_tokens.weight", (args.vocab_size, hidden))
    h = b.emit("embedding", (), "embed", (embed,), scale=float(config.get("embedding_multiplier", 1.0)))
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        n = b.rms_norm(h, f"{p}.input_layernorm.weight", hidden, eps, f"l{i}.attn_norm", i)
        attn = llama.attention_block(b, args, i, n, qkv_bias=args.attention_bias, qk_norm=False,
                                     scale=float(config.get("attention_multiplier", args.head_dim ** -0.5)))
        attn = b.emit("scale", (attn,), f"l{i}.attn_scaled", (), i, factor=residual)
        h = b.emit("add", (h, attn), f"l{i}.h_attn", (), i)
        n = b.rms_norm(h, f"{p}.post_attention_layernorm.weight", hidden, eps, f"l{i}.mlp_norm", i)
        mlp = b.emit("scale", (llama.mlp_block(b, args, i, n),), f"l{i}.mlp_scaled", (), i, factor=residual)
        h = b.emit("add", (h, mlp), f"l{i}.out", (), i)
    n = b.rms_norm(h, "model.norm.weight", hidden, eps, "final_norm", -1)
    # the norm's output feeds only lm_head, which is linear: dividing the norm's weight divides the logits
    b.weights["model.norm.weight"] = (np.asarray(b.weights["model.norm.weight"], dtype=np.float32)
                                      / np.float32(config.get("logits_scaling", 1.0)))
    rows = b.emit("last_rows", (n,), "last_rows")
    tied = args.tie_word_embeddings or "lm_head.weight" not in model.weights
    head = embed if tied else b.weight("lm_head.weight", (args.vocab_size, hidden))
    b.emit("linear", (rows,), "logits", (head,))
    return b.graph(args.num_hidden_layers)
