"""numba kernels for the non-linear model ops of lse_core.graph.ir (semantics documented there).

Every kernel writes into an output array the caller preallocated, takes only arrays and scalars, and
runs on the calling thread over the range of rows (or items) it is given: a program (program.py) hands
the ranges to its threads. Kernels write arrays element by element, never as array assignments or
in-place array operators: for those numba compiles a shape-checked raise with its message formatting,
8 s of a cold start here. The float32 linear lets LLVM reassociate its dot products so they vectorize.
Attention has a file of its own (attention.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

# reassociation lets LLVM vectorize dot products; no nnan/ninf, so infinities and NaNs stay IEEE
DOT_MATH = {"reassoc", "contract", "nsz", "arcp"}


@intrinsic
def _float_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.int32), codegen


EXP_HIGH, EXP_LOW = np.float32(88.7228391), np.float32(-87.3365448)  # exp overflows above, is subnormal below


@njit(cache=True, inline="always")
def expf(x):
    """exp of a float32 in plain arithmetic and selects, so loops that call it vectorize (np.exp is a libm
    call per element): Cephes' expf, x = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial in r,
    times 2^n built in the exponent bits. Within 3 ulp of numpy's exp; 0 below EXP_LOW (numpy gives
    subnormals there), inf above EXP_HIGH, NaN for NaN."""
    clamped = max(min(x, EXP_HIGH), EXP_LOW)  # NaN stays NaN
    n = np.floor(clamped * np.float32(1.44269504) + np.float32(0.5))  # -126 .. 128
    r = clamped - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    top = n > np.float32(127.0)  # 2^128 is no float32: 2^127 * 2
    y = p * _float_from_bits(np.int32((np.int32(n) - np.int32(top) + np.int32(127)) << np.int32(23)))
    y = y * (np.float32(1.0) + np.float32(top)) * np.float32(x >= EXP_LOW)  # NaN * 0 stays NaN
    return np.float32(np.inf) if x > EXP_HIGH else y


@njit(cache=True)
def embedding(table, tokens, scale, out):
    """out[t] = table[tokens[t]] * scale for a float32 table."""
    for t in range(tokens.shape[0]):
        for j in range(table.shape[1]):
            out[t, j] = table[tokens[t], j] * scale


@njit(cache=True)
def rms_norm(x, weight, group, eps, out):
    """Each group of ``group`` columns: x / sqrt(mean(x^2) + eps) * weight (the mean in float64). The
    loops run on 1-D rows: over 2-D indexing LLVM vectorized neither, and a row took 10x as long."""
    for t in range(x.shape[0]):
        for g0 in range(0, x.shape[1], group):
            row = x[t, g0:g0 + group]
            inv = np.float32(1.0 / np.sqrt(np.float32(_sum_of_squares(row) / group) + eps))
            _scale(row, inv, weight, out[t, g0:g0 + group])


@njit(cache=True, fastmath={"reassoc", "nsz"})
def _sum_of_squares(row):
    """The sum of row's squares in float64, reassociated so that it vectorizes (not one add's latency
    after another)."""
    total = 0.0
    for j in range(row.shape[0]):
        value = np.float64(row[j])
        total += value * value
    return total


@njit(cache=True)
def _scale(row, inv, weight, out):
    for j in range(row.shape[0]):
        out[j] = row[j] * inv * weight[j]


@njit(cache=True)
def rope(x, positions, cos_table, sin_table, head_dim, out):
    """Hugging Face rotate_half on each head_dim slice of every row; cos/sin tables are
    [positions, rotary_dim / 2]; columns past the rotary dims pass through."""
    half = cos_table.shape[1]
    for t in range(x.shape[0]):
        p = positions[t]
        for h0 in range(0, x.shape[1], head_dim):
            for i in range(half):
                x1, x2 = x[t, h0 + i], x[t, h0 + half + i]
                c, s = cos_table[p, i], sin_table[p, i]
                out[t, h0 + i] = x1 * c - x2 * s
                out[t, h0 + half + i] = x2 * c + x1 * s
            for i in range(h0 + 2 * half, h0 + head_dim):
                out[t, i] = x[t, i]


ROW_TILE, TOKEN_TILE = 16, 8  # a 16-row weight tile and 8 token rows stay in L1/L2 while they meet


@njit(cache=True, fastmath=DOT_MATH)
def linear_f32(x, weight, out, r0, r1):
    """Rows r0 .. r1 - 1 of out = x @ weight.T for float32 weights: tiles of weight rows, each read from
    memory once per step and met by every token in tiles of a few rows (GEMM-shaped for prefill)."""
    n_tokens = x.shape[0]
    for tile in range(r0, r1, ROW_TILE):
        for t0 in range(0, n_tokens, TOKEN_TILE):
            for r in range(tile, min(r1, tile + ROW_TILE)):
                for t in range(t0, min(n_tokens, t0 + TOKEN_TILE)):
                    total = np.float32(0.0)
                    for i in range(x.shape[1]):
                        total += x[t, i] * weight[r, i]
                    out[t, r] = total
