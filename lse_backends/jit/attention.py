"""Attention on the jit device: a step's keys and values stored into the KV cache (``store_kv``), then each
query row's heads attending to their sequence's cached positions (``attention``), with the same rules as
kernels.py (preallocated outputs, element-by-element writes, ranges of items).

The cache is head-major, [slots, n_kv, kv_len, head_dim], so a kv head's keys and values are rows of one
contiguous block. Its dot products run in LLVM vector IR (vector.py): LLVM vectorizes numba's loops over
head_dim, but then reduces every score on its own and keeps the value sums in memory, about 6 GMAC/s a
core here; these kernels reach 22-28 when the rows are in cache.
  scores   eight keys at a time: eight dot products kept as <8 x float> partial sums, reduced together
           (vector.lane_sums) into one vector of eight scores.
  values   each head's weighted sum of the value rows, 64 dims (eight vectors) in registers while the rows
           stream past, then 8 at a time.
Head dims past a multiple of 8, and keys past a multiple of 8, take plain loops. Scores are reduced in a
different order from a scalar loop, and the softmax's division comes after the weighted sum: the results
agree with the interpreter's to float32 rounding.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .kernels import DOT_MATH, expf
from .vector import LANES, f32, fma, integer, lane_sums, load_floats, row_pointer, splat, store_floats, v8f32

VALUE_VECTORS = 8  # vectors of head dims a value pass keeps in registers (with the broadcast weight, 9 of 16)
# Value rows a pass takes at a time, in floats (16 KB): the group's heads take turns on them while they are in
# L1, instead of each head streaming all the rows from L2 (which bound the pass at 16 GMAC/s here)
VALUE_CHUNK = 4096


def _check_arrays(*arrays) -> None:
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
               for a in arrays):
        raise TypingError("attention's vector kernels take C-contiguous 2-D float32 arrays")


@intrinsic
def _key_scores(typingctx, q, head, keys, first, scores, j):
    """scores[head, j + i] = q[head] . keys[first + j + i] for i < 8, over the first head_dim // 8 * 8 dims."""
    _check_arrays(q, keys, scores)
    sig = types.void(q, head, keys, first, scores, j)

    def codegen(context, builder, signature, args):
        q_a, keys_a, scores_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4))
        head_i, first_i, j_i = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 5))
        query = row_pointer(builder, q_a, head_i, f32)
        key_rows = [row_pointer(builder, keys_a, builder.add(builder.add(first_i, j_i), integer(i)), f32)
                    for i in range(LANES)]
        sums = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(LANES)]
        n_vectors = builder.udiv(builder.extract_value(keys_a.shape, 1), integer(LANES))
        with cgutils.for_range(builder, n_vectors) as loop:
            at = builder.mul(loop.index, integer(LANES))
            q_vector = load_floats(builder, query, at)
            for key, total in zip(key_rows, sums):
                builder.store(fma(builder, q_vector, load_floats(builder, key, at), builder.load(total)), total)
        scores_row = row_pointer(builder, scores_a, head_i, f32)
        store_floats(builder, lane_sums(builder, [builder.load(total) for total in sums]), scores_row, j_i)
        return context.get_dummy_value()

    return sig, codegen


def _make_weighted_values(n_vectors: int):
    """An intrinsic ``weighted_values(weights, head, j0, j1, values, first, column, out, t, out_column)``:
    out[t, out_column + c] += sum over j0 <= j < j1 of weights[head, j] * values[first + j, column + c],
    for c < 8 * n_vectors, the sums in registers while the rows stream past."""

    @intrinsic
    def weighted_values(typingctx, weights, head, j0, j1, values, first, column, out, t, out_column):
        _check_arrays(weights, values, out)
        sig = types.void(weights, head, j0, j1, values, first, column, out, t, out_column)

        def codegen(context, builder, signature, args):
            weights_a, values_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                          for i in (0, 4, 7))
            head_i, j0_i, j1_i, first_i, column_i, t_i, out_column_i = (
                context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2, 3, 5, 6, 8, 9))
            weight_row = builder.gep(row_pointer(builder, weights_a, head_i, f32), [j0_i])
            out_at = [builder.add(out_column_i, integer(LANES * k)) for k in range(n_vectors)]
            out_row = row_pointer(builder, out_a, t_i, f32)
            sums = [cgutils.alloca_once_value(builder, load_floats(builder, out_row, at)) for at in out_at]
            with cgutils.for_range(builder, builder.sub(j1_i, j0_i)) as loop:
                weight = splat(builder, builder.load(builder.gep(weight_row, [loop.index])))
                value_row = row_pointer(builder, values_a, builder.add(builder.add(first_i, j0_i), loop.index), f32)
                for k, total in enumerate(sums):
                    value = load_floats(builder, value_row, builder.add(column_i, integer(LANES * k)))
                    builder.store(fma(builder, weight, value, builder.load(total)), total)
            for at, total in zip(out_at, sums):
                store_floats(builder, builder.load(total), out_row, at)
            return context.get_dummy_value()

        return sig, codegen

    return weighted_values


_weighted_values_wide, _weighted_values_one = _make_weighted_values(VALUE_VECTORS), _make_weighted_values(1)


@njit(cache=True)
def store_kv(k, v, k_cache, v_cache, positions, row_slot, t0, t1):
    """Write rows t0 .. t1 - 1 of the step's k and v into the caches [slots, n_kv, kv_len, head_dim] at
    (row_slot[t], positions[t])."""
    n_kv, head_dim = k_cache.shape[1], k_cache.shape[3]
    for t in range(t0, t1):
        for g in range(n_kv):
            for d in range(head_dim):
                k_cache[row_slot[t], g, positions[t], d] = k[t, g * head_dim + d]
                v_cache[row_slot[t], g, positions[t], d] = v[t, g * head_dim + d]


@njit(cache=True)
def attention(q, k_cache, v_cache, positions, row_slot, n_heads, scale, window, out, i0, i1):
    """Items i0 .. i1 - 1 of a step's n_rows x n_kv (query row, kv head) pairs: each query row attends to
    its sequence's cached positions [max(0, p - window + 1), p] (window 0: from 0); query head h reads
    kv head h // (n_heads // n_kv)."""
    n_kv, n_rows = k_cache.shape[1], q.shape[0]
    for item in range(i0, i1):
        # rows zigzag (0, n-1, 1, n-2, ...): a prefill row's work grows with its position, so each
        # range of items holds short and long rows alike
        r, g = item // n_kv, item % n_kv
        t = r // 2 if r % 2 == 0 else n_rows - 1 - r // 2
        p = positions[t]
        first = max(0, p - window + 1) if window > 0 else 0
        _attend(q, k_cache[row_slot[t], g], v_cache[row_slot[t], g], first, p + 1, t, g, n_heads // n_kv,
                scale, out)


@njit(cache=True, fastmath={"nnan", "nsz", "reassoc"})
def _top(scores):
    """The largest of the scores but NaNs (assumed away, so that the loop vectorizes; a NaN score still makes
    its row's outputs NaN, through its exp)."""
    top = scores[0]
    for j in range(1, scores.shape[0]):
        score = scores[j]
        top = score if score > top else top
    return top


@njit(cache=True, fastmath=DOT_MATH)
def _exponentiate(scores):
    """scores[j] = exp(scores[j] - their largest); returns their sum. On a 1-D row, so the loop vectorizes."""
    top = _top(scores)
    total = np.float32(0.0)
    for j in range(scores.shape[0]):
        e = expf(scores[j] - top)
        scores[j] = e
        total += e
    return total


@njit(cache=True, fastmath=DOT_MATH)
def _attend(q, keys, values, first, end, t, g, group, scale, out):
    """Query row t's heads of kv head g (a group of them) over keys and values [kv_len, head_dim], rows
    first .. end - 1. Each block of eight keys meets every head of the group while it is in L1."""
    head_dim, n = keys.shape[1], end - first
    vector_dims, blocked = head_dim // LANES * LANES, n // LANES * LANES
    scaled_q = np.empty((group, head_dim), np.float32)
    for hh in range(group):
        for d in range(head_dim):
            scaled_q[hh, d] = q[t, (g * group + hh) * head_dim + d] * scale
    scores = np.empty((group, n), np.float32)
    for j in range(0, blocked, LANES):
        for hh in range(group):
            _key_scores(scaled_q, hh, keys, first, scores, j)
    totals = np.empty(group, np.float32)
    for hh in range(group):
        for j in range(0 if vector_dims < head_dim else blocked, n):  # what the vector pass left
            start = vector_dims if j < blocked else 0
            total = scores[hh, j] if j < blocked else np.float32(0.0)
            for d in range(start, head_dim):
                total += scaled_q[hh, d] * keys[first + j, d]
            scores[hh, j] = total
        totals[hh] = _exponentiate(scores[hh])
    base = g * group * head_dim  # the group's heads' outputs, side by side
    for d in range(group * head_dim):
        out[t, base + d] = 0.0
    wide = vector_dims // (VALUE_VECTORS * LANES) * (VALUE_VECTORS * LANES)
    rows = max(LANES, VALUE_CHUNK // head_dim)
    for j0 in range(0, n, rows):
        j1 = min(n, j0 + rows)
        for hh in range(group):
            at = base + hh * head_dim
            for c in range(0, wide, VALUE_VECTORS * LANES):
                _weighted_values_wide(scores, hh, j0, j1, values, first, c, out, t, at + c)
            for c in range(wide, vector_dims, LANES):
                _weighted_values_one(scores, hh, j0, j1, values, first, c, out, t, at + c)
            for d in range(vector_dims, head_dim):
                weighted = np.float32(0.0)
                for j in range(j0, j1):
                    weighted += scores[hh, j] * values[first + j, d]
                out[t, at + d] += weighted
    for hh in range(group):
        for d in range(head_dim):
            out[t, base + hh * head_dim + d] /= totals[hh]
