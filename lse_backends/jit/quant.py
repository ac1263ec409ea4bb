"""Quantized linear layers. By default (exact arithmetic) a GGUF weight is decoded to float32 once at load;
with LSE_JIT_INT8=1 the blocks are read in place as stored:

Q4_0, Q4_1 and Q8_0 weights meet int8-quantized activations (llama.cpp's Q8_1 scheme: per block of
32, ``d = max|x| / 127``, ``q = round(x / d)``, plus the block sum ``s = d * sum(q)``). A weight row
dotted with an activation row is the sum over blocks b of ``d_w * d_x * sum_i(q_w * q_x)`` plus the
block offset term (Q4_1: ``m_w * s_x``; Q4_0 stores ``q + 8``: ``-8 * d_w * s_x``). Other GGUF types
(Q4_K, Q6_K, Q5_0...) are re-blocked to Q8_0 once at load (``requantize_q8_0``).

The block dot products are LLVM vector IR emitted through numba ``@intrinsic``s, one per weight type
and register-tile shape (ROWS weight rows x COLS tokens). On AVX2 hosts a block is one ``vpmaddubsw``
(unsigned weight nibbles x signed activations) and one ``vpmaddwd`` into eight int32 lanes, scaled
into an eight-float accumulator; f16 block scales become ``vcvtph2ps`` through LLVM's ``fpext half``.
Elsewhere the same tiles are generic LLVM vector IR (widen, multiply, reduce) that any target
lowers. The choice is made once, at import, from the host CPU features; numba's cache is keyed by
those features, so a cached kernel never crosses hosts. ``LSE_JIT_PORTABLE=1`` forces the generic
IR (use a fresh NUMBA_CACHE_DIR when switching).

One driver serves decode and prefill: row tiles in parallel, every token per tile, so each weight
block is read from memory once per step however many tokens the step has; work too small to repay
waking the threads runs on the caller's. Everything numba compiles here lives in this one file
because numba's cache is invalidated by the caller's source file only.
"""

from __future__ import annotations

import os
from typing import Any

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

HOST_CPU = llvm.get_host_cpu_name()
_features = llvm.get_host_cpu_features()
AVX2 = bool(_features.get("avx2") and _features.get("f16c")) and os.environ.get("LSE_JIT_PORTABLE") != "1"

# Weight types with int8 kernels: code -> (bytes per 32-value block, offset of the quants, has a min)
Q4_0, Q4_1, Q8_0 = 0, 1, 2
KINDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
LAYOUT = {Q4_0: (18, 2, False), Q4_1: (20, 4, True), Q8_0: (34, 2, False)}
BLOCK = 32

_i1, _i8, _i16, _i32, _i64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_f16, _f32 = ir.HalfType(), ir.FloatType()
_v16i8, _v32i8 = ir.VectorType(_i8, 16), ir.VectorType(_i8, 32)
_v16i16, _v8i32, _v32i32 = ir.VectorType(_i16, 16), ir.VectorType(_i32, 8), ir.VectorType(_i32, 32)
_v8f32 = ir.VectorType(_f32, 8)


def _call(builder: ir.IRBuilder, name: str, ret: ir.Type, *args: ir.Value) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder: ir.IRBuilder, value: ir.Value, vtype: ir.VectorType) -> ir.Value:
    one = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vtype, None), ir.Constant(ir.VectorType(_i32, vtype.count), None))


def _block_header(builder: ir.IRBuilder, block: ir.Value, has_min: bool) -> tuple[ir.Value, ir.Value | None]:
    """The block's f16 scale (and min) as float32. The first 4 bytes of every block type load as one
    i32 into a zeroed vector (vmovd): a partial-register f16 load would chain each block to the
    accumulator that last wrote that register."""
    word = builder.load(builder.bitcast(block, _i32.as_pointer()), align=1)
    vector = builder.insert_element(ir.Constant(ir.VectorType(_i32, 4), None), word, ir.Constant(_i32, 0))
    halves = builder.bitcast(vector, ir.VectorType(_f16, 8))
    pair = builder.fpext(builder.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(_i32, 4), [0, 1, 2, 3])),
                         ir.VectorType(_f32, 4))
    d = builder.extract_element(pair, ir.Constant(_i32, 0))
    return d, builder.extract_element(pair, ir.Constant(_i32, 1)) if has_min else None


def _weight_quants(builder: ir.IRBuilder, kind: int, qs: ir.Value) -> ir.Value:
    """The block's 32 weight quants as <32 x i8>: unsigned nibbles (low nibbles are values 0..15,
    high nibbles 16..31) for the 4-bit types, signed bytes for Q8_0."""
    if kind == Q8_0:
        return builder.load(builder.bitcast(qs, _v32i8.as_pointer()), align=1)
    packed = builder.load(builder.bitcast(qs, _v16i8.as_pointer()), align=1)
    low = builder.and_(packed, ir.Constant(_v16i8, [15] * 16))
    high = builder.lshr(packed, ir.Constant(_v16i8, [4] * 16))
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_i32, 32), list(range(32))))


def _block_dot_avx2(builder: ir.IRBuilder, kind: int, wq: ir.Value, xq: ir.Value) -> ir.Value:
    """<8 x i32> partial sums of the 32 products."""
    if kind == Q8_0:  # vpmaddubsw wants an unsigned operand: |w| times x with w's sign
        xq = _call(builder, "llvm.x86.avx2.psign.b", _v32i8, xq, wq)
        wq = _call(builder, "llvm.abs.v32i8", _v32i8, wq, ir.Constant(_i1, 0))
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _v16i16, wq, xq)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _v8i32, pairs, ir.Constant(_v16i16, [1] * 16))


def _block_dot_generic(builder: ir.IRBuilder, kind: int, wq: ir.Value, xq: ir.Value) -> ir.Value:
    """The i32 sum of the 32 products."""
    widen = builder.sext if kind == Q8_0 else builder.zext
    products = builder.mul(widen(wq, _v32i32), builder.sext(xq, _v32i32))
    return _call(builder, "llvm.vector.reduce.add.v32i32", _i32, products)


def _row(builder: ir.IRBuilder, array: Any, index: ir.Value) -> ir.Value:
    """i8* to row ``index`` of a 2-D numba array."""
    stride = builder.extract_value(array.strides, 0)
    return builder.gep(builder.bitcast(array.data, _i8.as_pointer()), [builder.mul(index, stride)])


def _element(builder: ir.IRBuilder, row: ir.Value, index: ir.Value, etype: ir.Type) -> ir.Value:
    return builder.gep(builder.bitcast(row, etype.as_pointer()), [index])


def _make_tile_dot(kind: int, n_rows: int, n_cols: int):
    block_bytes, qs_offset, has_min = LAYOUT[kind]

    @intrinsic
    def tile_dot(typingctx, w, r0, xq, xd, xs, t0, out):
        """out[t0 + c, r0 + r] = weight row r0 + r (uint8 blocks [rows, bytes]) . activation row t0 + c
        (int8 quants [T, n], float32 block scales and sums [T, n / 32]) for an n_rows x n_cols tile:
        each weight block is unpacked once for n_cols tokens, each activation block loaded once for
        n_rows rows, and the n_rows * n_cols accumulators are independent FMA chains."""
        sig = types.void(w, r0, xq, xd, xs, t0, out)

        def codegen(context, builder, signature, args):
            w_a, xq_a, xd_a, xs_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                            for i in (0, 2, 3, 4, 6))
            first_row, first_col = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 5))
            row_index = [builder.add(first_row, ir.Constant(_i64, r)) for r in range(n_rows)]
            col_index = [builder.add(first_col, ir.Constant(_i64, c)) for c in range(n_cols)]
            w_rows = [_row(builder, w_a, i) for i in row_index]
            xq_rows, xd_rows, xs_rows = ([_row(builder, a, i) for i in col_index] for a in (xq_a, xd_a, xs_a))
            n_blocks = builder.extract_value(xd_a.shape, 1)
            zero = ir.Constant(_v8f32, None) if AVX2 else ir.Constant(_f32, 0.0)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_cols)] for _ in range(n_rows)]
            offsets = [[cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0)) for _ in range(n_cols)]
                       for _ in range(n_rows)]

            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                x_blocks = [builder.load(_element(builder, row, b, _v32i8), align=1) for row in xq_rows]
                d_x = [builder.load(_element(builder, row, b, _f32)) for row in xd_rows]
                if AVX2:
                    d_x = [_splat(builder, d, _v8f32) for d in d_x]
                for r in range(n_rows):
                    block = builder.gep(w_rows[r], [builder.mul(b, ir.Constant(_i64, block_bytes))])
                    d_w = _block_header(builder, block, has_min)[0]
                    wq = _weight_quants(builder, kind, builder.gep(block, [ir.Constant(_i64, qs_offset)]))
                    if AVX2:
                        d_w = _splat(builder, d_w, _v8f32)
                    for c in range(n_cols):
                        acc = accs[r][c]
                        if AVX2:
                            sums = builder.sitofp(_block_dot_avx2(builder, kind, wq, x_blocks[c]), _v8f32)
                            total = _call(builder, "llvm.fma.v8f32", _v8f32, sums, builder.fmul(d_w, d_x[c]),
                                          builder.load(acc))
                        else:
                            sums = builder.sitofp(_block_dot_generic(builder, kind, wq, x_blocks[c]), _f32)
                            total = builder.fadd(builder.load(acc), builder.fmul(sums, builder.fmul(d_w, d_x[c])))
                        builder.store(total, acc)

            if has_min or kind == Q4_0:  # the block offset terms, a second pass over the L1-hot blocks
                with cgutils.for_range(builder, n_blocks) as loop:
                    b = loop.index
                    s_x = [builder.load(_element(builder, row, b, _f32)) for row in xs_rows]
                    for r in range(n_rows):
                        block = builder.gep(w_rows[r], [builder.mul(b, ir.Constant(_i64, block_bytes))])
                        d_w, m_w = _block_header(builder, block, has_min)
                        if kind == Q4_0:  # the quants are stored as q + 8
                            m_w = builder.fmul(d_w, ir.Constant(_f32, -8.0))
                        for c in range(n_cols):
                            offset = offsets[r][c]
                            builder.store(_call(builder, "llvm.fma.f32", _f32, m_w, s_x[c], builder.load(offset)),
                                          offset)

            for r in range(n_rows):
                for c in range(n_cols):
                    total = builder.load(offsets[r][c])
                    acc = builder.load(accs[r][c])
                    lanes = range(8) if AVX2 else ()
                    for lane in lanes:
                        total = builder.fadd(total, builder.extract_element(acc, ir.Constant(_i32, lane)))
                    if not AVX2:
                        total = builder.fadd(total, acc)
                    out_row = _row(builder, out_a, col_index[c])
                    builder.store(total, _element(builder, out_row, row_index[r], _f32))
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


ROWS, COLS = 4, 2  # the register tile: weight rows x tokens per tile_dot call
ROW_TILE = 16      # weight rows per parallel work item: 16 Q4_1 rows of 576 columns are 5.6 KiB, L1-resident
_SHAPES = ((ROWS, COLS), (ROWS, 1), (1, COLS), (1, 1))
_q40_rc, _q40_r1, _q40_1c, _q40_11 = (_make_tile_dot(Q4_0, r, c) for r, c in _SHAPES)
_q41_rc, _q41_r1, _q41_1c, _q41_11 = (_make_tile_dot(Q4_1, r, c) for r, c in _SHAPES)
_q80_rc, _q80_r1, _q80_1c, _q80_11 = (_make_tile_dot(Q8_0, r, c) for r, c in _SHAPES)


@njit(cache=True, inline="always")
def _tile(kind, full_rows, full_cols, w, r, xq, xd, xs, t, out):
    """The tile_dot of this weight type and tile shape (ROWS or 1 rows, COLS or 1 tokens)."""
    if kind == Q4_1:
        if full_rows and full_cols:
            _q41_rc(w, r, xq, xd, xs, t, out)
        elif full_rows:
            _q41_r1(w, r, xq, xd, xs, t, out)
        elif full_cols:
            _q41_1c(w, r, xq, xd, xs, t, out)
        else:
            _q41_11(w, r, xq, xd, xs, t, out)
    elif kind == Q4_0:
        if full_rows and full_cols:
            _q40_rc(w, r, xq, xd, xs, t, out)
        elif full_rows:
            _q40_r1(w, r, xq, xd, xs, t, out)
        elif full_cols:
            _q40_1c(w, r, xq, xd, xs, t, out)
        else:
            _q40_11(w, r, xq, xd, xs, t, out)
    elif full_rows and full_cols:
        _q80_rc(w, r, xq, xd, xs, t, out)
    elif full_rows:
        _q80_r1(w, r, xq, xd, xs, t, out)
    elif full_cols:
        _q80_1c(w, r, xq, xd, xs, t, out)
    else:
        _q80_11(w, r, xq, xd, xs, t, out)


@njit(cache=True)
def quantize_rows(x, xq, xd, xs):
    """int8 activation blocks of every row of x [T, n] into xq [T, n], scales xd and sums xs [T, n / 32]."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // BLOCK):
            amax = np.float32(0.0)
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                amax = max(amax, abs(x[t, i]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            total = 0
            for i in range(b * BLOCK, (b + 1) * BLOCK):
                q = np.int32(np.round(x[t, i] * inv))
                xq[t, i] = q
                total += q
            xd[t, b] = d
            xs[t, b] = d * np.float32(total)


@njit(cache=True)
def _row_range(kind, weight, r0, r1, n_tokens, xq, xd, xs, out):
    """Weight rows r0 .. r1 against every token, in ROWS x COLS register tiles. A function of its own,
    not inlined: both drivers call one compiled copy, and the parallel loop lowers quickly."""
    full_t = n_tokens // COLS * COLS
    full_r = r0 + (r1 - r0) // ROWS * ROWS
    for t in range(0, n_tokens, COLS):
        for r in range(r0, full_r, ROWS):
            _tile(kind, True, t < full_t, weight, r, xq, xd, xs, t, out)
        for r in range(full_r, r1):
            _tile(kind, False, t < full_t, weight, r, xq, xd, xs, t, out)


@njit(cache=True, parallel=True)
def linear_int8(kind, weight, x, xq, xd, xs, out):
    """out = x @ weight.T: x [T, n] is quantized into the xq, xd, xs buffers (at least T rows), then
    tiles of ROW_TILE rows run in parallel, each over every token, so a weight block leaves memory
    once a step."""
    quantize_rows(x, xq, xd, xs)
    n_rows = weight.shape[0]
    for tile in prange((n_rows + ROW_TILE - 1) // ROW_TILE):
        r0 = tile * ROW_TILE
        _row_range(kind, weight, r0, min(n_rows, r0 + ROW_TILE), x.shape[0], xq, xd, xs, out)


@njit(cache=True)
def linear_int8_serial(kind, weight, x, xq, xd, xs, out):
    """linear_int8 on the calling thread, for work smaller than a parallel region's start-up."""
    quantize_rows(x, xq, xd, xs)
    _row_range(kind, weight, 0, weight.shape[0], x.shape[0], xq, xd, xs, out)


SERIAL_BLOCKS = 4096  # block products below which one thread beats waking the others (~10 us of work)

# Exact arithmetic unless LSE_JIT_INT8=1. int8 activation blocks (llama.cpp's arithmetic, these kernels)
# decode about 2.3x faster here, but they move SmolLM2's logits by a few percent of their scale, enough
# to flip a near-tied greedy choice (the first token for "What is the capital of France?"). Without
# them the weight is decoded to float32 once at load and multiplied by BLAS, which agrees with the
# interpreter within 1e-4 of scale. (A numba loop decoding blocks in registers against float32
# activations was measured at 0.4-0.7 ms per 1536x576 GEMV here, far slower than BLAS on the decoded
# copy: numba widens the nibbles to int64, which LLVM does not vectorize.)
INT8_ACTIVATIONS = os.environ.get("LSE_JIT_INT8") == "1"


def requantize_q8_0(dense: np.ndarray) -> np.ndarray:
    """Q8_0 blocks [rows, cols / 32 * 34] of a float32 matrix: how weight types without an int8 kernel
    (Q4_K, Q6_K, Q5_0...) reach one. d = max|x| / 127 as f16, q = round(x / d) with that f16 d, so
    every weight moves by at most half its block's step."""
    blocks = dense.reshape(dense.shape[0], -1, BLOCK)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float16)
    q = np.round(blocks / np.where(d == 0, np.float32(1), d.astype(np.float32))).astype(np.int8)
    data = np.empty(blocks.shape[:2] + (LAYOUT[Q8_0][0],), np.uint8)
    data[..., :2] = d.view(np.uint8)
    data[..., 2:] = q.view(np.uint8)
    return data.reshape(dense.shape[0], -1)


def _dequantize(qtype: str, data: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(data, GGMLQuantizationType[qtype]).astype(np.float32)


class QuantLinear:
    """x @ W.T (+ bias) for a GGUF weight kept as stored. ``scratch`` holds the int8 activation buffers,
    shared by every linear of a device with the same input width (they live only during a call)."""

    def __init__(self, qtype: str, data: np.ndarray, bias: np.ndarray | None, max_tokens: int,
                 scratch: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None) -> None:
        self.kind = KINDS[qtype]
        self.data = np.ascontiguousarray(data)
        self.bias = bias
        self.n_in = data.shape[1] // LAYOUT[self.kind][0] * BLOCK
        self.blocks_per_token = data.shape[0] * (self.n_in // BLOCK)
        self.scratch = {} if scratch is None else scratch
        self.capacity = 0
        self._reserve(max_tokens)
        self.dense_t = None if INT8_ACTIVATIONS else _dequantize(qtype, self.data).T

    def _reserve(self, n_tokens: int) -> None:
        """Buffers for at least n_tokens rows (the kernel does no bounds checks)."""
        blocks = self.n_in // BLOCK
        if self.n_in not in self.scratch or self.scratch[self.n_in][0].shape[0] < n_tokens:
            self.scratch[self.n_in] = (np.empty((n_tokens, self.n_in), np.int8),
                                       np.empty((n_tokens, blocks), np.float32),
                                       np.empty((n_tokens, blocks), np.float32))
        self.xq, self.xd, self.xs = self.scratch[self.n_in]
        self.out = np.empty((n_tokens, self.data.shape[0]), np.float32)
        self.capacity = n_tokens

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        if n > self.capacity:
            self._reserve(n)
        out = self.out[:n]
        if self.dense_t is not None:
            np.matmul(x, self.dense_t, out=out)
        else:
            linear = linear_int8_serial if n * self.blocks_per_token < SERIAL_BLOCKS else linear_int8
            linear(self.kind, self.data, x, self.xq, self.xd, self.xs, out)
        if self.bias is not None:
            out += self.bias
        return out
