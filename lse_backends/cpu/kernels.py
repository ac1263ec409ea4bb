"""numpy kernels for the model ops of lse_core.graph.ir, one factory per op.

A factory gets the node, its weights (float32, laid out once at compile; a wide linear's matrix and
an embedding table as .T views, see reads_transposed) and the CompileContext, and returns
``run(inputs, step) -> output`` where inputs follow ``node.inputs``. Outputs are views
of buffers kept across steps; every constant is float32 so nothing is promoted to float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import CompileContext
from lse_core.devices.host_memory import sparse_zeros
from lse_core.graph.ir import Node, Step, rope_cos_sin

NodeKernel = Callable[[Sequence[np.ndarray], Step], np.ndarray]
KernelFactory = Callable[[Node, list[np.ndarray], CompileContext], NodeKernel]


class OutputBuffer:
    """A [rows, width] array reused by every step; a step gets the view of its first n rows."""

    def __init__(self, rows: int, dtype: type = np.float32) -> None:
        self.rows, self.dtype = rows, dtype
        self.array: np.ndarray | None = None
        self._views: dict[tuple[int, int], np.ndarray] = {}  # (n, width) -> array[:n]: sliced once

    def take(self, n: int, width: int) -> np.ndarray:
        view = self._views.get((n, width))
        if view is None:
            if self.array is None or self.array.shape[0] < n or self.array.shape[1] != width:
                self.array = np.empty((max(n, self.rows), width), self.dtype)
                self._views.clear()
            view = self._views[n, width] = self.array[:n]
        return view


class PerStep:
    """``compute(step)`` once per step, shared by every kernel that holds this object (the first to
    ask computes it). The step last seen and its value are one tuple, replaced whole, so kernels on
    other threads never pair one step with another's value; holding the step keeps ``is`` exact."""

    def __init__(self, compute: Callable[[Step], Any]) -> None:
        self.compute = compute
        self._last: tuple[Step | None, Any] = (None, None)

    def __call__(self, step: Step) -> Any:
        seen, value = self._last
        if seen is not step:
            value = self.compute(step)
            self._last = (step, value)
        return value


def embedding(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    """Rows of the [vocab, width] table. It may come as the .T view of a [width, vocab] array, laid
    out for the output projection it is tied to (see reads_transposed); then the lookup gathers
    columns (np.take would copy the whole table to make it C-ordered first)."""
    (table,) = params
    scale = np.float32(node.attrs.get("scale", 1.0))
    buffer = OutputBuffer(ctx.max_tokens)
    by_rows = table.flags.c_contiguous

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        out = buffer.take(step.n_tokens, table.shape[1])
        if by_rows:
            np.take(table, step.tokens, axis=0, out=out)
        else:
            np.take(table.T, step.tokens, axis=1, out=out.T)
        if scale != 1:
            out *= scale
        return out

    return run


def rms_norm(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    (weight,) = params
    eps, group = np.float32(node.attrs["eps"]), node.attrs["group"]
    buffer = OutputBuffer(ctx.max_tokens)
    inverse_rms = OutputBuffer(ctx.max_tokens)  # [rows, groups per row]

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        n, width = x.shape
        out = buffer.take(n, width)
        if group == width:  # a whole row: no [rows, groups, group] views needed
            x3, out3, inverse = x, out, inverse_rms.take(n, 1)
        else:
            x3, out3 = x.reshape(n, -1, group), out.reshape(n, -1, group)
            inverse = inverse_rms.take(n, width // group).reshape(n, -1, 1)
        np.vecdot(x3, x3, out=inverse, keepdims=True)  # sum of squares per group
        inverse /= group
        inverse += eps
        np.sqrt(inverse, out=inverse)
        np.reciprocal(inverse, out=inverse)
        np.multiply(x3, inverse, out=out3)
        out3 *= weight
        return out

    return run


def reads_transposed(shape: tuple[int, int]) -> bool:
    """Whether a linear reads its [out, in] matrix faster stored [in, out]. A decode row is a GEMV,
    and OpenBLAS's two GEMV kernels differ: the one reading [in, out] wins when out >= in (gate and
    up 1.2x, a 49152-token output projection 1.3-1.7x, square 1.05x), the one reading [out, in] when
    out < in (down, k and v projections 1.15-1.25x); prefill's GEMM runs alike either way (within
    4%). Measured with SmolLM2-135M's shapes on Zen 3, OpenBLAS 0.3.31, 1 and 2 threads.
    An embedding table ([vocab, width]) follows the same rule, so that it and a tied output
    projection share one copy."""
    out, in_ = shape
    return out >= in_


def linear(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    """x @ weight.T: ``weight`` is [out, in], as a C array or as the .T view of an [in, out] one
    (see reads_transposed); either way ``weight.T`` is a view BLAS reads without a copy."""
    weight, bias = params[0], params[1] if len(params) > 1 else None
    weight_t = weight.T
    width = weight.shape[0]
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        out = buffer.take(x.shape[0], width)
        if ctx.deterministic:  # a GEMV per row: BLAS picks its kernel, and so its sums' order, by the row count
            for t in range(x.shape[0]):
                np.matmul(x[t], weight_t, out=out[t])
        else:
            np.matmul(x, weight_t, out=out)
        if bias is not None:
            out += bias
        return out

    return run


class RopeTable:
    """cos and signed sin of every position for one set of frequencies, as [position, 1, 2, half]
    (broadcast over heads; the axis of 2 is a head's two halves). One table serves every rope node
    with the same frequencies, and a step's rows are gathered once for all of them."""

    def __init__(self, cos: np.ndarray, sin: np.ndarray) -> None:
        self.source = (cos, sin)  # kept, so the ids this table is found by stay unique
        cos_table = np.stack([cos, cos], axis=1)[:, None]
        signed_sin_table = np.stack([-sin, sin], axis=1)[:, None]
        self.rows = PerStep(lambda step: (cos_table[step.positions], signed_sin_table[step.positions]))


_rope_tables: dict[tuple[int, int], RopeTable] = {}  # by the ids of the (cos, sin) rope_cos_sin shares


def rope(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    """rotate_half as x * cos + swap(x) * signed_sin per head: swap(x) = (x2, x1) is a view of x
    (its two halves as an axis of 2, reversed) and signed_sin = (-sin, sin), so both halves take
    three ufunc calls. (-x2) * sin == x2 * (-sin) exactly: the result is Hugging Face's to the bit."""
    head_dim = node.attrs["head_dim"]
    cos, sin = rope_cos_sin(node.attrs, ctx.kv_len)
    half = cos.shape[1]
    rotated = 2 * half  # head_dim, or less for partial rotary: the rest passes through
    table = _rope_tables.get((id(cos), id(sin)))
    if table is None:
        table = _rope_tables[id(cos), id(sin)] = RopeTable(cos, sin)
    buffer, swapped_products = OutputBuffer(ctx.max_tokens), OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        n, width = x.shape
        out = buffer.take(n, width)
        halves_shape = (n, width // head_dim, 2, half)
        if rotated == head_dim:
            x4, out4 = x.reshape(halves_shape), out.reshape(halves_shape)
        else:
            x3, out3 = x.reshape(n, -1, head_dim), out.reshape(n, -1, head_dim)
            out3[..., rotated:] = x3[..., rotated:]
            x4, out4 = x3[..., :rotated].reshape(halves_shape), out3[..., :rotated].reshape(halves_shape)
        products = swapped_products.take(n, width // head_dim * rotated).reshape(halves_shape)
        cos, signed_sin = table.rows(step)
        np.multiply(x4, cos, out=out4)
        np.multiply(x4[:, :, ::-1], signed_sin, out=products)
        out4 += products
        return out

    return run


def _sequences(step: Step) -> list[tuple[int, int, int, list[int]]]:
    """(slot, first row, end row, positions) of each sequence with rows in the step."""
    bounds, positions = step.query_starts.tolist(), step.positions.tolist()
    return [(slot, r0, r1, positions[r0:r1])
            for slot, r0, r1 in zip(step.slots.tolist(), bounds, bounds[1:]) if r0 < r1]


sequences_of = PerStep(_sequences)  # the same for every attention node of a step


Q8_0_BLOCK = 32  # values per q8_0 block, each block stored as int8s and one f16 scale (GGUF's Q8_0)


class KVCache:
    """One layer's keys (or values), [slot, kv head, position, head_dim], stored as f32, f16 or q8_0: a kv
    head's rows are one contiguous [positions, head_dim] block, which BLAS reads as it is (f32), or which is
    widened to float32 for the positions a step reads. The OS commits pages as they are first written.
    q8_0 rounds as llama.cpp's reference quantizer (and the jit device's): per block, d = max|x| / 127
    (stored f16), q = rint(x / d)."""

    def __init__(self, kind: str, shape: tuple[int, int, int, int]) -> None:
        self.kind = kind
        self.values = sparse_zeros(shape, {"f32": np.float32, "f16": np.float16, "q8_0": np.int8}[kind])
        if kind == "q8_0":
            self.scales = sparse_zeros((*shape[:-1], shape[-1] // Q8_0_BLOCK), np.float16)

    def write(self, slot: int, positions: int | list[int], rows: np.ndarray) -> None:
        """rows [n_kv, head_dim] at one position, or [n_kv, len(positions), head_dim]."""
        if self.kind != "q8_0":
            self.values[slot][:, positions] = rows
            return
        blocks = rows.reshape(*rows.shape[:-1], -1, Q8_0_BLOCK)
        scale = np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(127)
        inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
        self.values[slot][:, positions] = np.rint(blocks * inverse).reshape(rows.shape)
        self.scales[slot][:, positions] = scale[..., 0]

    def read(self, slot: int, first: int, last: int) -> np.ndarray:
        """float32 [n_kv, last - first + 1, head_dim] of positions first .. last (f32: a view of the cache)."""
        values = self.values[slot][:, first:last + 1]
        if self.kind == "f32":
            return values
        if self.kind == "f16":
            return values.astype(np.float32)
        scales = self.scales[slot][:, first:last + 1, :, None].astype(np.float32)
        return (values.reshape(*values.shape[:-1], -1, Q8_0_BLOCK) * scales).reshape(values.shape)


def attention(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    """attention, and sink_attention whose ``params`` hold the sinks (a logit per query head)."""
    n_heads, n_kv, head_dim = node.attrs["n_heads"], node.attrs["n_kv_heads"], node.attrs["head_dim"]
    group = n_heads // n_kv
    sinks = np.asarray(params[0], np.float32).reshape(n_kv, group) if params else None
    scale, window = np.float32(node.attrs["scale"]), int(node.attrs.get("window") or 0)
    k_cache = KVCache(ctx.cache_type_k, (ctx.kv_slots, n_kv, ctx.kv_len, head_dim))
    v_cache = KVCache(ctx.cache_type_v, (ctx.kv_slots, n_kv, ctx.kv_len, head_dim))
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        q, k, v = inputs
        out = buffer.take(q.shape[0], n_heads * head_dim)
        for slot, r0, r1, positions in sequences_of(step):
            if ctx.deterministic:  # each row as a decode row: the products' shapes would pick BLAS's kernels
                for r, position in zip(range(r0, r1), positions):
                    _attend(q[r:r + 1], k[r:r + 1], v[r:r + 1], slot, [position], out[r:r + 1])
            else:
                _attend(q[r0:r1], k[r0:r1], v[r0:r1], slot, positions, out[r0:r1])
        return out

    def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, slot: int, positions: list[int], out: np.ndarray) -> None:
        """One sequence: its k, v rows into its slot's cache, then its query rows against the cached
        positions [first, last]."""
        n = q.shape[0]
        if n == 1:  # a decode row: plain indexing, far cheaper than a fancy-indexed write
            last = lowest = positions[0]
            k_cache.write(slot, last, k.reshape(n_kv, head_dim))
            v_cache.write(slot, last, v.reshape(n_kv, head_dim))
        else:
            last, lowest = max(positions), min(positions)
            k_cache.write(slot, positions, k.reshape(n, n_kv, head_dim).transpose(1, 0, 2))
            v_cache.write(slot, positions, v.reshape(n, n_kv, head_dim).transpose(1, 0, 2))
        first = max(0, lowest - window + 1) if window else 0
        keys = k_cache.read(slot, first, last)[:, None]  # [n_kv, 1, t, head_dim]
        values = v_cache.read(slot, first, last)[:, None]
        # The query heads that read each kv head, as a [n_kv, group, 1, head_dim] view of a single
        # row (head h = kv * group + g): a matrix-vector product per query head, cheaper than BLAS's
        # matrix product on a [group, head_dim] matrix. Several rows: [n_kv, 1, n * group, head_dim],
        # one matrix product per kv head.
        if n == 1:
            q_grouped = q.reshape(n_kv, group, 1, head_dim)
        else:
            q_grouped = q.reshape(n, n_kv, group, head_dim).transpose(1, 0, 2, 3).reshape(n_kv, 1, n * group, head_dim)
        scores = np.matmul(q_grouped, keys.transpose(0, 1, 3, 2))
        scores *= scale
        if n > 1 or window:
            key_positions = np.arange(first, last + 1)
            query_positions = np.array(positions)[:, None]
            hidden = key_positions[None, :] > query_positions
            if window:
                hidden |= key_positions[None, :] <= query_positions - window
            np.copyto(scores.reshape(n_kv, n, group, -1), np.float32(-np.inf), where=hidden[None, :, None, :])
        top = np.maximum.reduce(scores, axis=-1, keepdims=True)
        if sinks is not None:   # each query head's sink as one more logit, in scores' layout (see q_grouped)
            sink = sinks[:, :, None, None] if n == 1 else np.tile(sinks[:, None, :], (1, n, 1)).reshape(n_kv, 1, -1, 1)
            np.maximum(top, sink, out=top)
        scores -= top
        probs = np.exp(scores, out=scores)
        total = np.add.reduce(probs, axis=-1, keepdims=True)
        if sinks is not None:
            total += np.exp(sink - top)
        probs /= total
        if n == 1:
            np.matmul(probs, values, out=out.reshape(n_kv, group, 1, head_dim))
        else:
            mixed = np.matmul(probs, values)  # [n_kv, 1, n * group, head_dim]
            out.reshape(n, n_kv, group, head_dim)[...] = mixed.reshape(n_kv, n, group, head_dim).transpose(1, 0, 2, 3)

    return run


def last_rows(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
    buffer = OutputBuffer(ctx.kv_slots)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        return np.take(x, step.sample_rows, axis=0, out=buffer.take(len(step.sample_rows), x.shape[1]))

    return run


def _elementwise(apply: Callable[..., None]) -> KernelFactory:
    """A factory for an elementwise op: ``apply(node, out, *inputs)`` fills the output buffer."""

    def factory(node: Node, params: list[np.ndarray], ctx: CompileContext) -> NodeKernel:
        buffer = OutputBuffer(ctx.max_tokens)

        def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
            out = buffer.take(*inputs[0].shape)
            apply(node, out, *inputs)
            return out

        return run

    return factory


def _silu(node: Node, out: np.ndarray, x: np.ndarray) -> None:
    """x / (1 + exp(-x)), with -x clamped at 88 so exp stays inside float32's range (no overflow
    warning to silence, which np.errstate would, at a cost every call): for x < -88 the result is
    below 1e-36 either way."""
    np.negative(x, out=out)
    np.minimum(out, _EXP_LIMIT, out=out)
    np.exp(out, out=out)
    out += _ONE
    np.divide(x, out, out=out)


_EXP_LIMIT, _ONE = np.float32(88), np.float32(1)
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


MODEL_KERNELS: dict[str, KernelFactory] = {
    "embedding": embedding,
    "rms_norm": rms_norm,
    "linear": linear,
    "rope": rope,
    "attention": attention,
    "sink_attention": attention,
    "last_rows": last_rows,
    "silu": _elementwise(_silu),
    "gelu": _elementwise(_gelu),
    "add": _elementwise(lambda node, out, a, b: np.add(a, b, out=out)),
    "mul": _elementwise(lambda node, out, a, b: np.multiply(a, b, out=out)),
    "scale": _elementwise(lambda node, out, x: np.multiply(x, np.float32(node.attrs["factor"]), out=out)),
}
