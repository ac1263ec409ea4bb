"""The mixture-of-experts ops on jit:0 (semantics in lse_core.graph.ir), each a kernel of its own rather than
a program instruction. Routing, combining and the clamped SwiGLU are the CPU interpreter's numpy kernels (a few
operations per row and expert). An expert product with quantized experts reads them in place: the experts'
matrices are one weight [experts * out, in] laid out by ``quant.prepare``, whose eight-row groups never
straddle two experts (``out`` is the in-width of another expert matrix, so a multiple of a block's 32 values),
so expert e is the row range [e * out, (e + 1) * out), and each chosen expert meets the rows routed to it in
one product (the model's ``quant.linear_pairs_for``, on the calling thread): a prefill's rows grouped by
expert, and a decode step streams only its chosen experts' bytes. (Sharing the experts out to numba's threads
in a parallel region per product measured slower on this 2-core machine: 0.45-0.57 ms against 0.31-0.38 for
eight Qwen3-30B-A3B-shaped Q4_K experts at one token; an instruction inside the programs' one region is the
way to use the threads.)"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lse_backends.cpu import moe as reference
from lse_backends.cpu.kernels import OutputBuffer
from lse_core.devices.hookspec import CompileContext, Kernel
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Node, Step

from . import quant


def compile_group(device: Any, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
    """A kernel for a group of one MoE node (the fusion pass never puts one with others), or why there is none."""
    (node,) = group.nodes
    params = [weights[p] for p in node.params]
    if node.op == "expert_linear":
        blocks = device._weight(params[0])
        if isinstance(blocks, tuple):
            bias = np.asarray(params[1], np.float32) if len(params) > 1 else None
            return _single(_quantized_experts(node, blocks, tuple(params[0].shape), bias, ctx))
        params = [blocks] + [np.asarray(p, np.float32) for p in params[1:]]   # float32 experts: the reference's
    return _single(reference.MOE_KERNELS[node.op](node, params, ctx))


def _single(run: Any) -> Kernel:
    """A Kernel (a list of outputs) from a node kernel (one output)."""
    def kernel(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        return [run(inputs, step)]

    return kernel


def _quantized_experts(node: Node, weight: tuple[int, np.ndarray], shape: tuple[int, int, int],
                       bias: np.ndarray | None, ctx: CompileContext) -> Any:
    kind, blocks = weight
    n_experts, width, in_width = shape
    readonly = blocks.view()
    readonly.flags.writeable = False   # the type programs pass weights as: one compiled linear_pairs serves both
    experts = [readonly[e * width:(e + 1) * width] for e in range(n_experts)]
    # the model's kinds' tiles, as its programs' (quant.linear would compile every kind's)
    linear_pairs = quant.linear_pairs_for(quant.kinds_mask(ctx.weight_types) | 1 << kind)
    all_pairs = quant.linear_items_most(width)
    k = int(node.attrs["k"])
    # as jit:0's linears: two int8 planes for every prefill, and for a gated MLP's down projection's decode too
    wide = quant.WIDE_PREFILL | (quant.WIDE_DECODE if node.attrs.get("mlp") == "down" else 0)
    buffer = OutputBuffer(ctx.max_tokens)

    def run(inputs: Sequence[np.ndarray], step: Step) -> np.ndarray:
        x, routes = inputs
        n = x.shape[0]
        out = buffer.take(n, k * width).reshape(n, k, width)
        # [n, k, in] per-slot inputs, or [n, 1, in] when every slot reads the row itself
        x3 = x.reshape(n, k, in_width) if x.shape[1] == k * in_width else x.reshape(n, 1, in_width)
        ids = reference.route_ids(routes, k)
        for e, rows, slots in reference.routed_groups(ids, k):
            routed = x3[rows, np.minimum(slots, x3.shape[1] - 1)]
            products = np.empty((len(rows), width), np.float32)
            scratch = quant.activation_scratch(len(rows), in_width)
            quant.quantize_activations(kind, routed, scratch, ctx.deterministic, wide)
            linear_pairs(kind, experts[e], routed, products, 0, all_pairs, scratch, ctx.deterministic, wide)
            out[rows, slots] = products
        if bias is not None:
            out += bias[ids]
        return out.reshape(n, k * width)

    return run


# MXFP4's e2m1 values doubled (GGUF's kvalues), by their 4-bit code
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def mxfp4_as_q8_0(data: np.ndarray) -> np.ndarray | None:
    """GGUF MXFP4 blocks [rows, blocks * 17] (an e8m0 exponent e, then value j in byte j's low nibble and value
    j + 16 in its high one, each 2^(e - 128) times a doubled e2m1 value) as the Q8_0 blocks of the same values:
    q the doubled value, d = 2^(e - 128) as f16, exact where every block of values not all zero has such a d (e
    from 104 to 143); else None."""
    blocks = np.asarray(data, np.uint8).reshape(data.shape[0], -1, 17)
    codes = np.concatenate([blocks[..., 1:] & 0x0F, blocks[..., 1:] >> 4], axis=-1)
    exponents = blocks[..., 0].astype(np.int32) - 128
    in_f16 = (exponents >= -24) & (exponents <= 15)
    zero = ~np.any(codes & 0x07, axis=-1)   # codes 0 and 8 are +0 and -0: any d gives them
    if not np.all(in_f16 | zero):
        return None
    out = np.empty((*blocks.shape[:2], 34), np.uint8)
    scales = np.where(in_f16, np.ldexp(np.float32(1), np.clip(exponents, -24, 15)), np.float32(0))
    out[..., :2] = scales.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = _E2M1_DOUBLED[codes].view(np.uint8)
    return out.reshape(data.shape[0], -1)
