"""A CUDA device, tinygrad-runtime style: a compiler (NVRTC through cupy.RawModule, cached by
source), programs (RawModule functions with a launch helper), an allocator (CuPy's memory pool:
device buffers are cupy arrays) and the device, which compiles each fused group into a kernel.

Weights are uploaded once, at compile, and shared by every group that reads them (tied embeddings).
Q4_0, Q4_1 and Q8_0 weights stay in their GGUF blocks on the device (a GEMV kernel for decode, a
dequantize-then-cuBLAS GEMM for prefill); other quantized types are dequantized to float32 at upload
and every float32 linear is one cuBLAS GEMM."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cupy
import numpy as np

from lse_core.devices.hookspec import CompileContext, Device, DeviceInfo, Kernel
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import ELEMENTWISE_OPS, PENALTY_WINDOW, Node, Step, rope_inv_freq

from .kernels import (
    ATTENTION_WARPS,
    GEMV_ROWS,
    GEMV_WARPS,
    KERNEL_NAMES,
    MAX_HEAD_DIM,
    QUANT_KINDS,
    ROW_THREADS,
    SOURCE,
    STEP_ARRAYS,
    elementwise_source,
)

THREADS = 256   # block size of the one-thread-per-element kernels


@functools.cache
def compile_module(source: str) -> cupy.RawModule:
    """NVRTC-compiled module for a source text (CuPy also caches the binary on disk)."""
    return cupy.RawModule(code=source, options=("-std=c++17",))


class Program:
    """One kernel function; ``launch`` passes Python ints as C int and floats as C float."""

    def __init__(self, source: str, name: str) -> None:
        self.function = compile_module(source).get_function(name)

    def launch(self, grid: tuple[int, ...], block: tuple[int, ...], *args: Any) -> None:
        c_args = tuple(np.int32(a) if isinstance(a, int) else np.float32(a) if isinstance(a, float) else a
                       for a in args)
        self.function(grid, block, c_args)

    def launch_elements(self, n: int, *args: Any) -> None:
        """One thread per element, ``n`` elements."""
        if n:
            self.launch(((n + THREADS - 1) // THREADS,), (THREADS,), *args)


class StepArrays:
    """The current step's arrays on the device, each uploaded on first use, once per step."""

    def __init__(self) -> None:
        self._step: Step | None = None
        self._serial = -1
        self._arrays: dict[str, cupy.ndarray] = {}

    def get(self, step: Step, name: str) -> cupy.ndarray:
        if step is not self._step or step.serial != self._serial:
            self._step, self._serial, self._arrays = step, step.serial, {}
        if name not in self._arrays:
            self._arrays[name] = cupy.asarray(np.ascontiguousarray(STEP_ARRAYS[name](step)))
        return self._arrays[name]


class CUDADevice(Device):
    def __init__(self, info: DeviceInfo) -> None:
        self.info = info
        self.gpu = cupy.cuda.Device(info.index)
        with self.gpu:
            self.programs = {name: Program(SOURCE, name) for name in KERNEL_NAMES}
        self.step_arrays = StepArrays()
        # (id(host weight), "float32" or "blocks") -> (weight, upload); the weight is kept so its id stays unique
        self._weights: dict[tuple[int, str], tuple[Any, cupy.ndarray]] = {}
        self._builders: dict[str, Callable[[Node, Mapping[str, Any], CompileContext], Kernel | str]] = {
            "embedding": self._embedding, "rms_norm": self._rms_norm, "linear": self._linear,
            "rope": self._rope, "attention": self._attention, "last_rows": self._last_rows,
            "mask": self._mask, "penalize": self._penalize, "temperature": self._temperature, "top_k": self._top_k,
            "top_p": self._top_p, "min_p": self._min_p, "sample": self._sample,
        }

    # -- the Device contract ------------------------------------------------------------------

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        op = group.ops[0]
        with self.gpu:
            if all(o in ELEMENTWISE_OPS for o in group.ops):
                kernel = self._elementwise(group)
            elif op in self._builders:
                kernel = self._builders[op](group.nodes[0], weights, ctx)
            else:
                return f"no kernel for {op}"
        if isinstance(kernel, str):
            return kernel

        def on_device(args: Sequence[Any], step: Step) -> list[Any]:
            with self.gpu:
                return kernel(args, step)

        return on_device

    def to_device(self, array: np.ndarray) -> cupy.ndarray:
        with self.gpu:
            return cupy.asarray(np.ascontiguousarray(array))

    def to_host(self, buffer: cupy.ndarray) -> np.ndarray:
        with self.gpu:
            return cupy.asnumpy(buffer)

    def synchronize(self) -> None:
        self.gpu.synchronize()

    def close(self) -> None:
        self._weights.clear()
        self.step_arrays = StepArrays()
        with self.gpu:
            cupy.get_default_memory_pool().free_all_blocks()

    # -- allocation ---------------------------------------------------------------------------

    def upload(self, weight: Any) -> cupy.ndarray:
        """A weight as float32 on this device, uploaded once however many groups read it; a
        quantized weight (anything with ``dequantize``, i.e. a QuantTensor) is dequantized first."""
        return self._uploaded(weight, "float32", lambda: weight.dequantize() if hasattr(weight, "dequantize")
                              else np.asarray(weight, dtype=np.float32))

    def upload_blocks(self, weight: Any) -> cupy.ndarray:
        """A QuantTensor's blocks as stored (uint8 [rows, bytes per row]), uploaded once."""
        return self._uploaded(weight, "blocks", lambda: weight.data)

    def _uploaded(self, weight: Any, form: str, host: Callable[[], np.ndarray]) -> cupy.ndarray:
        key = (id(weight), form)
        if key not in self._weights:
            self._weights[key] = (weight, cupy.asarray(np.ascontiguousarray(host())))
        return self._weights[key][1]

    def _quant_kind(self, weight: Any) -> tuple[str, int] | None:
        """(kernel suffix, blocks per row) for a weight the device reads as stored, else None."""
        kind = QUANT_KINDS.get(getattr(weight, "qtype", None))
        return None if kind is None else (kind[0], weight.shape[1] // 32)

    # -- kernels, one builder per op; each returns a Kernel or the reason there is none ---------

    def _elementwise(self, group: FusedGroup) -> Kernel:
        generated = elementwise_source(group)
        program = Program(generated.source, generated.name)

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            outs = [cupy.empty_like(args[0]) for _ in generated.outputs]
            program.launch_elements(args[0].size, *outs, *args, args[0].size)
            return outs

        return run

    def _embedding(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        weight = weights[node.params[0]]
        width, scale = weight.shape[1], float(node.attrs.get("scale", 1.0))
        if (quant := self._quant_kind(weight)) is not None:   # dequantize just the looked-up rows
            suffix, blocks_per_row = quant
            blocks, program = self.upload_blocks(weight), self.programs[f"dequantize_rows_{suffix}"]

            def run_quantized(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
                out = cupy.empty((step.n_tokens, width), cupy.float32)
                program.launch_elements(step.n_tokens * blocks_per_row, out, blocks,
                                        self.step_arrays.get(step, "tokens"), step.n_tokens, blocks_per_row, scale)
                return [out]

            return run_quantized
        table, program = self.upload(weight), self.programs["embedding"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            out = cupy.empty((step.n_tokens, width), cupy.float32)
            program.launch_elements(out.size, out, table, self.step_arrays.get(step, "tokens"),
                                    step.n_tokens, width, scale)
            return [out]

        return run

    def _rms_norm(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        weight = self.upload(weights[node.params[0]])
        group, eps = int(node.attrs["group"]), float(node.attrs["eps"])
        threads = min(ROW_THREADS, (group + 31) // 32 * 32)
        program = self.programs["rms_norm"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            x = args[0]
            out = cupy.empty_like(x)
            if x.size:
                program.launch((x.size // group,), (threads,), out, x, weight, group, eps)
            return [out]

        return run

    def _linear(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        weight = weights[node.params[0]]
        bias = self.upload(weights[node.params[1]]) if len(node.params) > 1 else None
        quant = self._quant_kind(weight)
        matmul = self._quantized_matmul(weight, *quant) if quant else self._dense_matmul(weight)

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            out = matmul(args[0])
            if bias is not None:
                out += bias
            return [out]

        return run

    def _dense_matmul(self, weight: Any) -> Callable[[cupy.ndarray], cupy.ndarray]:
        dense = self.upload(weight)
        return lambda x: x @ dense.T   # cuBLAS, reading the [out, in] weight transposed in place

    def _quantized_matmul(self, weight: Any, suffix: str, blocks_per_row: int) -> Callable[[cupy.ndarray],
                                                                                         cupy.ndarray]:
        """x @ weight.T from the stored blocks: the GEMV kernel for a few rows (decode), else the weight
        dequantized into scratch memory for one cuBLAS GEMM (prefill chunks, where it is amortized)."""
        n_out, n_in = weight.shape
        blocks = self.upload_blocks(weight)
        every_row = cupy.arange(n_out, dtype=cupy.int32)
        gemv, dequantize = self.programs[f"gemv_{suffix}"], self.programs[f"dequantize_rows_{suffix}"]

        def matmul(x: cupy.ndarray) -> cupy.ndarray:
            if x.shape[0] <= GEMV_ROWS:
                out = cupy.empty((x.shape[0], n_out), cupy.float32)
                if x.shape[0]:
                    gemv.launch(((n_out + GEMV_WARPS - 1) // GEMV_WARPS,), (32, GEMV_WARPS),
                                out, x, blocks, x.shape[0], n_in, n_out)
                return out
            dense = cupy.empty((n_out, n_in), cupy.float32)
            dequantize.launch_elements(n_out * blocks_per_row, dense, blocks, every_row, n_out, blocks_per_row, 1.0)
            return x @ dense.T

        return matmul

    def _rope(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        inv_freq = cupy.asarray(rope_inv_freq(node.attrs, ctx.kv_len))
        head_dim = int(node.attrs["head_dim"])
        rotary_dim = 2 * len(inv_freq)
        program = self.programs["rope"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            x = args[0]
            out = cupy.empty_like(x)
            program.launch_elements(x.size, out, x, self.step_arrays.get(step, "positions"), inv_freq,
                                    x.shape[0], x.shape[1], head_dim, rotary_dim)
            return [out]

        return run

    def _attention(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        a = node.attrs
        n_heads, n_kv_heads, head_dim = int(a["n_heads"]), int(a["n_kv_heads"]), int(a["head_dim"])
        if head_dim > MAX_HEAD_DIM:
            return f"no kernel for attention with head_dim {head_dim} (at most {MAX_HEAD_DIM})"
        scale, window = float(a["scale"]), int(a.get("window") or 0)
        kv_width = n_kv_heads * head_dim
        # This layer's KV cache, [slot, position, kv_width], lives as long as the kernel.
        k_cache = cupy.zeros((ctx.kv_slots, ctx.kv_len, kv_width), cupy.float32)
        v_cache = cupy.zeros_like(k_cache)
        write, attend = self.programs["kv_write"], self.programs["attention"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            q, k, v = args
            slots = self.step_arrays.get(step, "token_slots")
            positions = self.step_arrays.get(step, "positions")
            write.launch_elements(k.size, k_cache, v_cache, k, v, slots, positions, step.n_tokens, kv_width, ctx.kv_len)
            out = cupy.empty_like(q)
            if step.n_tokens:
                attend.launch((step.n_tokens, n_heads), (32, ATTENTION_WARPS), out, q, k_cache, v_cache, slots,
                              positions, n_heads, n_kv_heads, head_dim, ctx.kv_len, window, scale)
            return [out]

        return run

    def _last_rows(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        program = self.programs["gather_rows"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            x = args[0]
            out = cupy.empty((len(step.sample_rows), x.shape[1]), cupy.float32)
            program.launch_elements(out.size, out, x, self.step_arrays.get(step, "sample_rows"), len(step.sample_rows),
                                    x.shape[1])
            return [out]

        return run

    # The logits processors write a copy: the logits themselves may still be read (want_logits).

    def _row_op(self, op: str, grid: Callable[[int, int], tuple[int, ...]], block: int,
                params: tuple[str, ...], *extra: int) -> Kernel:
        program = self.programs[op]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            out = args[0].copy()
            rows, vocab = out.shape
            arrays = [self.step_arrays.get(step, name) for name in (*params, f"needed.{op}")]
            program.launch(grid(rows, vocab), (block,), out, *arrays, vocab, *extra)
            return [out]

        return run

    def _mask(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("mask", lambda rows, vocab: ((vocab + THREADS - 1) // THREADS, rows), THREADS,
                            ("token_mask",))

    def _penalize(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("penalize", lambda rows, vocab: (rows,), (PENALTY_WINDOW + 31) // 32 * 32,
                            ("recent", "repetition_penalty", "presence_penalty"), PENALTY_WINDOW)

    def _temperature(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("temperature", lambda rows, vocab: ((vocab + THREADS - 1) // THREADS, rows), THREADS,
                            ("temperature",))

    def _top_k(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("top_k", lambda rows, vocab: (rows,), ROW_THREADS, ("top_k",))

    def _top_p(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("top_p", lambda rows, vocab: (rows,), ROW_THREADS, ("top_p",))

    def _min_p(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        return self._row_op("min_p", lambda rows, vocab: (rows,), ROW_THREADS, ("min_p",))

    def _sample(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        program = self.programs["sample"]

        def run(args: Sequence[cupy.ndarray], step: Step) -> list[cupy.ndarray]:
            logits = args[0]
            out = cupy.empty(logits.shape[0], cupy.int32)
            program.launch((logits.shape[0],), (ROW_THREADS,), out, logits,
                           self.step_arrays.get(step, "temperature"), self.step_arrays.get(step, "uniform"),
                           logits.shape[1])
            return [out]

        return run
