"""int8 activations, as llama.cpp's Q8_1: the jit device's Q4 tiles for steps of up to 16 tokens
(quant.py) multiply the weights' nibbles by int8 activations with pmaddubsw, each block of 32 activations
x as xs * xq, xq = rint(x * 127 / max|x|) (half to even), xs = max|x| / 127. ``quantize`` writes them,
once per product and thread, to a float32 scratch row per token: [xs per block | xs * sum(xq) per block |
256 bytes per block, the int8 values in pairs, each pair once per row of a weight group, in the order the
tiles load them]. Laid out so, a tile's activation operand is a plain 32-byte load that meets the eight
rows of its weight group at once.

Steps of more tokens (prefill) take the compact layout instead (``quantize_compact``, read by quant.py's
GEMM tiles): the same two float32 fields per block, then the 32 int8 values of each block in order, a
quarter of the float32 row's bytes; a tile broadcasts four of them at a time against its weight rows.
With two planes the compact layout carries 15 bits a value instead of 8: xq = PLANE_SCALE * hi + lo, hi
the int8 value above and lo = rint(PLANE_SCALE * (x / xs - hi)) (|lo| <= 64) in a second plane of bytes
after the first, and the scale field xs / PLANE_SCALE. A tile multiplies each plane in int8 and adds
PLANE_SCALE times the first's products to the second's, exactly: the rounding of int8 activations (which
flips near-tied next tokens of small models) is gone at twice the integer work."""

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
ROWS = LANES  # copies of each pair: one per row of a weight group (quant.GROUP), two bytes apart
PATTERN_BYTES = ROWS  # bytes of scratch per activation: its byte in each of its pair's ROWS copies
PLANE_SCALE = 128  # a second plane's unit, in the first's: a power of two, so the tiles combine by a shift


@njit(cache=True, nogil=True)
def activation_width(n: int) -> int:
    """float32s per token row of the scratch that ``quantize`` fills, for activations of width n."""
    return 2 * (n // BLOCK) + PATTERN_BYTES * n // 4


def _pattern_byte(i: int) -> int:
    """Where a block's activation i (0 .. 31) goes in the block's 256 pattern bytes (row 0's copy; row r's
    is 2 r further): in the load of bytes i % 16 // 4 * 4 .. + 3 of the quants (low nibbles' loads first,
    then the high nibbles'), in the 16-byte half of that load for i % 4, first or second of its pair."""
    j = i % (BLOCK // 2)
    return 32 * (2 * (j // 4) + i // (BLOCK // 2)) + 16 * (j % 4 // 2) + j % 2


_pattern_at = njit(cache=True, nogil=True, inline="always")(_pattern_byte)
# pattern load k's 32 bytes: lane 16 h + 2 r + e takes the block's activation SPREAD[k][16 h + 2 r + e]
SPREAD = [[0] * 32 for _ in range(PATTERN_BYTES * BLOCK // 32)]
for _i in range(BLOCK):
    for _r in range(ROWS):
        _at = _pattern_byte(_i) + 2 * _r
        SPREAD[_at // 32][_at % 32] = _i


def _horizontal(builder: ir.IRBuilder, value: ir.Value, combine) -> ir.Value:
    """Lane 0 of <8 x i32> ``value`` folded with itself by ``combine`` over halves, quarters, pairs."""
    for width in (4, 2, 1):
        lanes = [i + width if i < width else i for i in range(LANES)]
        value = combine(value, builder.shuffle_vector(value, value, ir.Constant(v8i32, lanes)))
    return builder.extract_element(value, ir.Constant(i32, 0))


def _make_quantize_block(spread: list[list[int]], planes: int = 1):
    """An intrinsic ``quantize_block(x, values, b)``: block b of the 1-D float32 row x as int8 (see
    ``quantize``), its 32 values stored as ``spread`` says (32-byte store k at byte 32 k of the block's
    32 * len(spread) bytes takes the block's values spread[k]); returns (xs, xs * sum(xq)), NaN for a block
    with a NaN or an infinity. Its largest |x| is an integer max of the bits (the order of non-negative
    floats, infinities and NaNs above all), so no NaN is lost on the way. With two planes (in order only)
    the second plane's bytes go len(values) / 2 bytes after the first's, and the scale returned is the
    combined value's, xs / PLANE_SCALE (module doc)."""
    return intrinsic(functools.partial(_quantize_block, spread, planes))


def _quantize_block(spread, planes, typingctx, x, patterns, b):
    if not all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in (x, patterns)):
        raise TypingError("blocks are quantized from and to C-contiguous 1-D arrays")
    sig = types.UniTuple(types.float32, 2)(x, patterns, b)

    def codegen(context, builder, signature, args):
        x_a, patterns_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1))
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
        quants = [builder.call(rint, [v]) for v in scaled]
        # the second plane: what rounding to int8 left, in units of 1 / PLANE_SCALE (t - rint(t) is exact)
        rests = [builder.call(rint, [builder.fmul(builder.fsub(v, q), vector(PLANE_SCALE))])
                 for v, q in zip(scaled, quants)]
        quants, rests = ([builder.fptosi(q, v8i32) for q in plane] for plane in (quants, rests))
        combined = quants if planes == 1 else [builder.add(builder.mul(q, vector(PLANE_SCALE, v8i32)), r)
                                                for q, r in zip(quants, rests)]
        total = _horizontal(builder, builder.add(builder.add(combined[0], combined[1]),
                                                 builder.add(combined[2], combined[3])), builder.add)
        plane_bytes = builder.udiv(builder.extract_value(patterns_a.shape, 0), integer(planes))
        block_at = builder.mul(block, integer(32 * len(spread)))
        for plane, plane_quants in enumerate((quants, rests)[:planes]):
            narrow = [builder.trunc(q, v8i8) for q in plane_quants]
            halves = [builder.shuffle_vector(narrow[i], narrow[i + 1],
                                             ir.Constant(ir.VectorType(i32, 16), list(range(16)))) for i in (0, 2)]
            packed = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(i32, 32), list(range(32))))
            at = builder.gep(builder.bitcast(patterns_a.data, i8.as_pointer()),
                             [builder.add(block_at, builder.mul(plane_bytes, integer(plane)))])
            for k, lanes in enumerate(spread):
                spread_k = builder.shuffle_vector(packed, packed, ir.Constant(ir.VectorType(i32, 32), lanes))
                builder.store(spread_k, builder.bitcast(builder.gep(at, [integer(32 * k)]), v32i8.as_pointer()),
                              align=1)
        unit = 127.0 * (PLANE_SCALE if planes == 2 else 1)
        scale = builder.select(finite, builder.fdiv(top, ir.Constant(f32, unit)), ir.Constant(f32, float("nan")))
        return context.make_tuple(builder, signature.return_type,
                                  [scale, builder.fmul(scale, builder.sitofp(total, f32))])

    return sig, codegen


_quantize_spread = _make_quantize_block(SPREAD)
_quantize_in_order, _quantize_planes = (_make_quantize_block([list(range(BLOCK))], planes) for planes in (1, 2))


@njit(cache=True, nogil=True)
def compact_width(n: int, planes: int = 1) -> int:
    """float32s per token row of the scratch that ``quantize_compact`` fills, for activations of width n."""
    return 2 * (n // BLOCK) + planes * n // 4


@njit(cache=True, nogil=True)
def dequantize(x, scratch, compact=False, planes=1):
    """x as the int8 tiles see it, xs * xq, from what ``quantize`` (or ``quantize_compact``) wrote to
    scratch for it."""
    n_blocks = x.shape[1] // BLOCK
    seen = np.empty(x.shape, np.float32)
    for t in range(x.shape[0]):
        values = scratch[t, 2 * n_blocks:].view(np.int8)
        for i in range(x.shape[1]):
            b = i // BLOCK
            at = b * BLOCK + i % BLOCK if compact else b * PATTERN_BYTES * BLOCK + _pattern_at(i % BLOCK)
            xq = np.float32(values[at])
            if planes == 2:
                xq = np.float32(PLANE_SCALE) * xq + np.float32(values[x.shape[1] + at])
            seen[t, i] = scratch[t, b] * xq
    return seen


@njit(cache=True, nogil=True)
def quantize(x: np.ndarray, scratch: np.ndarray) -> None:
    """x's rows (float32, C-contiguous, width a multiple of 32) as int8 in scratch's rows ([rows,
    activation_width(width)] or wider; the layout in the module doc). A block with a NaN or an infinity
    gets xs = NaN, so the products it meets are NaN."""
    n_blocks = x.shape[1] // BLOCK
    for t in range(x.shape[0]):
        patterns = scratch[t, 2 * n_blocks:].view(np.int8)
        for b in range(n_blocks):
            scratch[t, b], scratch[t, n_blocks + b] = _quantize_spread(x[t], patterns, b)


@njit(cache=True, nogil=True)
def quantize_compact(x: np.ndarray, scratch: np.ndarray, planes: int = 1) -> None:
    """x's rows as int8 in scratch's rows ([rows, compact_width(width, planes)]): per row, the scale per
    block, scale * sum(xq) per block, then the int8 values in order (the values and rounding of
    ``quantize``), and with two planes the second plane's after them (module doc)."""
    n_blocks = x.shape[1] // BLOCK
    for t in range(x.shape[0]):
        values = scratch[t, 2 * n_blocks:].view(np.int8)
        for b in range(n_blocks):
            if planes == 2:
                scratch[t, b], scratch[t, n_blocks + b] = _quantize_planes(x[t], values, b)
            else:
                scratch[t, b], scratch[t, n_blocks + b] = _quantize_in_order(x[t], values, b)
