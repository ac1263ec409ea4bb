"""Llama (SmolLM2 and the Llama 2/3 family) as an op graph; qwen2, qwen3, mistral, granite, phi3 and smollm3
reuse it, gemma3 its layers.

    h = embed(tokens)
    per layer:  h = h + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(h)
                h = h + down_proj(silu(gate_proj(n)) * up_proj(n))                       n = rms_norm(h)
    logits = lm_head(rms_norm(h)[sample rows])

Granite's multipliers, where config.json has them, scale the embedding, the attention scores, each
attention and MLP output before it is added, and the logits (ModelArgs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lse_core.errors import StartupError
from lse_core.graph import ir
from lse_core.model.model import Model


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: dict[str, Any]          # attrs of the rope nodes: head_dim, theta, scaling, rotary_dim
    attention_bias: bool          # q/k/v/o projections carry biases
    mlp_bias: bool
    tie_word_embeddings: bool
    windows: list[int]            # per layer: sliding-window length, 0 for full attention
    # Granite's multipliers (1, and head_dim^-0.5 for the attention, where config.json has none)
    embedding_scale: float        # embedding_multiplier
    attention_scale: float        # attention_multiplier
    residual_scale: float         # residual_multiplier: on each attention and MLP output
    logits_scale: float           # 1 / logits_scaling

    @classmethod
    def from_config(cls, model: Model) -> ModelArgs:
        config = model.config

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise StartupError(f"{model.source}: config.json has no {key!r} (needed by {model.architecture})")
            return config[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        head_dim = int(config.get("head_dim") or hidden // heads)
        n_layers = int(need("num_hidden_layers"))
        rope = rope_attrs(model, head_dim)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope=rope,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            windows=layer_windows(config, n_layers),
            embedding_scale=float(config.get("embedding_multiplier", 1.0)),
            # YaRN's attention factor multiplies q's and k's rotations alike: its square, the scores
            attention_scale=float(config.get("attention_multiplier") or head_dim ** -0.5)
            * ir.rope_attention_factor(rope) ** 2,
            residual_scale=float(config.get("residual_multiplier", 1.0)),
            logits_scale=1.0 / float(config.get("logits_scaling", 1.0)),
        )


def rope_attrs(model: Model, head_dim: int) -> dict[str, Any]:
    """Rope settings from either config spelling: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``. Unsupported scaling kinds fail at load, not at the first step."""
    config = model.config
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = config.get("rope_theta", 10000.0), config.get("rope_scaling")
    if isinstance(scaling, dict) and "original_max_position_embeddings" in config:   # Phi-3 keeps it outside
        scaling = {"original_max_position_embeddings": config["original_max_position_embeddings"], **scaling}
    rotary = float((scaling or {}).get("partial_rotary_factor") or config.get("partial_rotary_factor", 1.0))
    attrs = {"head_dim": head_dim, "theta": float(theta), "scaling": scaling, "rotary_dim": int(head_dim * rotary)}
    try:
        for n_positions in (None, 2**31):   # both of longrope's factor sets
            ir.rope_inv_freq(attrs, n_positions)
    except (ValueError, KeyError) as e:
        raise StartupError(f"{model.source}: config.json rope settings are not supported: {e}") from None
    return attrs


def layer_windows(config: dict[str, Any], n_layers: int) -> list[int]:
    """Sliding-window length per layer from ``layer_types`` (transformers 5), Qwen2's older
    ``use_sliding_window`` + ``max_window_layers``, or else Mistral's ``sliding_window`` alone, which
    bounds every layer; 0 means the layer attends to the whole context."""
    window = int(config.get("sliding_window") or 0)
    types = config.get("layer_types")
    if types:
        return [window if t == "sliding_attention" else 0 for t in types[:n_layers]]
    if "use_sliding_window" in config:
        on = bool(config["use_sliding_window"])
        return [window if on and i >= int(config.get("max_window_layers", 0)) else 0 for i in range(n_layers)]
    return [window] * n_layers


class GraphBuilder:
    """Collects nodes, and the weights they read after checking each against its config shape."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.nodes: list[ir.Node] = []
        self.weights: dict[str, Any] = {}

    def weight(self, name: str, shape: tuple[int, ...]) -> str:
        tensor = self.model.weights.get(name)
        if tensor is None:
            raise StartupError(f"{self.model.source}: tensor {name!r} is missing "
                               f"({self.model.architecture} needs it)")
        if tuple(tensor.shape) != shape:
            raise StartupError(f"{self.model.source}: tensor {name!r} has shape {list(tensor.shape)}, "
                               f"but config.json implies {list(shape)}")
        if getattr(tensor, "dtype", None) == np.uint8:   # safetensors U8: packed bytes, no float weights
            raise StartupError(f"{self.model.source}: tensor {name!r} holds bytes (U8), not weights")
        self.weights[name] = tensor
        return name

    def emit(self, op: str, inputs: tuple[str, ...], output: str, params: tuple[str, ...] = (),
             layer: int = -1, **attrs: Any) -> str:
        self.nodes.append(ir.Node(op, inputs, output, params, attrs, layer))
        return output

    def linear(self, x: str, name: str, shape: tuple[int, int], output: str, layer: int, bias: bool,
               **attrs: Any) -> str:
        params = (self.weight(f"{name}.weight", shape),)
        if bias:
            params += (self.weight(f"{name}.bias", (shape[0],)),)
        return self.emit("linear", (x,), output, params, layer, **attrs)

    def rms_norm(self, x: str, name: str, width: int, eps: float, output: str, layer: int) -> str:
        return self.emit("rms_norm", (x,), output, (self.weight(name, (width,)),), layer, eps=eps, group=width)

    def graph(self, n_layers: int) -> ir.Graph:
        graph = ir.Graph(self.nodes, self.weights, "logits", n_layers)
        ir.append_sampling(graph)
        return graph


def attention_block(b: GraphBuilder, args: ModelArgs, i: int, x: str, *, qkv_bias: bool, qk_norm: bool,
                    rope: bool = True, sinks: bool = False) -> str:
    """Self-attention of layer i on the normed input x; returns the o_proj output. ``rope`` False leaves
    q and k unrotated (SmolLM3's NoPE layers); ``sinks`` adds gpt-oss's learned logit per head to the
    softmax's denominator."""
    p, hd = f"model.layers.{i}.self_attn", args.head_dim
    q_width, kv_width = args.num_attention_heads * hd, args.num_key_value_heads * hd
    q = b.linear(x, f"{p}.q_proj", (q_width, args.hidden_size), f"l{i}.q", i, qkv_bias)
    k = b.linear(x, f"{p}.k_proj", (kv_width, args.hidden_size), f"l{i}.k", i, qkv_bias)
    v = b.linear(x, f"{p}.v_proj", (kv_width, args.hidden_size), f"l{i}.v", i, qkv_bias)
    if qk_norm:  # Qwen3: rms_norm over each head of q and k before rope
        q = b.emit("rms_norm", (q,), f"l{i}.q_normed", (b.weight(f"{p}.q_norm.weight", (hd,)),), i,
                   eps=args.rms_norm_eps, group=hd)
        k = b.emit("rms_norm", (k,), f"l{i}.k_normed", (b.weight(f"{p}.k_norm.weight", (hd,)),), i,
                   eps=args.rms_norm_eps, group=hd)
    if rope:
        q = b.emit("rope", (q,), f"l{i}.q_rope", (), i, **args.rope)
        k = b.emit("rope", (k,), f"l{i}.k_rope", (), i, **args.rope)
    op, params = "attention", ()
    if sinks:
        op, params = "sink_attention", (b.weight(f"{p}.sinks", (args.num_attention_heads,)),)
    attn = b.emit(op, (q, k, v), f"l{i}.attn", params, i, n_heads=args.num_attention_heads,
                  n_kv_heads=args.num_key_value_heads, head_dim=hd, scale=args.attention_scale,
                  window=args.windows[i])
    return b.linear(attn, f"{p}.o_proj", (args.hidden_size, q_width), f"l{i}.attn_out", i, args.attention_bias)


def mlp_block(b: GraphBuilder, args: ModelArgs, i: int, x: str, activation: str = "silu") -> str:
    """Gated MLP of layer i on the normed input x: down(act(gate(x)) * up(x))."""
    p, shape = f"model.layers.{i}.mlp", (args.intermediate_size, args.hidden_size)
    gate = b.linear(x, f"{p}.gate_proj", shape, f"l{i}.gate", i, args.mlp_bias)
    up = b.linear(x, f"{p}.up_proj", shape, f"l{i}.up", i, args.mlp_bias)
    act = b.emit(activation, (gate,), f"l{i}.act", (), i)
    mixed = b.emit("mul", (act, up), f"l{i}.mixed", (), i)
    return b.linear(mixed, f"{p}.down_proj", shape[::-1], f"l{i}.mlp_out", i, args.mlp_bias, mlp="down")


MlpBlock = Callable[[GraphBuilder, ModelArgs, int, str], str]


def build(model: Model, *, qkv_bias: bool | None = None, qk_norm: bool = False,
          rope_layers: list[bool] | None = None, mlp: MlpBlock = mlp_block, sinks: bool = False) -> ir.Graph:
    """The forward graph. ``qkv_bias`` overrides config.json's attention_bias for q/k/v (Qwen2 always
    has them); ``qk_norm`` adds Qwen3's per-head norms; ``rope_layers`` says which layers rotate q and k
    (all by default); ``mlp`` builds each layer's feed-forward block (a mixture of experts's, say); ``sinks``
    gives every attention gpt-oss's sinks."""
    args = ModelArgs.from_config(model)
    b = GraphBuilder(model)

    def residual(x: str, i: int) -> str:
        if args.residual_scale == 1.0:
            return x
        return b.emit("scale", (x,), f"{x}_scaled", (), i, factor=args.residual_scale)

    embed = b.weight("model.embed_tokens.weight", (args.vocab_size, args.hidden_size))
    h = b.emit("embedding", (), "embed", (embed,), scale=args.embedding_scale)
    for i in range(args.num_hidden_layers):
        n = b.rms_norm(h, f"model.layers.{i}.input_layernorm.weight", args.hidden_size, args.rms_norm_eps,
                       f"l{i}.attn_norm", i)
        attn = attention_block(b, args, i, n, qkv_bias=args.attention_bias if qkv_bias is None else qkv_bias,
                               qk_norm=qk_norm, rope=rope_layers is None or rope_layers[i], sinks=sinks)
        h = b.emit("add", (h, residual(attn, i)), f"l{i}.h_attn", (), i)
        n = b.rms_norm(h, f"model.layers.{i}.post_attention_layernorm.weight", args.hidden_size,
                       args.rms_norm_eps, f"l{i}.mlp_norm", i)
        h = b.emit("add", (h, residual(mlp(b, args, i, n), i)), f"l{i}.out", (), i)
    n = b.rms_norm(h, "model.norm.weight", args.hidden_size, args.rms_norm_eps, "final_norm", -1)
    if args.logits_scale != 1.0:  # the norm's output feeds only lm_head, which is linear
        b.weights["model.norm.weight"] = (np.asarray(b.weights["model.norm.weight"], np.float32)
                                          * np.float32(args.logits_scale))
    rows = b.emit("last_rows", (n,), "last_rows")
    tied = args.tie_word_embeddings or "lm_head.weight" not in model.weights
    head = embed if tied else b.weight("lm_head.weight", (args.vocab_size, args.hidden_size))
    b.emit("linear", (rows,), "logits", (head,))
    return b.graph(args.num_hidden_layers)
