"""An OpenCL device: compiles each fused group into a kernel closure over device-resident weights,
tensors and KV caches. Fused elementwise groups come from lse_backends.cgen; every other op has a
hand-written kernel in kernels.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyopencl as cl

from lse_backends.cgen import elementwise_kernel
from lse_core.devices.hookspec import CompileContext, Device, DeviceInfo, Kernel
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import ELEMENTWISE_OPS, PENALTY_WINDOW, Node, Step, rope_inv_freq
from lse_core.model.model import QuantTensor

from . import kernels
from .runtime import CLAllocator, CLCompiler, CLProgram, CLTensor

SAMPLING_WG = 256          # work-items per sequence in the sampling kernels (fewer where a device allows less)
LINEAR_LOCAL = 8           # work-items per work-group along the output rows (small: balances 2-4 cores)
# (rows, tokens) per work-item of the linear kernels, by the step's row count: one weight load serves
# as many rows as the tile holds, without computing many clamped copies of a short step's last row.
LINEAR_TILES = ((1, (4, 1)), (4, (4, 4)), (None, (4, 8)))

# The step.sampling arrays each sampling kernel reads, in its argument order.
SAMPLING_PARAMS = {
    "penalize": ("recent", "repetition_penalty", "presence_penalty"),
    "temperature": ("temperature",),
    "top_k": ("temperature", "top_k"),
    "top_p": ("temperature", "top_p"),
    "min_p": ("temperature", "min_p"),
    "sample": ("temperature", "uniform"),
}


def rounded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# GGUF block layouts of the types with direct kernels: bytes per block and where each field starts.
# Fields: d (fp16 scale), m (fp16 minimum), qh (4 bytes of fifth bits), qs (the quants).
BLOCK_FIELDS = {
    "Q8_0": (34, {"d": 0, "qs": 2}),
    "Q4_0": (18, {"d": 0, "qs": 2}),
    "Q4_1": (20, {"d": 0, "m": 2, "qs": 4}),
    "Q5_0": (22, {"d": 0, "qh": 2, "qs": 6}),
    "Q5_1": (24, {"d": 0, "m": 2, "qh": 4, "qs": 8}),
}
OFFSET_OF_ZERO = {"Q4_0": 8, "Q5_0": 16}   # types without m store q - offset: m = -offset * d


def repack_quant(weight: QuantTensor) -> dict[str, np.ndarray] | None:
    """GGUF blocks -> the kernels' layout (see kernels.py), fp16 scales as f32; None for types
    without a direct kernel."""
    if weight.qtype not in BLOCK_FIELDS:
        return None
    size, at = BLOCK_FIELDS[weight.qtype]
    rows, cols = weight.shape
    blocks = weight.data.reshape(rows, cols // 32, size)

    def half(offset: int) -> np.ndarray:
        return blocks[:, :, offset:offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    scale = half(at["d"])
    if weight.qtype == "Q8_0":
        return {"scale": scale, "quants": blocks[:, :, 2:].copy().view(np.int8)}
    packed = {"scale": scale, "minimum": half(at["m"]) if "m" in at else -OFFSET_OF_ZERO[weight.qtype] * scale,
              "quants": blocks[:, :, at["qs"]:at["qs"] + 16].copy()}
    if "qh" in at:
        packed["high"] = blocks[:, :, at["qh"]:at["qh"] + 4].copy()
    return packed


def step_arrays(step: Step) -> dict[str, np.ndarray]:
    """The step's metadata the kernels read, as the dtypes they read it in."""
    arrays = {
        "tokens": step.tokens.astype(np.int32),
        "positions": step.positions.astype(np.int32),
        "token_slot": np.repeat(step.slots, np.diff(step.query_starts)).astype(np.int32),  # each row's slot
        "sample_rows": step.sample_rows.astype(np.int32),
    }
    if step.sampling is not None:
        s = step.sampling
        arrays.update(
            temperature=s.temperature.astype(np.float32), top_k=s.top_k.astype(np.int32),
            top_p=s.top_p.astype(np.float32), min_p=s.min_p.astype(np.float32),
            repetition_penalty=s.repetition_penalty.astype(np.float32),
            presence_penalty=s.presence_penalty.astype(np.float32),
            recent=s.recent.astype(np.int32), uniform=s.uniform.astype(np.float32),
        )
    return arrays


class OpenCLDevice(Device):
    kv_cache_types = ("f16", "f32")  # halves through vload_half/vstore_half; no q8_0 kernels yet

    def __init__(self, info: DeviceInfo, cl_device: cl.Device) -> None:
        self.info = info
        self.context = cl.Context([cl_device])
        self.queue = cl.CommandQueue(self.context)
        self.compiler = CLCompiler(self.context)
        self.allocator = CLAllocator(self.queue)
        self._weights: dict[tuple[int, str], tuple[Any, Any]] = {}   # (id(weight), layout) -> (weight, upload)
        self._step: tuple[Step, int, dict[str, CLTensor]] | None = None   # the last step, serial, metadata
        self._builders: dict[str, Callable[[Node, Mapping[str, Any], CompileContext], Kernel | str]] = {
            "embedding": self._embedding, "rms_norm": self._rms_norm, "linear": self._linear,
            "rope": self._rope, "attention": self._attention, "last_rows": self._last_rows,
        }

    # -- the Device contract

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        if all(op in ELEMENTWISE_OPS for op in group.ops):
            return self._elementwise(group)
        if group.sampling_op is not None:
            return self._sampling(group.sampling_op)
        node = group.nodes[0]
        builder = self._builders.get(node.op)
        if builder is None or len(group.nodes) != 1:
            return f"no kernel for {node.op}"
        return builder(node, weights, ctx)

    def to_device(self, array: np.ndarray) -> CLTensor:
        return self.allocator.to_device(array)

    def to_host(self, buffer: CLTensor) -> np.ndarray:
        return self.allocator.to_host(buffer)

    def synchronize(self) -> None:
        self.queue.finish()

    def close(self) -> None:
        self.queue.finish()
        self._weights.clear()
        self._step = None
        self.allocator.free_pool()

    # -- shared pieces

    def _program(self, source: str, **defines: int) -> CLProgram:
        return self.compiler.build(source, " ".join(f"-D{k}={v}" for k, v in defines.items()))

    def _upload(self, weight: Any, layout: str, prepare: Callable[[Any], Any]) -> Any:
        """``prepare(weight)``, done once per weight object and layout (tied tables serve two groups)."""
        key = (id(weight), layout)
        if key not in self._weights:
            self._weights[key] = (weight, prepare(weight))
        return self._weights[key][1]

    def _dense(self, weight: Any) -> CLTensor:
        def prepare(w: Any) -> CLTensor:
            host = w.dequantize() if isinstance(w, QuantTensor) else np.asarray(w, dtype=np.float32)
            return self.allocator.upload(host.astype(np.float32, copy=False))
        return self._upload(weight, "dense", prepare)

    def _quant(self, weight: QuantTensor) -> dict[str, CLTensor] | None:
        def prepare(w: QuantTensor) -> dict[str, CLTensor] | None:
            packed = repack_quant(w)
            return None if packed is None else {k: self.allocator.upload(v) for k, v in packed.items()}
        return self._upload(weight, "blocks", prepare)

    def _weight_args(self, weight: Any) -> tuple[str, list[Any], int]:
        """A weight uploaded in the layout its kernels read: the kernel family ("f32", "q8", or "q4",
        which serves the 4- and 5-bit types), the weight arguments, and the FIFTH_BIT to build with."""
        packed = self._quant(weight) if isinstance(weight, QuantTensor) else None
        if packed is None:
            return "f32", [self._dense(weight).buf], 0
        if "minimum" not in packed:
            return "q8", [packed["scale"].buf, packed["quants"].buf], 0
        high = packed.get("high", packed["quants"])   # any buffer stands in where there are no fifth bits
        return "q4", [packed["scale"].buf, packed["minimum"].buf, packed["quants"].buf, high.buf], int("high" in packed)

    def _step_tensors(self, step: Step) -> dict[str, CLTensor]:
        """The step's metadata on the device, uploaded once per step (the same object and serial)
        as one buffer (one copy instead of a dozen) that each array is a sub-buffer of."""
        if self._step is None or self._step[0] is not step or self._step[1] != step.serial:
            self._step = (step, step.serial, self.allocator.upload_packed(step_arrays(step)))
        return self._step[2]

    # -- kernels

    def _elementwise(self, group: FusedGroup) -> Kernel:
        source = elementwise_kernel(group, "opencl", "fused")
        kernel = self.compiler.build(source.source).kernel("fused")
        n_out = len(source.outputs)

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            shape = args[0].shape
            n = math.prod(shape)
            outs = [self.allocator.empty(shape) for _ in range(n_out)]
            kernel(self.queue, (rounded(n, 64),), None, *(o.buf for o in outs), *(a.buf for a in args), n)
            return outs
        return run

    def _embedding(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        table = weights[node.params[0]]
        emb_scale = float(node.attrs.get("scale", 1.0))
        width = table.shape[1]
        family, table_args, fifth_bit = self._weight_args(table)
        kernel = self._program(kernels.EMBEDDING, FIFTH_BIT=fifth_bit).kernel(f"embedding_{family}")

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            st = self._step_tensors(step)
            out = self.allocator.empty((step.n_tokens, width))
            kernel(self.queue, (rounded(width, 64), step.n_tokens), None, out.buf, *table_args, st["tokens"].buf,
                   width, emb_scale)
            return [out]
        return run

    def _rms_norm(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        weight = self._dense(weights[node.params[0]])
        group = int(node.attrs.get("group") or weight.shape[0])
        eps = float(node.attrs["eps"])
        kernel = self._program(kernels.RMS_NORM).kernel("rms_norm")

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            x = args[0]
            n = math.prod(x.shape) // group
            out = self.allocator.empty(x.shape)
            kernel(self.queue, (rounded(n, 8),), None, out.buf, x.buf, weight.buf, group, eps, n)
            return [out]
        return run

    def _rope(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        head_dim = int(node.attrs["head_dim"])
        rotary_dim = int(node.attrs.get("rotary_dim") or head_dim)
        inv_freq = self.allocator.upload(rope_inv_freq(node.attrs, ctx.kv_len))
        kernel = self._program(kernels.ROPE).kernel("rope")

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            x = args[0]
            st = self._step_tensors(step)
            out = self.allocator.empty(x.shape)
            width = x.shape[1]
            kernel(self.queue, (rounded(width // 2, 64), x.shape[0]), None, out.buf, x.buf, st["positions"].buf,
                   inv_freq.buf, width, head_dim, rotary_dim)
            return [out]
        return run

    def _attention(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        a = node.attrs
        head_dim, n_heads, n_kv_heads = int(a["head_dim"]), int(a["n_heads"]), int(a["n_kv_heads"])
        window, scale = int(a.get("window") or 0), float(a["scale"])
        kv_width = n_kv_heads * head_dim
        halves = {"K_HALF": int(ctx.cache_type_k == "f16"), "V_HALF": int(ctx.cache_type_v == "f16")}
        k_bytes, v_bytes = (ctx.kv_slots * ctx.kv_len * kv_width * (2 if half else 4) for half in halves.values())
        limit = self.queue.device.max_mem_alloc_size
        if max(k_bytes, v_bytes) > limit:
            return (f"the KV cache ({max(k_bytes, v_bytes) >> 20} MiB per layer for k or for v) exceeds the "
                    f"device's largest allocation ({limit >> 20} MiB); lower --kv-len or --parallel")
        k_cache = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, k_bytes)
        v_cache = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, v_bytes)
        program = self._program(kernels.ATTENTION, HEAD_DIM=head_dim, **halves)
        write, attend = program.kernel("kv_write"), program.kernel("attention")

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            q, k, v = args
            st = self._step_tensors(step)
            n_tok = step.n_tokens
            write(self.queue, (rounded(kv_width, 64), n_tok), None, k_cache, v_cache, k.buf, v.buf,
                  st["positions"].buf, st["token_slot"].buf, kv_width, ctx.kv_len)
            out = self.allocator.empty(q.shape)
            attend(self.queue, (rounded(n_heads, 4), n_tok), (4, 1), out.buf, q.buf, k_cache, v_cache,
                   st["positions"].buf, st["token_slot"].buf, n_heads, n_kv_heads, ctx.kv_len,
                   window, scale)
            return [out]
        return run

    def _last_rows(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        kernel = self._program(kernels.LAST_ROWS).kernel("last_rows")

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            x = args[0]
            st = self._step_tensors(step)
            width = x.shape[1]
            out = self.allocator.empty((len(step.sample_rows), width))
            kernel(self.queue, (rounded(width, 64), len(step.sample_rows)), None, out.buf, x.buf, st["sample_rows"].buf,
                   width)
            return [out]
        return run

    def _linear(self, node: Node, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel:
        weight = weights[node.params[0]]
        n_out, n_in = weight.shape
        bias = self._dense(weights[node.params[1]]) if len(node.params) > 1 else None
        family, weight_args, fifth_bit = self._weight_args(weight)
        tiled = [(most, tile, self._program(kernels.LINEAR, ROWS=tile[0], TOKS=tile[1], FIFTH_BIT=fifth_bit)
                  .kernel(f"linear_{family}")) for most, tile in LINEAR_TILES]
        bias_buf = bias.buf if bias is not None else weight_args[0]
        has_bias = int(bias is not None)

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            x = args[0]
            n_tok = x.shape[0]
            tile, kernel = next((tile, k) for most, tile, k in tiled if most is None or n_tok <= most)
            y = self.allocator.empty((n_tok, n_out))
            grid = (rounded(-(-n_out // tile[0]), LINEAR_LOCAL), -(-n_tok // tile[1]))
            kernel(self.queue, grid, (LINEAR_LOCAL, 1), y.buf, x.buf, *weight_args, bias_buf,
                   n_in, n_out, n_tok, has_bias)
            return [y]
        return run

    # -- sampling: one work-group per sequence

    def _mask(self, kernel: cl.Kernel, wg: int) -> Kernel:
        """The token masks are uploaded by the mask kernel itself: they are computed during the step,
        after its other metadata went up."""
        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            logits = args[0]
            n_seqs, vocab = logits.shape
            s = step.sampling
            masks = self.allocator.upload_packed({"constrained": s.constrained.astype(np.int32),
                                                  "token_mask": s.token_mask.astype(np.int32)})
            out = self.allocator.empty(logits.shape)
            kernel(self.queue, (n_seqs * wg,), (wg,), out.buf, logits.buf, masks["constrained"].buf,
                   masks["token_mask"].buf, vocab)
            return [out]
        return run

    def _sampling(self, name: str) -> Kernel:
        wg = min(SAMPLING_WG, 1 << (self.queue.device.max_work_group_size.bit_length() - 1))  # a power of two
        kernel = self._program(kernels.SAMPLING, WG=wg, WINDOW=PENALTY_WINDOW).kernel(name)
        if name == "mask":
            return self._mask(kernel, wg)
        params, int_out = SAMPLING_PARAMS[name], name == "sample"

        def run(args: Sequence[CLTensor], step: Step) -> list[CLTensor]:
            logits = args[0]
            n_seqs, vocab = logits.shape
            st = self._step_tensors(step)
            out = self.allocator.empty((n_seqs,), np.int32) if int_out else self.allocator.empty(logits.shape)
            kernel(self.queue, (n_seqs * wg,), (wg,), out.buf, logits.buf,
                   *(st[p].buf for p in params), vocab)
            return [out]
        return run
