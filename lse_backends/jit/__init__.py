"""The numba JIT CPU device, jit:0: quantized linears that read GGUF blocks in place (quant.py),
compiled kernels for the other ops (kernels.py, sampling.py) and a code generator for fused
elementwise groups (codegen.py). Arrays live in host memory, so moving to and from it is free."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import Backend, CompileContext, Device, DeviceInfo, Kernel, hookimpl
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import SAMPLING_OP_NEEDED, Node, Step, rope_inv_freq

try:
    import numba
except ImportError as e:  # the backend declines; lse_core reports the reason
    numba = None
    _MISSING = f"numba is not installed ({e})"

NodeRunner = Callable[[Sequence[np.ndarray], Step], np.ndarray]


class Buffer:
    """A [rows, width] array kept across steps; a step gets the view of its first n rows."""

    def __init__(self, rows: int, width: int, dtype: type = np.float32) -> None:
        self.array = np.empty((rows, width), dtype)

    def take(self, n: int) -> np.ndarray:
        if n > self.array.shape[0]:
            self.array = np.empty((n, self.array.shape[1]), self.array.dtype)
        return self.array[:n]


class JitDevice(Device):
    """jit:0. A kernel per group: the generated function of an elementwise group, else the op's
    compiled kernel, with outputs in buffers kept across steps (a step gets views of its rows)."""

    def __init__(self) -> None:
        from . import quant

        self.info = DeviceInfo("jit", 0, "cpu", codegen=True, description=(
            f"numba {numba.__version__} on {quant.HOST_CPU}, "
            f"{numba.get_num_threads()} threads, {'AVX2' if quant.AVX2 else 'portable'} int8 kernels"))
        # id(weight) -> (weight, float32 array): a weight read by several groups is laid out once;
        # the source is kept so its id stays unique
        self._float_weights: dict[int, tuple[Any, np.ndarray]] = {}
        self.quant_scratch: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _float(self, weight: Any) -> np.ndarray:
        entry = self._float_weights.get(id(weight))
        if entry is None:
            array = weight.dequantize() if hasattr(weight, "dequantize") else weight
            entry = self._float_weights[id(weight)] = (weight, np.ascontiguousarray(array, np.float32))
        return entry[1]

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        from . import quant

        kernel = self._compile(group, weights, ctx)
        if isinstance(kernel, str) or quant.INT8_ACTIVATIONS:
            return kernel

        def single_threaded(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
            # Exact arithmetic multiplies through BLAS, whose threads spin between calls; numba's own
            # parallel regions beside them would fight for the cores (4x slower measured on 2 cores),
            # so numba runs on the calling thread (set per thread: the engine's step loop).
            if numba.get_num_threads() != 1:
                numba.set_num_threads(1)
            return kernel(inputs, step)

        return single_threaded

    def _compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        from . import codegen

        if group.sampling_op is not None:
            return _sampling_kernel(group, ctx)
        if codegen.unsupported_op(group) is None:
            return _fused_kernel(group, codegen.compile_elementwise(group), ctx)
        if len(group.nodes) != 1:
            return f"no kernel for {codegen.unsupported_op(group)} inside a fused group"
        node = group.nodes[0]
        factory = _NODE_KERNELS.get(node.op)
        if factory is None:
            return f"no kernel for {node.op}"
        run = factory(self, node, [weights[p] for p in node.params], ctx)
        return lambda inputs, step: [run(inputs, step)]

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_host(self, buffer: np.ndarray) -> np.ndarray:
        # kernels reuse their output buffers every step; the caller gets its own copy
        return np.array(buffer, copy=True)

    def close(self) -> None:
        self._float_weights.clear()
        self.quant_scratch.clear()


PARALLEL_ELEMENTS = 1 << 16  # below this a fused group's loop is cheaper than waking the other threads


def _fused_kernel(group: FusedGroup, functions: tuple[Callable, Callable], ctx: CompileContext) -> Kernel:
    serial, parallel = functions
    buffers: list[Buffer] = []

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        rows, width = inputs[0].shape
        if not buffers:
            buffers[:] = [Buffer(max(rows, ctx.max_tokens), width) for _ in group.outputs]
        outputs = [b.take(rows) for b in buffers]
        fused = parallel if rows * width >= PARALLEL_ELEMENTS else serial
        fused(*[o.reshape(-1) for o in outputs], *[x.reshape(-1) for x in inputs])  # inputs are C-contiguous
        return outputs

    return run


def _embedding(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    from gguf import GGMLQuantizationType, quants

    from . import kernels

    (table,) = params
    scale = np.float32(node.attrs.get("scale", 1.0))
    buffer = Buffer(ctx.max_tokens, table.shape[1])
    if not hasattr(table, "qtype"):
        table = np.ascontiguousarray(table, np.float32)

        def run_float(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
            if step.tokens.max(initial=0) >= table.shape[0]:  # numba would read past the table
                raise ValueError(f"token id {step.tokens.max()} is outside the vocabulary ({table.shape[0]})")
            return _run(kernels.embedding, table, step.tokens, scale, buffer.take(step.n_tokens))

        return run_float
    qtype = GGMLQuantizationType[table.qtype]

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        # the step's rows only, decoded from the blocks as stored (Q8_0 tables stay 1 byte a weight)
        out = buffer.take(step.n_tokens)
        out[:] = quants.dequantize(table.data[step.tokens], qtype).reshape(out.shape)
        if scale != 1:
            out *= scale
        return out

    return run


def _run(kernel: Callable, *args: Any) -> np.ndarray:
    """Call ``kernel(*args)`` and return its last argument, the output."""
    kernel(*args)
    return args[-1]


def _rms_norm(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    from . import kernels

    weight = device._float(params[0])
    group, eps = int(node.attrs["group"]), np.float32(node.attrs["eps"])
    buffers: dict[int, Buffer] = {}

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        buffer = buffers.setdefault(x.shape[1], Buffer(ctx.max_tokens, x.shape[1]))
        return _run(kernels.rms_norm, x, weight, group, eps, buffer.take(x.shape[0]))

    return run


BLAS_ROWS = 16  # float32 linears over more rows than this (prefill) run on BLAS


def _linear(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    from . import quant

    weight = params[0]
    bias = device._float(params[1]) if len(params) > 1 else None
    qtype = getattr(weight, "qtype", None)
    if qtype is not None and weight.shape[1] % quant.BLOCK == 0:
        if qtype in quant.KINDS:
            blocks = weight.data
        else:  # re-blocked once: 8.5 bits a weight, error below half a Q8_0 step (max|w| / 254 per block)
            qtype, blocks = "Q8_0", quant.requantize_q8_0(weight.dequantize())
        linear = quant.QuantLinear(qtype, blocks, bias, ctx.max_tokens, device.quant_scratch)
        return lambda inputs, step: linear(inputs[0])
    from . import kernels

    dense = device._float(weight)
    buffer = Buffer(ctx.max_tokens, dense.shape[0])

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        out = buffer.take(x.shape[0])
        if x.shape[0] <= BLAS_ROWS:  # numba's threads only: OpenBLAS's would spin against them
            kernels.linear_f32(x, dense, out)
        else:
            np.matmul(x, dense.T, out=out)  # BLAS reads [out, in] transposed without a copy
        if bias is not None:
            out += bias
        return out

    return run


def _check_in_cache(step: Step, ctx: CompileContext) -> None:
    """numba does no bounds checks: a position or slot past the cache would write outside it."""
    if step.positions.max(initial=0) >= ctx.kv_len or step.slots.max(initial=0) >= ctx.kv_slots:
        raise ValueError(f"step outside the KV cache ({ctx.kv_slots} slots of {ctx.kv_len} positions): "
                         f"positions up to {step.positions.max()}, slots up to {step.slots.max()}")


def _rope(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    from . import kernels

    head_dim = int(node.attrs["head_dim"])
    # float32 angles, as Hugging Face computes them, for every position the cache can hold
    angles = np.arange(ctx.kv_len, dtype=np.float32)[:, None] * rope_inv_freq(node.attrs)[None, :]
    cos_table, sin_table = np.cos(angles), np.sin(angles)
    buffers: dict[int, Buffer] = {}

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        _check_in_cache(step, ctx)
        buffer = buffers.setdefault(x.shape[1], Buffer(ctx.max_tokens, x.shape[1]))
        return _run(kernels.rope, x, step.positions, cos_table, sin_table, head_dim, buffer.take(x.shape[0]))

    return run


def _attention(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    from . import kernels

    n_heads, n_kv, head_dim = (int(node.attrs[k]) for k in ("n_heads", "n_kv_heads", "head_dim"))
    scale, window = np.float32(node.attrs["scale"]), int(node.attrs.get("window") or 0)
    # np.zeros: the OS commits pages only when a slot's positions are first written
    k_cache = np.zeros((ctx.kv_slots, ctx.kv_len, n_kv, head_dim), np.float32)
    v_cache = np.zeros_like(k_cache)
    buffer = Buffer(ctx.max_tokens, n_heads * head_dim)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        q, k, v = inputs
        _check_in_cache(step, ctx)
        return _run(kernels.attention, q, k, v, k_cache, v_cache, step.positions, step.slots, step.query_starts,
                    n_heads, scale, window, buffer.take(q.shape[0]))

    return run


def _last_rows(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> NodeRunner:
    buffers: dict[int, Buffer] = {}

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        (x,) = inputs
        buffer = buffers.setdefault(x.shape[1], Buffer(ctx.kv_slots, x.shape[1]))
        return np.take(x, step.sample_rows, axis=0, out=buffer.take(len(step.sample_rows)))

    return run


_NODE_KERNELS = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "linear": _linear,
    "rope": _rope,
    "attention": _attention,
    "last_rows": _last_rows,
}


def _sampling_kernel(group: FusedGroup, ctx: CompileContext) -> Kernel:
    from . import sampling

    op = group.sampling_op
    if op == "sample":
        def run_sample(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
            (logits,) = inputs
            out = np.empty(logits.shape[0], np.int32)
            s = step.sampling
            sampling.sample(logits, s.temperature, s.uniform, out)
            return [out]

        return run_sample

    kernel = getattr(sampling, op)
    needed = SAMPLING_OP_NEEDED[op]
    buffers: dict[int, Buffer] = {}

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        (logits,) = inputs
        buffer = buffers.setdefault(logits.shape[1], Buffer(ctx.kv_slots, logits.shape[1]))
        out = buffer.take(logits.shape[0])
        s = step.sampling
        parameters = {"penalize": (s.repetition_penalty, s.presence_penalty, s.recent),
                      "temperature": (s.temperature,), "top_k": (s.top_k,), "top_p": (s.top_p,),
                      "min_p": (s.min_p,)}[op]
        kernel(logits, needed(s), *parameters, out)
        return [out]

    return run


class JitBackend(Backend):
    name = "jit"

    def devices(self) -> list[DeviceInfo]:
        if numba is None:
            return [DeviceInfo("jit", 0, "cpu", codegen=True, declined=_MISSING)]
        return [DeviceInfo("jit", 0, "cpu", codegen=True, description=f"numba {numba.__version__} CPU kernels")]

    def open(self, index: int) -> Device:
        if numba is None:
            raise RuntimeError(_MISSING)
        if index != 0:
            raise ValueError(f"the jit backend has one device, jit:0 (asked for jit:{index})")
        return JitDevice()


@hookimpl
def lse_backend() -> Backend:
    return JitBackend()
