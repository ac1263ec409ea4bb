"""numpy kernels for the model ops of lse_core.graph.ir, one factory per op.

A factory gets the node, its weights (float32, laid out once at compile) and the CompileContext,
and returns ``run(inputs, step) -> output`` where inputs follow ``node.inputs``. Outputs are views
of buffers kept across steps; every constant is float32 so nothing is promoted to float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lse_core.devices.hookspec import CompileContext
from lse_core.graph.ir import Node, Step, rope_inv_freq

NodeKernel = Callable[[Sequence[np.ndarray], Step], np.ndarray]


class OutputBuffer:
    """A [rows, width] array reused by every step; a step gets the view of its first n rows."""

    def __init__(self, rows: int, dtype: type = np.float32) -> None:
        self.rows, self.dtype = rows, dtype
        self.array: np.ndarray | None = None

    def take(self, n: int, width: int) -> np.ndarray:
        if self.array is None or self.array.shape[0] < n or self.array.shape[1] != width:
            self.array = np.empty((max(n, self.rows), width), self.dtype)
        return self.array[:n]


def embedding(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    (table,) = params
    scale = np.float32(node.attrs.get("scale", 1.0))
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        out = np.take(table, step.tokens, axis=0, out=buffer.take(step.n_tokens, table.shape[1]))
        if scale != 1:
            out *= scale
        return out

    return run


def rms_norm(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    (weight,) = params
    eps, group = np.float32(node.attrs["eps"]), node.attrs["group"]
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        out = buffer.take(x.shape[0], x.shape[1])
        x3, out3 = x.reshape(x.shape[0], -1, group), out.reshape(x.shape[0], -1, group)
        mean_square = np.mean(np.square(x3), axis=-1, keepdims=True)
        np.multiply(x3, 1 / np.sqrt(mean_square + eps), out=out3)
        out3 *= weight
        return out

    return run


def linear(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    weight, bias = params[0], params[1] if len(params) > 1 else None
    weight_t = weight.T  # a view: BLAS reads [out, in] transposed without a copy
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        out = np.matmul(x, weight_t, out=buffer.take(x.shape[0], weight.shape[0]))
        if bias is not None:
            out += bias
        return out

    return run


def rope(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    head_dim = node.attrs["head_dim"]
    inv_freq = rope_inv_freq(node.attrs)
    half = len(inv_freq)
    # float32 angles, as Hugging Face computes them, for every position the cache can hold
    angles = np.arange(ctx.kv_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos_table, sin_table = np.cos(angles), np.sin(angles)
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        n = x.shape[0]
        out = buffer.take(n, x.shape[1])
        x3, out3 = x.reshape(n, -1, head_dim), out.reshape(n, -1, head_dim)
        cos, sin = cos_table[step.positions][:, None, :], sin_table[step.positions][:, None, :]
        x1, x2 = x3[..., :half], x3[..., half:2 * half]
        out3[..., :half] = x1 * cos - x2 * sin
        out3[..., half:2 * half] = x2 * cos + x1 * sin
        out3[..., 2 * half:] = x3[..., 2 * half:]  # partial rotary: the rest passes through
        return out

    return run


def attention(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    n_heads, n_kv, head_dim = node.attrs["n_heads"], node.attrs["n_kv_heads"], node.attrs["head_dim"]
    group = n_heads // n_kv
    scale, window = np.float32(node.attrs["scale"]), int(node.attrs.get("window") or 0)
    # np.zeros: the OS commits pages only when a slot's positions are first written
    k_cache = np.zeros((ctx.kv_slots, ctx.kv_len, n_kv, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        q, k, v = inputs
        rows = np.diff(step.query_starts)
        row_slots = np.repeat(step.slots, rows)
        k_cache[row_slots, step.positions] = k.reshape(-1, n_kv, head_dim)
        v_cache[row_slots, step.positions] = v.reshape(-1, n_kv, head_dim)
        out = buffer.take(q.shape[0], n_heads * head_dim)
        for i, slot in enumerate(step.slots):
            r0, r1 = step.query_starts[i], step.query_starts[i + 1]
            if r0 < r1:
                out[r0:r1] = _attend(q[r0:r1], k_cache[slot], v_cache[slot], step.positions[r0:r1])
        return out

    def _attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One sequence's query rows against its cached positions [first, last]."""
        n = q.shape[0]
        last = int(positions.max())
        first = max(0, int(positions.min()) - window + 1) if window else 0
        keys, values = keys[first:last + 1], values[first:last + 1]
        # [n_kv, n * group, head_dim]: the query heads that read each kv head, row by row
        q_grouped = q.reshape(n, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, n * group, head_dim)
        scores = np.matmul(q_grouped, keys.transpose(1, 2, 0)) * scale
        if n > 1 or window:
            key_positions = np.arange(first, last + 1)
            visible = key_positions[None, :] <= positions[:, None]
            if window:
                visible &= key_positions[None, :] > positions[:, None] - window
            scores = np.where(np.repeat(visible, group, axis=0), scores, np.float32(-np.inf))
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        mixed = np.matmul(probs, values.transpose(1, 0, 2))  # [n_kv, n * group, head_dim]
        return mixed.reshape(n_kv, n, group, head_dim).transpose(1, 0, 2, 3).reshape(n, n_heads * head_dim)

    return run


def last_rows(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    buffer = OutputBuffer(ctx.kv_slots)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        return np.take(x, step.sample_rows, axis=0, out=buffer.take(len(step.sample_rows), x.shape[1]))

    return run


def _elementwise(apply: Callable[..., None]) -> Callable[[Node, list[np.ndarray], CompileContext], NodeKernel]:
    """A factory for an elementwise op: ``apply(node, out, *inputs)`` fills ``out``."""

    def factory(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
        buffer = OutputBuffer(ctx.max_tokens)

        def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
            out = buffer.take(*inputs[0].shape)
            apply(node, out, *inputs)
            return out

        return run

    return factory


def _silu(node: Node, out: np.ndarray, x: np.ndarray) -> None:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for very negative x; x / inf = 0
        np.exp(np.negative(x, out=out), out=out)
    out += np.float32(1)
    np.divide(x, out, out=out)


_GELU_C = np.float32(np.sqrt(2 / np.pi))


def _gelu(node: Node, out: np.ndarray, x: np.ndarray) -> None:
    """The tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    np.multiply(x, x, out=out)
    out *= np.float32(0.044715)
    out += np.float32(1)
    out *= x
    out *= _GELU_C
    np.tanh(out, out=out)
    out += np.float32(1)
    out *= x
    out *= np.float32(0.5)


MODEL_KERNELS: dict[str, Callable[[Node, list[np.ndarray], CompileContext], NodeKernel]] = {
    "embedding": embedding,
    "rms_norm": rms_norm,
    "linear": linear,
    "rope": rope,
    "attention": attention,
    "last_rows": last_rows,
    "silu": _elementwise(_silu),
    "gelu": _elementwise(_gelu),
    "add": _elementwise(lambda node, out, a, b: np.add(a, b, out=out)),
    "mul": _elementwise(lambda node, out, a, b: np.multiply(a, b, out=out)),
    "scale": _elementwise(lambda node, out, x: np.multiply(x, np.float32(node.attrs["factor"]), out=out)),
}
