"""SmolLM3: llama's decoder where some layers use no position encoding at all (NoPE): config.json's
no_rope_layers holds 1 for a layer that rotates q and k, 0 for one that does not."""

from __future__ import annotations

from lse_core.errors import StartupError
from lse_core.graph import ir
from lse_core.model.arch import llama
from lse_core.model.model import Model


def build(model: Model) -> ir.Graph:
    n_layers = int(model.config.get("num_hidden_layers") or 0)
    flags = model.config.get("no_rope_layers")
    if flags is None:   # transformers' default: every no_rope_layer_interval-th layer has no rope
        interval = int(model.config.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(flags) < n_layers:
        raise StartupError(f"{model.source}: config.json no_rope_layers has {len(flags)} entries for {n_layers} layers")
    return llama.build(model, rope_layers=[bool(f) for f in flags[:n_layers]])
