"""The hrx device: its memory is ``HrxBuffer`` (the host touches it only through to_device / to_host,
as with a real accelerator's memory) and its kernels are numpy, one per op it supports. Everything
here follows the op semantics documented in lse_core/graph/ir.py.

A real plugin keeps this shape: ``compile`` checks the group against the kernel set and answers
``"no kernel for <op>"`` for the first op it lacks, uploads the weights the group reads (once), and
returns a closure; the closure takes device buffers in ``group.inputs`` order and the host-side Step,
and returns device buffers in ``group.outputs`` order."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import CompileContext, Device, DeviceInfo, Kernel
from lse_core.devices.host_memory import sparse_zeros
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Node, Step, rope_inv_freq


class HrxBuffer:
    """A tensor in hrx memory."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


Body = Callable[[Sequence[np.ndarray], Step], list[np.ndarray]]

# Elementwise ops the hrx code generator can emit; silu and gelu are missing on purpose.
ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add, "mul": np.multiply,
    "silu": lambda x: x / (np.float32(1) + np.exp(-x)),
    "gelu": lambda x: np.float32(0.5) * x * (np.float32(1) + np.tanh(
        np.float32(0.7978845608028654) * (x + np.float32(0.044715) * x * x * x))),
}


def fused_elementwise(group: FusedGroup) -> Body:
    """The hrx "code generator": the group's nodes become one straight-line program over its values."""
    program = [(ELEMENTWISE[n.op], n.inputs, n.output) for n in group.nodes]

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        values = dict(zip(group.inputs, inputs, strict=True))
        for fn, args, out in program:
            values[out] = fn(*(values[v] for v in args))
        return [values[v] for v in group.outputs]

    return run


def embedding(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    (table,) = params
    scale = np.float32(node.attrs.get("scale", 1.0))
    return lambda inputs, step: [table[step.tokens] * scale]


def rms_norm(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    (weight,) = params
    group, eps = node.attrs["group"], np.float32(node.attrs["eps"])

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        (x,) = inputs
        groups = x.reshape(x.shape[0], -1, group)
        normed = groups / np.sqrt(np.mean(groups * groups, axis=-1, keepdims=True) + eps) * weight
        return [normed.reshape(x.shape)]

    return run


def linear(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    weight, bias = params[0], params[1] if len(params) > 1 else np.float32(0)
    return lambda inputs, step: [inputs[0] @ weight.T + bias]


def rope(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    head_dim, inv_freq = node.attrs["head_dim"], rope_inv_freq(node.attrs, ctx.kv_len)
    half = len(inv_freq)

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        (x,) = inputs
        heads = x.reshape(x.shape[0], -1, head_dim)
        angles = step.positions.astype(np.float32)[:, None, None] * inv_freq   # float32, as in Hugging Face
        cos, sin = np.cos(angles), np.sin(angles)
        x1, x2 = heads[..., :half], heads[..., half:2 * half]
        out = heads.copy()   # a partial rotary's remaining dims pass through
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:2 * half] = x2 * cos + x1 * sin
        return [out.reshape(x.shape)]

    return run


def attention(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    n_heads, n_kv, head_dim = node.attrs["n_heads"], node.attrs["n_kv_heads"], node.attrs["head_dim"]
    scale, window = np.float32(node.attrs["scale"]), int(node.attrs.get("window") or 0)
    # this layer's KV cache, in device memory for as long as the kernel lives
    k_cache = sparse_zeros((ctx.kv_slots, ctx.kv_len, n_kv, head_dim))
    v_cache = sparse_zeros(k_cache.shape)

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        q, k, v = inputs
        token_slots = np.repeat(step.slots, np.diff(step.query_starts))
        k_cache[token_slots, step.positions] = k.reshape(-1, n_kv, head_dim)
        v_cache[token_slots, step.positions] = v.reshape(-1, n_kv, head_dim)
        out = np.empty((q.shape[0], n_heads, head_dim), np.float32)
        for t, (slot, p) in enumerate(zip(token_slots, step.positions, strict=True)):
            first = max(0, p - window + 1) if window else 0
            keys = np.repeat(k_cache[slot, first:p + 1], n_heads // n_kv, axis=1)     # [L, n_heads, hd]
            values = np.repeat(v_cache[slot, first:p + 1], n_heads // n_kv, axis=1)
            scores = np.einsum("hd,lhd->hl", q[t].reshape(n_heads, head_dim), keys) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[t] = np.einsum("hl,lhd->hd", weights / weights.sum(axis=1, keepdims=True), values)
        return [out.reshape(q.shape[0], -1)]

    return run


def last_rows(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    return lambda inputs, step: [inputs[0][step.sample_rows]]


def mask(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    """Structured output: a constrained row keeps only the tokens whose bit is set in its mask."""
    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        logits = inputs[0].copy()
        s = step.sampling
        for i in np.flatnonzero(s.constrained):
            allowed = np.unpackbits(s.token_mask[i].view(np.uint8), bitorder="little")[:logits.shape[1]]
            logits[i, allowed == 0] = -np.inf
        return [logits]

    return run


def sample(node: Node, params: list[np.ndarray], ctx: CompileContext) -> Body:
    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        (logits,) = inputs
        tokens = np.argmax(logits, axis=1).astype(np.int32)   # greedy; argmax takes the lowest id on ties
        s = step.sampling
        for i in np.flatnonzero(s.temperature > 0):
            cumulative = np.cumsum(np.exp(logits[i] - logits[i].max()))
            drawn = np.searchsorted(cumulative, s.uniform[i] * cumulative[-1], side="right")
            tokens[i] = min(int(drawn), len(cumulative) - 1)
        return [tokens]

    return run


KERNELS: dict[str, Callable[[Node, list[np.ndarray], CompileContext], Body]] = {
    "embedding": embedding, "rms_norm": rms_norm, "linear": linear, "rope": rope,
    "attention": attention, "last_rows": last_rows, "mask": mask, "sample": sample,
}
# The kernel set is deliberately partial, so LSE's CPU fallback runs end to end: HRX_MISSING names
# implemented ops to leave out as well (comma-separated; default "silu,gelu").
def supported() -> frozenset[str]:
    missing = {op.strip() for op in os.environ.get("HRX_MISSING", "silu,gelu").split(",")}
    return (frozenset(KERNELS) | frozenset(ELEMENTWISE)) - missing


class HrxDevice(Device):
    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self._weights: dict[int, tuple[Any, np.ndarray]] = {}   # id(host weight) -> (weight, device copy)

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        available = supported()
        missing = next((op for op in group.ops if op not in available), None)
        if missing is not None:
            return f"no kernel for {missing}"
        if group.ops[0] in ELEMENTWISE:
            body = fused_elementwise(group)
        else:
            node = group.nodes[0]
            body = KERNELS[node.op](node, [self.upload(weights[p]) for p in node.params], ctx)

        def kernel(args: Sequence[HrxBuffer], step: Step) -> list[HrxBuffer]:
            return [HrxBuffer(out) for out in body([b.array for b in args], step)]

        return kernel

    def upload(self, weight: Any) -> np.ndarray:
        """A weight in device memory as float32, once however many groups read it (tied embeddings);
        a quantized weight (anything with ``dequantize``) is dequantized on the way."""
        if id(weight) not in self._weights:
            host = weight.dequantize() if hasattr(weight, "dequantize") else weight
            self._weights[id(weight)] = (weight, np.array(host, dtype=np.float32))
        return self._weights[id(weight)][1]

    def to_device(self, array: np.ndarray) -> HrxBuffer:
        return HrxBuffer(np.array(array, copy=True))

    def to_host(self, buffer: HrxBuffer) -> np.ndarray:
        return np.array(buffer.array, copy=True)

    def close(self) -> None:
        self._weights.clear()
