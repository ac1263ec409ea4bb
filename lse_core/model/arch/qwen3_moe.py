"""Qwen3-MoE: Qwen3's decoder (q/k norms) whose feed-forward blocks are mixtures of experts: a softmax
router over every expert, the top ``num_experts_per_tok`` renormalised when ``norm_topk_prob``, SwiGLU
experts of ``moe_intermediate_size``. A layer in ``mlp_only_layers``, or off the ``decoder_sparse_step``
grid, keeps a dense MLP of ``intermediate_size``, as transformers builds it."""

from __future__ import annotations

from lse_core.errors import StartupError
from lse_core.graph.ir import Graph
from lse_core.model.arch import llama
from lse_core.model.arch._moe import moe_block, route, stacked_experts
from lse_core.model.model import Model


def build(model: Model) -> Graph:
    config = model.config
    # transformers 5 writes num_experts as num_local_experts
    n_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if n_experts and not config.get("num_experts_per_tok"):
        raise StartupError(f"{model.source}: config.json has no 'num_experts_per_tok' (needed by qwen3_moe)")
    if n_experts and not config.get("moe_intermediate_size"):
        raise StartupError(f"{model.source}: config.json has no 'moe_intermediate_size' (needed by qwen3_moe)")
    sparse_step = int(config.get("decoder_sparse_step") or 1)
    dense_layers = set(config.get("mlp_only_layers") or ())

    def mlp(b: llama.GraphBuilder, args: llama.ModelArgs, i: int, x: str) -> str:
        if not n_experts or i in dense_layers or (i + 1) % sparse_step:
            return llama.mlp_block(b, args, i, x)
        k = int(config["num_experts_per_tok"])
        routes = route(b, i, x, f"model.layers.{i}.mlp.gate", hidden=args.hidden_size, n_experts=n_experts,
                       k=k, mode="softmax_topk", normalize=bool(config.get("norm_topk_prob", False)))
        experts = stacked_experts(b, i, n_experts, int(config["moe_intermediate_size"]), args.hidden_size)
        return moe_block(b, i, x, routes, experts, k)

    return llama.build(model, qk_norm=True, mlp=mlp)
