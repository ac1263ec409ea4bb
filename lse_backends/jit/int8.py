"""int8 activations, as llama.cpp's Q8_0: the jit device's GEMM tiles (quant.py) multiply the weights'
bytes or nibbles by int8 activations with pmaddubsw (or vpdpbusd), each block of 32 activations x as
xs * xq, xq = rint(x * 127 / max|x|) (half to even), xs = max|x| / 127. ``quantize_compact`` writes them,
once per product and thread, to a float32 scratch row per token: xs per block, xs * sum(xq) per block,
then the 32 int8 values of each block in order, a quarter of the float32 row's bytes (a tile broadcasts
four of them at a time against its weight rows: a byte a value stays in L1 even for rows of thousands),
then sum(xq) of each half block as int32 (the tiles that multiply signed weights as unsigned bytes, q + o,
take o sum(xq) off their products).

With two planes (Q4 weights, where quant._planes says) a value carries 15 bits instead of 8:
xq = PLANE_SCALE * hi + lo, hi the int8 value above and lo = rint(PLANE_SCALE * (x / xs - hi)) (|lo| <= 64)
in a second plane of bytes after the first, and the scale field xs / PLANE_SCALE. A tile multiplies each
plane in int8 and adds PLANE_SCALE times the first's products to the second's, exactly: the rounding of int8
activations (which flips near-tied next tokens of small models) is gone at twice the integer work."""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .vector import LANES, f32, i8, i32, integer, load_floats, splat, v8f32, v8i8, v8i32, v32i8, vector

BLOCK = 32  # activations per scale: GGUF's block, so that a weight block meets one activation block
PLANE_SCALE = 128  # a second plane's unit, in the first's: a power of two, so the tiles combine by a shift


def _horizontal(builder: ir.IRBuilder, value: ir.Value, combine) -> ir.Value:
    """Lane 0 of <8 x i32> ``value`` folded with itself by ``combine`` over halves, quarters, pairs."""
    for width in (4, 2, 1):
        lanes = [i + width if i < width else i for i in range(LANES)]
        value = combine(value, builder.shuffle_vector(value, value, ir.Constant(v8i32, lanes)))
    return builder.extract_element(value, ir.Constant(i32, 0))


def _make_quantize_block(planes: int):
    """An intrinsic ``quantize_block(x, values, b, at, plane_bytes)``: block b of the 1-D float32 row x as int8 (see
    the module doc), its 32 values stored in order at byte ``at`` of ``values``, and with two planes the second
    plane's ``plane_bytes`` bytes after the first's; returns (the scale, the scale * sum(xq), sum(xq) of each half
    block): xs, or with two planes xs / PLANE_SCALE; NaN for a block with a NaN or an infinity. Its largest |x| is
    an integer max of the bits (the order of non-negative floats, infinities and NaNs above all), so no NaN is lost
    on the way."""
    return intrinsic(functools.partial(_quantize_block, planes))


def _quantize_block(planes, typingctx, x, values_array, b, at, plane_bytes):
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (x, values_array)):
        raise TypingError("blocks are quantized from and to C-contiguous 1-D arrays")
    sig = types.Tuple((types.float32, types.float32, types.int32, types.int32))(x, values_array, b, at, plane_bytes)

    def codegen(context, builder, signature, args):
        x_a, values_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1))
        block = context.cast(builder, args[2], signature.args[2], types.intp)
        floats = builder.bitcast(x_a.data, f32.as_pointer())
        values = [load_floats(builder, floats, builder.add(builder.mul(block, integer(BLOCK)), integer(LANES * k)))
                  for k in range(BLOCK // LANES)]
        magnitudes = [builder.and_(builder.bitcast(v, v8i32), vector(0x7FFFFFFF, v8i32)) for v in values]

        def larger(a, c):
            return builder.select(builder.icmp_signed(">", a, c), a, c)

        largest = magnitudes[0]
        for m in magnitudes[1:]:
            largest = larger(largest, m)
        largest = _horizontal(builder, largest, larger)
        finite = builder.icmp_signed("<", largest, ir.Constant(i32, 0x7F800000))
        top = builder.bitcast(largest, f32)
        nonzero = builder.and_(finite, builder.icmp_signed(">", largest, ir.Constant(i32, 0)))
        inverse = builder.select(nonzero, builder.fdiv(ir.Constant(f32, 127.0), top), ir.Constant(f32, 0.0))
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f32, [v8f32]), "llvm.rint.v8f32")
        scaled = [builder.fmul(builder.select(finite, v, ir.Constant(v8f32, None)), splat(builder, inverse))
                  for v in values]
        rounded = [builder.call(rint, [v]) for v in scaled]
        stored = [[builder.fptosi(q, v8i32) for q in rounded]]
        combined = stored[0]
        if planes == 2:  # the second plane: what rounding to int8 left, in units of 1 / PLANE_SCALE (exact)
            stored.append([builder.fptosi(builder.call(rint, [builder.fmul(builder.fsub(v, q), vector(PLANE_SCALE))]),
                                          v8i32) for v, q in zip(scaled, rounded)])
            combined = [builder.add(builder.mul(q, vector(PLANE_SCALE, v8i32)), r) for q, r in zip(*stored)]
        half_sums = [_horizontal(builder, builder.add(combined[i], combined[i + 1]), builder.add) for i in (0, 2)]
        total = builder.add(*half_sums)
        block_at, plane_bytes = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (3, 4))
        for plane, plane_quants in enumerate(stored):
            narrow = [builder.trunc(q, v8i8) for q in plane_quants]
            halves = [builder.shuffle_vector(narrow[i], narrow[i + 1],
                                             ir.Constant(ir.VectorType(i32, 16), list(range(16)))) for i in (0, 2)]
            packed = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(i32, 32), list(range(32))))
            at = builder.gep(builder.bitcast(values_a.data, i8.as_pointer()),
                             [builder.add(block_at, builder.mul(plane_bytes, integer(plane)))])
            builder.store(packed, builder.bitcast(at, v32i8.as_pointer()), align=1)
        unit = 127.0 * (PLANE_SCALE if planes == 2 else 1)
        scale = builder.select(finite, builder.fdiv(top, ir.Constant(f32, unit)), ir.Constant(f32, float("nan")))
        return context.make_tuple(builder, signature.return_type,
                                  [scale, builder.fmul(scale, builder.sitofp(total, f32)), *half_sums])

    return sig, codegen


_quantize_in_order, _quantize_planes = (_make_quantize_block(planes) for planes in (1, 2))


@njit(cache=True, nogil=True)
def compact_width(n: int, planes: int = 1) -> int:
    """float32s per token row of the scratch that ``quantize_compact`` fills, for activations of width n."""
    return 4 * (n // BLOCK) + planes * n // 4   # per block xs, xs sum(xq) and two half sums; the values


@njit(cache=True, nogil=True)
def dequantize(x, scratch, planes=1):
    """x as the GEMM tiles see it, the scale times xq, from what ``quantize_compact`` wrote to scratch for it."""
    n_blocks = x.shape[1] // BLOCK
    seen = np.empty(x.shape, np.float32)
    for t in range(x.shape[0]):
        values = scratch[t, 2 * n_blocks:].view(np.int8)
        for i in range(x.shape[1]):
            xq = np.float32(values[i])
            if planes == 2:
                xq = np.float32(PLANE_SCALE) * xq + np.float32(values[x.shape[1] + i])
            seen[t, i] = scratch[t, i // BLOCK] * xq
    return seen


@njit(cache=True, nogil=True)
def quantize_compact(x: np.ndarray, scratch: np.ndarray, planes: int = 1) -> None:
    """x's rows (float32, C-contiguous, width a multiple of 32) as int8 in scratch's rows ([rows,
    compact_width(width, planes)]): per row, the scale per block, scale * sum(xq) per block, then the int8
    values in order, with two planes the second plane's after them, then each half block's sum(xq) as int32
    (module doc). A block with a NaN or an infinity gets a NaN scale, so the products it meets are NaN."""
    n_blocks = x.shape[1] // BLOCK
    for t in range(x.shape[0]):
        values = scratch[t, 2 * n_blocks:].view(np.int8)
        half_sums = scratch[t, 2 * n_blocks + planes * x.shape[1] // 4:].view(np.int32)
        for b in range(n_blocks):
            scratch[t, b], scratch[t, n_blocks + b], half_sums[2 * b], half_sums[2 * b + 1] = quantize_block(
                x[t], values, b, b * BLOCK, x.shape[1], planes)


@njit(cache=True, nogil=True, inline="always")
def quantize_block(x, values, b, at, plane_bytes, planes):
    """Block b of row x as int8 in ``planes`` planes, stored at byte ``at`` of values (a second plane
    ``plane_bytes`` after it): (the scale, the scale * sum(xq), each half's sum(xq)), as ``quantize_compact``
    writes them."""
    if planes == 2:
        return _quantize_planes(x, values, b, at, plane_bytes)
    return _quantize_in_order(x, values, b, at, plane_bytes)
