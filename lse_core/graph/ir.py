"""The op graph's IR: a small closed op set, nodes, and the Step every kernel reads.

Activations are 2-D float32 arrays ``[T, width]``: T is every token of the step, the rows of all
its sequences back to back (prefill chunks and single decode tokens alike). Per-token and
per-sequence facts (positions, KV slots) come from the ``Step``, not from graph values, so one
graph serves prefill and batched decode.

Op semantics (every backend implements exactly these; the numpy interpreter is the reference):

  embedding(; table)            out[t] = table[step.tokens[t]] * attrs.scale (scale may be 1.0)
  rms_norm(x; weight)           per group of attrs.group columns: x / sqrt(mean(x^2) + attrs.eps) * weight
                                (group == width for a whole row; == head_dim for per-head q/k norms;
                                weight has attrs.group entries)
  linear(x; weight[, bias])     x @ weight.T (+ bias); weight is [out, in], float32 or a QuantTensor;
                                attrs.mlp (optional): "down" for a gated MLP's down projection, whose
                                input act(gate) * up has a few large values: a device that rounds
                                activations (to int8) may keep more of their precision there
  rope(x)                       rotates each attrs.head_dim slice of every row by its token's position,
                                Hugging Face "rotate_half" layout, frequencies from rope_inv_freq(attrs)
  attention(q, k, v)            writes k, v rows into the layer's KV cache at (slot, position), then each
                                query row attends causally to its sequence's cached positions
                                [max(0, p - attrs.window + 1), p] (window 0 = unlimited), softmax scaled by
                                attrs.scale, grouped-query (head h reads kv head h // (n_heads // n_kv_heads))
  sink_attention(q, k, v; sinks)
                                attention with a learned logit per query head (sinks [n_heads]) in each
                                softmax's denominator: exp(s_j) / (sum_i exp(s_i) + exp(sinks[h])) (gpt-oss)
  silu(x), gelu(x)              elementwise; gelu is the tanh approximation
  clamped_swiglu(gate, up)      gpt-oss's gated activation: g = min(gate, attrs.limit), then
                                (clip(up, -limit, limit) + 1) * g * sigmoid(attrs.alpha * g)
  add(a, b), mul(a, b)          elementwise, same shapes
  scale(x)                      x * attrs.factor
  last_rows(x)                  x[step.sample_rows]: the rows whose logits are sampled -> [S, width]

Mixture-of-experts ops: a token's k routes (its chosen experts and their weights) are one row of a
[T, 2k] value, the experts' ids (exact float32 integers) in columns :k, their weights in k:; slot j of
a row is its j-th route. Only the chosen experts' matrices are read, each for the rows routed to it.
  moe_route(logits)             router logits [T, n_experts] -> routes [T, 2 * attrs.k]; attrs.mode
                                "softmax_topk": softmax over every expert, then the k largest
                                probabilities (divided by their sum when attrs.normalize); "topk_softmax":
                                the k largest logits, then softmax over those k. Slots in descending
                                order, the lower id first on ties
  expert_linear(x, routes; weight[, bias])
                                weight [n_experts, out, in] (float32 or a QuantTensor), bias [n_experts,
                                out]: slot j of row t is x_j @ weight[e].T (+ bias[e]), e its j-th
                                expert, x_j row t of x [T, in] or its slot j of x [T, k * in]
                                -> [T, k * out]; attrs.mlp as linear's
  moe_combine(y, routes)        y [T, k * width] -> [T, width]: the slots' rows times their weights, summed

Sampling ops, on logits [S, vocab] (row i belongs to sequence i; parameters from step.sampling).
A sequence whose parameter leaves an op off gets its row unchanged; a step runs only the sampling
groups some sequence needs (see SAMPLING_OP_NEEDED), so a request's sampling choice decides which
groups it runs:
  mask(logits)                  structured output: in the rows of sampling.constrained, a token whose bit is
                                0 in sampling.token_mask[i] (bit j % 32 of int32 word j // 32) gets -inf
  penalize(logits)              repetition penalty (divide a positive logit of a token in
                                sampling.recent, multiply a negative one), then subtract presence_penalty
                                once from each distinct token in sampling.recent
  temperature(logits)           divide the row by temperature (rows with temperature <= 0 unchanged)
  top_k(logits)                 keep the top_k largest (ties at the k-th value kept), others -inf
  top_p(logits)                 keep the smallest prefix of tokens by descending probability whose
                                mass reaches top_p (always the top token), others -inf
  min_p(logits)                 drop tokens whose probability is below min_p * the top probability
  sample(logits) -> int32 [S]   temperature <= 0: argmax (lowest id on ties); otherwise the first token
                                whose cumulative softmax probability, in token-id order, exceeds
                                sampling.uniform[i] * total
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ELEMENTWISE_OPS = frozenset({"silu", "gelu", "add", "mul", "scale"})
MOE_OPS = frozenset({"moe_route", "expert_linear", "moe_combine", "clamped_swiglu"})   # a mixture's block's
MODEL_OPS = (frozenset({"embedding", "rms_norm", "linear", "rope", "attention", "sink_attention", "last_rows"})
             | ELEMENTWISE_OPS | MOE_OPS)
SAMPLING_OPS = ("mask", "penalize", "temperature", "top_k", "top_p", "min_p", "sample")
OPS = MODEL_OPS | frozenset(SAMPLING_OPS)

# Which sequences need a sampling op: a function of the step's SamplingBatch -> bool[S].
SAMPLING_OP_NEEDED = {
    "mask": lambda s: s.constrained if s.constrained is not None else np.zeros(len(s.temperature), dtype=bool),
    "penalize": lambda s: (s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0),
    "temperature": lambda s: (s.temperature > 0) & (s.temperature != 1.0),
    "top_k": lambda s: (s.temperature > 0) & (s.top_k > 0),
    "top_p": lambda s: (s.temperature > 0) & (s.top_p < 1.0),
    "min_p": lambda s: (s.temperature > 0) & (s.min_p > 0.0),
    "sample": lambda s: np.ones(len(s.temperature), dtype=bool),
}

PENALTY_WINDOW = 64  # presence and repetition penalties look at this many most recent tokens


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    output: str
    params: tuple[str, ...] = ()          # weight names, in the order the op documents
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    layer: int = -1                       # the transformer layer, -1 outside the layers

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}")


@dataclass
class Graph:
    """A forward pass: nodes in execution order, reading ``weights`` by name. ``output`` is the
    logits value; the sampling nodes that follow it consume it and produce ``next_tokens``."""

    nodes: list[Node]
    weights: dict[str, Any]
    output: str = "logits"
    n_layers: int = 0

    def sampling_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.op in SAMPLING_OPS]


def append_sampling(graph: Graph) -> None:
    """Add the sampling chain after the logits, in the spec's order."""
    value = graph.output
    for i, op in enumerate(SAMPLING_OPS):
        out = "next_tokens" if op == "sample" else f"sampling.{i}.{op}"
        graph.nodes.append(Node(op, (value,), out))
        value = out


@dataclass
class SamplingBatch:
    """Sampling parameters of one step's sampled rows (row i = step.sample_rows[i]: a sequence's last row, or
    one of the rows its speculative proposal rides on, each sampled with its sequence's parameters)."""

    temperature: np.ndarray          # float32 [S]
    top_k: np.ndarray                # int32 [S], 0 = off
    top_p: np.ndarray                # float32 [S], 1 = off
    min_p: np.ndarray                # float32 [S], 0 = off
    repetition_penalty: np.ndarray   # float32 [S], 1 = off
    presence_penalty: np.ndarray     # float32 [S], 0 = off
    recent: np.ndarray               # int32 [S, PENALTY_WINDOW], the most recent tokens, -1 padded
    uniform: np.ndarray              # float32 [S], this step's random draw in [0, 1) per row
    constrained: np.ndarray | None = None   # bool [S], the rows the mask op rewrites; None: no row
    token_mask: np.ndarray | None = None    # int32 [S, ceil(vocab / 32)], allowed tokens as bits (after await_mask)
    mask_job: Future | None = None          # the masks, computed while the forward pass runs

    def await_mask(self) -> None:
        """Wait for token_mask (the plan calls this before the mask op; kernels then read it)."""
        if self.mask_job is not None:
            self.mask_job.result()


@dataclass
class Step:
    """One engine step: the tokens of every scheduled sequence and where they belong."""

    tokens: np.ndarray        # int32 [T]
    positions: np.ndarray     # int32 [T], each token's position in its sequence
    slots: np.ndarray         # int32 [S], each sequence's KV-cache slot
    query_starts: np.ndarray  # int32 [S + 1], sequence i's rows are query_starts[i]:query_starts[i + 1]
    sample_rows: np.ndarray   # int32 [S], the rows whose logits are sampled (a sequence's last, or each proposed one)
    sampling: SamplingBatch | None = None
    serial: int = 0           # increases every step; kernels may cache uploaded metadata by it

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_seqs(self) -> int:
        return len(self.slots)


def rope_inv_freq(attrs: dict[str, Any], n_positions: int | None = None) -> np.ndarray:
    """Inverse frequencies for a rope node: base ``theta``, ``rotary_dim`` (default head_dim), and
    Hugging Face's rope_scaling kinds ``linear``, ``llama3``, ``yarn`` and ``longrope``, or a GGUF's per-frequency
    divisors (``freq_factors``). One place, for every backend. ``n_positions`` (the context) picks
    longrope's factors: the long ones when it exceeds the trained context, as llama.cpp picks them."""
    head_dim = attrs["head_dim"]
    rotary_dim = attrs.get("rotary_dim") or head_dim
    theta = float(attrs["theta"])
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    scaling = attrs.get("scaling") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "yarn":   # frequencies between the correction range's ends blend interpolation and extrapolation
        factor, old_ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])

        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = correction_dim(float(scaling.get("beta_fast") or 32))
        high = correction_dim(float(scaling.get("beta_slow") or 1))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        high += 0.001 if low == high else 0   # no division by zero
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        inv = (inv / factor) * ramp + inv * (1 - ramp)
    elif kind in ("freq_factors", "longrope"):   # a GGUF's rope_freqs.weight; Phi-3's short/long factors
        if kind == "longrope":
            long = n_positions is not None and n_positions > int(scaling["original_max_position_embeddings"])
            factors = np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float64)
        else:
            factors = np.asarray(scaling["factors"], dtype=np.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"{len(factors)} rope frequency factors for {len(inv)} frequencies")
        inv = inv / factors
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv.astype(np.float32)


def rope_attention_factor(attrs: dict[str, Any]) -> float:
    """What a rope node's cos and sin are multiplied by (YaRN's attention factor; 1 otherwise): the rope op
    leaves it out, and an architecture folds its square into the attention's scale, as both q and k carry it."""
    scaling = attrs.get("scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:   # YaRN's equation 21
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def rope_cos_sin(attrs: dict[str, Any], n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n_positions, rotary_dim / 2] of a rope node's angles for every position, float32 as
    Hugging Face computes them; one read-only pair for every node (and plan) with the same frequencies."""
    return _cos_sin(rope_inv_freq(attrs, n_positions).tobytes(), n_positions)


@functools.lru_cache(maxsize=16)  # keyed by the frequencies' bytes: arrays do not hash
def _cos_sin(inv_freq: bytes, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(n_positions, dtype=np.float32)[:, None] * np.frombuffer(inv_freq, np.float32)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    cos.setflags(write=False)
    sin.setflags(write=False)
    return cos, sin
