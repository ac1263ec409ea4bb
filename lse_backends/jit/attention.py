"""Attention on the jit device: a step's keys and values stored into the KV cache (``store_kv``), then each
query row's heads attending to their sequence's cached positions (``attention``), with the same rules as
kernels.py (preallocated outputs, element-by-element writes, ranges of items).

The cache is head-major bytes, [slots, n_kv, kv_len, row bytes], so a kv head's keys and values are rows of
one contiguous block. A row holds head_dim values as one of the KV_KINDS: float32, f16 (llama.cpp's default,
half the bytes) or q8_0 (GGUF's Q8_0 blocks: per 32 values an f16 scale d and 32 int8 q, value d q; 1.0625
bytes a value). Stores round to the kind (f16 to nearest even; q8_0 as llama.cpp's reference quantizer: d =
max|x| / 127, q = rint(x / d)); reads widen eight values at a time to float32 in registers (vcvtph2ps for f16).
Its dot products run in LLVM vector IR (vector.py): LLVM vectorizes numba's loops over head_dim, but then
reduces every score on its own and keeps the value sums in memory, about 6 GMAC/s a core here; these kernels
reach 22-28 when the rows are in cache.
  scores   eight keys at a time: eight dot products kept as <8 x float> partial sums, reduced together
           (vector.lane_sums) into one vector of eight scores; a last block of fewer keys repeats the last
           key in the lanes past the end, whose scores are left out of the softmax.
  values   each head's weighted sum of the value rows, 64 dims (eight vectors) in registers while the rows
           stream past, then 8 at a time.
Head dims past a multiple of 8 take plain loops. Scores are reduced in a different order from a scalar loop,
and the softmax's division comes after the weighted sum: the results agree with the interpreter's to float32
rounding (on the same cache type).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from . import quant
from .kernels import DOT_MATH, expf
from .vector import (
    LANES,
    clamp,
    f32,
    fma,
    i8,
    i32,
    integer,
    lane_sums,
    load_floats,
    row_pointer,
    splat,
    store_floats,
    v8f16,
    v8f32,
    v8i8,
    vector,
)

KV_F32, KV_F16, KV_Q8_0 = 0, 1, 2
KV_KINDS = {"f32": KV_F32, "f16": KV_F16, "q8_0": KV_Q8_0}
Q8_0_VALUES, Q8_0_BYTES = 32, 34  # a q8_0 block: 32 values, stored as an f16 scale and 32 int8s
BLOCK_VECTORS = Q8_0_VALUES // LANES
VECTOR_HALVES = quant.AVX2  # F16C rounds eight floats to halves at once; elsewhere a scalar loop does


def row_bytes(kind: int, head_dim: int) -> int:
    """Bytes of one cached row of head_dim values (q8_0: head_dim a multiple of 32, which lse_open checks)."""
    return {KV_F32: 4 * head_dim, KV_F16: 2 * head_dim, KV_Q8_0: head_dim // Q8_0_VALUES * Q8_0_BYTES}[kind]


VALUE_VECTORS = 8  # vectors of head dims a value pass keeps in registers (with the broadcast weight, 9 of 16)
# Value rows a pass takes at a time, in floats (16 KB): the group's heads take turns on them while they are in
# L1, instead of each head streaming all the rows from L2 (which bound the pass at 16 GMAC/s here)
VALUE_CHUNK = 4096


def _check_arrays(floats, cached) -> None:
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and a.dtype == types.float32
               for a in floats):
        raise TypingError("attention's vector kernels take C-contiguous 2-D float32 arrays")
    if not (isinstance(cached, types.Array) and cached.ndim == 2 and cached.layout == "C"
            and cached.dtype == types.uint8):
        raise TypingError("attention's vector kernels read the cache as C-contiguous 2-D bytes")


def _load_cached(builder: ir.IRBuilder, row: ir.Value, at: ir.Value, kind: int) -> ir.Value:
    """Values at .. at + 7 (``at`` a multiple of 8) of a cached row at byte pointer ``row``, as <8 x float>."""
    if kind == KV_F32:
        return load_floats(builder, builder.bitcast(row, f32.as_pointer()), at)
    if kind == KV_F16:  # eight f16s, as quant widens its f16 scales
        return quant._halves(builder, builder.gep(row, [builder.mul(at, integer(2))]))
    block = _q8_0_block(builder, row, builder.udiv(at, integer(Q8_0_VALUES)))
    values = _q8_0_quants(builder, block, builder.urem(at, integer(Q8_0_VALUES)))
    return builder.fmul(values, _q8_0_scale(builder, block))


def _q8_0_block(builder: ir.IRBuilder, row: ir.Value, index: ir.Value) -> ir.Value:
    """Byte pointer to q8_0 block ``index`` of a cached row."""
    return builder.gep(row, [builder.mul(index, integer(Q8_0_BYTES))])


def _q8_0_scale(builder: ir.IRBuilder, block: ir.Value) -> ir.Value:
    """A q8_0 block's scale in every lane (widened with the next seven halves, which are its quants)."""
    return splat(builder, builder.extract_element(quant._halves(builder, block), ir.Constant(i32, 0)))


def _q8_0_quants(builder: ir.IRBuilder, block: ir.Value, at: ir.Value) -> ir.Value:
    """A q8_0 block's int8 values at .. at + 7, as <8 x float>."""
    quants = builder.load(builder.bitcast(builder.gep(block, [builder.add(integer(2), at)]), v8i8.as_pointer()),
                          align=1)
    return builder.sitofp(quants, v8f32)


def _make_key_scores(kind: int):
    """An intrinsic ``key_scores(q, head, keys, first, last, scores, j)``: scores[head, j + i] = q[head] .
    keys[min(first + j + i, last)] for i < 8, over the first head_dim // 8 * 8 dims of q's head_dim, the keys
    cached as ``kind``."""

    @intrinsic
    def key_scores(typingctx, q, head, keys, first, last, scores, j):
        _check_arrays((q, scores), keys)
        sig = types.void(q, head, keys, first, last, scores, j)

        def codegen(context, builder, signature, args):
            q_a, keys_a, scores_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                     for i in (0, 2, 5))
            head_i, first_i, last_i, j_i = (context.cast(builder, args[i], signature.args[i], types.intp)
                                            for i in (1, 3, 4, 6))
            query = row_pointer(builder, q_a, head_i, f32)
            key_rows = [row_pointer(builder, keys_a, clamp(builder, builder.add(builder.add(first_i, j_i), integer(i)),
                                                           last_i), i8) for i in range(LANES)]
            sums = [cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in range(LANES)]
            head_dim = builder.extract_value(q_a.shape, 1)
            if kind == KV_Q8_0:  # a block at a time: each key's scale multiplies its block's partial sums once
                with cgutils.for_range(builder, builder.udiv(head_dim, integer(Q8_0_VALUES))) as loop:
                    at = [builder.add(builder.mul(loop.index, integer(Q8_0_VALUES)), integer(LANES * v))
                          for v in range(BLOCK_VECTORS)]
                    q_vectors = [load_floats(builder, query, a) for a in at]
                    for key, total in zip(key_rows, sums):
                        block = _q8_0_block(builder, key, loop.index)
                        partial = vector(0.0)
                        for v, q_vector in enumerate(q_vectors):
                            partial = fma(builder, q_vector, _q8_0_quants(builder, block, integer(LANES * v)), partial)
                        builder.store(fma(builder, partial, _q8_0_scale(builder, block), builder.load(total)), total)
            else:
                with cgutils.for_range(builder, builder.udiv(head_dim, integer(LANES))) as loop:
                    at = builder.mul(loop.index, integer(LANES))
                    q_vector = load_floats(builder, query, at)
                    for key, total in zip(key_rows, sums):
                        key_vector = _load_cached(builder, key, at, kind)
                        builder.store(fma(builder, q_vector, key_vector, builder.load(total)), total)
            scores_row = row_pointer(builder, scores_a, head_i, f32)
            store_floats(builder, lane_sums(builder, [builder.load(total) for total in sums]), scores_row, j_i)
            return context.get_dummy_value()

        return sig, codegen

    return key_scores


def _make_weighted_values(n_vectors: int, kind: int):
    """An intrinsic ``weighted_values(weights, head, j0, j1, values, first, column, out, t, out_column)``:
    out[t, out_column + c] += sum over j0 <= j < j1 of weights[head, j] * values[first + j, column + c],
    for c < 8 * n_vectors, the values cached as ``kind``, the sums in registers while the rows stream past."""

    @intrinsic
    def weighted_values(typingctx, weights, head, j0, j1, values, first, column, out, t, out_column):
        _check_arrays((weights, out), values)
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
                value_row = row_pointer(builder, values_a, builder.add(builder.add(first_i, j0_i), loop.index), i8)
                if kind == KV_Q8_0 and n_vectors % BLOCK_VECTORS == 0:  # whole blocks: the column is a multiple
                    for b in range(n_vectors // BLOCK_VECTORS):          # of 64; one scale per block and row
                        index = builder.add(builder.udiv(column_i, integer(Q8_0_VALUES)), integer(b))
                        block = _q8_0_block(builder, value_row, index)
                        scaled = builder.fmul(weight, _q8_0_scale(builder, block))
                        for v in range(BLOCK_VECTORS):
                            total = sums[b * BLOCK_VECTORS + v]
                            value = _q8_0_quants(builder, block, integer(LANES * v))
                            builder.store(fma(builder, scaled, value, builder.load(total)), total)
                else:
                    for k, total in enumerate(sums):
                        value = _load_cached(builder, value_row, builder.add(column_i, integer(LANES * k)), kind)
                        builder.store(fma(builder, weight, value, builder.load(total)), total)
            for at, total in zip(out_at, sums):
                store_floats(builder, builder.load(total), out_row, at)
            return context.get_dummy_value()

        return sig, codegen

    return weighted_values


# one of each per cache kind, in KV_KINDS' order: numba cannot pick an intrinsic by a runtime value
_key_scores_f32, _key_scores_f16, _key_scores_q8_0 = (_make_key_scores(kind) for kind in (KV_F32, KV_F16, KV_Q8_0))
_values_wide_f32, _values_wide_f16, _values_wide_q8_0 = (_make_weighted_values(VALUE_VECTORS, kind)
                                                        for kind in (KV_F32, KV_F16, KV_Q8_0))
_values_one_f32, _values_one_f16, _values_one_q8_0 = (_make_weighted_values(1, kind)
                                                     for kind in (KV_F32, KV_F16, KV_Q8_0))


@njit(cache=True, nogil=True)
def _half_bits(bits):
    """The f16 bit pattern nearest (ties to even) the float32 with bit pattern ``bits``, as numpy rounds."""
    sign = (bits >> 16) & 0x8000
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0xFF:  # infinity, or NaN (kept a NaN)
        return sign | 0x7C00 | (0x200 if mantissa else 0)
    e = np.int64(exponent) - 112  # f16's biased exponent
    if e >= 31:
        return sign | 0x7C00
    if e <= 0:  # an f16 subnormal, or zero
        if e < -10:
            return sign
        mantissa, shift = mantissa | 0x800000, 14 - e
    else:
        mantissa, shift = (e << 23) | mantissa, 13  # the exponent rides along: a carry rounds it up
    half, rest, tie = mantissa >> shift, mantissa & ((1 << shift) - 1), 1 << (shift - 1)
    if rest > tie or (rest == tie and half & 1):
        half += 1
    return sign | half


@intrinsic
def _store_halves(typingctx, x, row, d):
    """row's bytes 2 d .. 2 d + 15 = x[d .. d + 7] as f16, rounded to nearest even (vcvtps2ph)."""
    sig = types.void(x, row, d)

    def codegen(context, builder, signature, args):
        x_a, row_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1))
        at = context.cast(builder, args[2], signature.args[2], types.intp)
        halves = builder.fptrunc(load_floats(builder, x_a.data, at), v8f16)
        target = builder.gep(builder.bitcast(row_a.data, i8.as_pointer()), [builder.mul(at, integer(2))])
        builder.store(halves, builder.bitcast(target, v8f16.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _store_row(x, row, kind):
    """Store float32 values x as one cached row of ``kind`` (bytes)."""
    if kind == KV_F32:
        floats = row.view(np.float32)
        for d in range(x.shape[0]):   # element by element: a slice assignment compiles numba's broadcasting (1 s)
            floats[d] = x[d]
    elif kind == KV_F16:
        halves, bits = row.view(np.uint16), x.view(np.uint32)
        vectors = x.shape[0] // LANES * LANES if VECTOR_HALVES else 0
        for d in range(0, vectors, LANES):
            _store_halves(x, row, d)
        for d in range(vectors, x.shape[0]):
            halves[d] = _half_bits(bits[d])
    else:
        scales = np.empty(x.shape[0] // Q8_0_VALUES, np.float32)
        for b in range(scales.shape[0]):
            block = x[b * Q8_0_VALUES:(b + 1) * Q8_0_VALUES]
            top = np.float32(0.0)
            for d in range(Q8_0_VALUES):
                top = max(top, abs(block[d]))
            scales[b] = top / np.float32(127.0)
            inverse = np.float32(1.0) / scales[b] if scales[b] != 0 else np.float32(0.0)
            at = b * Q8_0_BYTES
            for d in range(Q8_0_VALUES):
                row[at + 2 + d] = np.uint8(np.int64(np.rint(block[d] * inverse)) & 0xFF)
        scale_bits = scales.view(np.uint32)
        for b in range(scales.shape[0]):
            half = _half_bits(scale_bits[b])
            row[b * Q8_0_BYTES], row[b * Q8_0_BYTES + 1] = half & 0xFF, half >> 8


@njit(cache=True, nogil=True)
def _cached(row, d, kind):
    """Value d of a cached row of ``kind``, as float32 (for the dims past a multiple of 8)."""
    if kind == KV_F32:
        return quant._field(row, 4 * d, 4)
    if kind == KV_F16:
        return quant._field(row, 2 * d, 2)
    at = d // Q8_0_VALUES * Q8_0_BYTES
    q = np.int64(row[at + 2 + d % Q8_0_VALUES])
    return quant._field(row, at, 2) * np.float32(q - 256 if q > 127 else q)


@njit(cache=True)
def store_kv(k, v, k_cache, v_cache, k_kind, v_kind, positions, row_slot, t0, t1):
    """Write rows t0 .. t1 - 1 of the step's k and v into the caches [slots, n_kv, kv_len, row bytes] at
    (row_slot[t], positions[t]), as k_kind and v_kind."""
    n_kv = k_cache.shape[1]
    head_dim = k.shape[1] // n_kv
    for t in range(t0, t1):
        for g in range(n_kv):
            dims = slice(g * head_dim, (g + 1) * head_dim)
            _store_row(k[t, dims], k_cache[row_slot[t], g, positions[t]], k_kind)
            _store_row(v[t, dims], v_cache[row_slot[t], g, positions[t]], v_kind)


@njit(cache=True)
def attention(q, k_cache, v_cache, k_kind, v_kind, positions, row_slot, n_heads, scale, window, sinks, out, i0, i1):
    """Items i0 .. i1 - 1 of a step's n_rows x n_kv (query row, kv head) pairs: each query row attends to
    its sequence's cached positions [max(0, p - window + 1), p] (window 0: from 0); query head h reads
    kv head h // (n_heads // n_kv). ``sinks``: a logit per query head in its softmax's denominator (gpt-oss's
    sink_attention), or empty (NO_SINKS)."""
    n_kv, n_rows = k_cache.shape[1], q.shape[0]
    for item in range(i0, i1):
        # rows zigzag (0, n-1, 1, n-2, ...): a prefill row's work grows with its position, so each
        # range of items holds short and long rows alike
        r, g = item // n_kv, item % n_kv
        t = r // 2 if r % 2 == 0 else n_rows - 1 - r // 2
        p = positions[t]
        first = max(0, p - window + 1) if window > 0 else 0
        _attend(q, k_cache[row_slot[t], g], v_cache[row_slot[t], g], k_kind, v_kind, first, p + 1, t, g,
                n_heads // n_kv, q.shape[1] // n_heads, scale, sinks, out)


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
def _exponentiate(scores, sink):
    """scores[j] = exp(scores[j] - m), m the largest of them and ``sink``; returns their sum plus exp(sink - m)
    (sink -inf: none). On a 1-D row, so the loop vectorizes."""
    top = max(_top(scores), sink)
    total = expf(sink - top)
    for j in range(scores.shape[0]):
        e = expf(scores[j] - top)
        scores[j] = e
        total += e
    return total


@njit(cache=True, fastmath=DOT_MATH)
def _attend(q, keys, values, k_kind, v_kind, first, end, t, g, group, head_dim, scale, sinks, out):
    """Query row t's heads of kv head g (a group of them) over cached keys and values [kv_len, row bytes],
    rows first .. end - 1. Each block of eight keys meets every head of the group while it is in L1."""
    n = end - first
    vector_dims = head_dim // LANES * LANES
    scaled_q = np.empty((group, head_dim), np.float32)
    for hh in range(group):
        for d in range(head_dim):
            scaled_q[hh, d] = q[t, (g * group + hh) * head_dim + d] * scale
    scores = np.empty((group, (n + LANES - 1) // LANES * LANES), np.float32)  # whole blocks of eight keys
    for j in range(0, n, LANES):
        for hh in range(group):
            if k_kind == KV_F16:
                _key_scores_f16(scaled_q, hh, keys, first, end - 1, scores, j)
            elif k_kind == KV_Q8_0:
                _key_scores_q8_0(scaled_q, hh, keys, first, end - 1, scores, j)
            else:
                _key_scores_f32(scaled_q, hh, keys, first, end - 1, scores, j)
    totals = np.empty(group, np.float32)
    for hh in range(group):
        for j in range(n if vector_dims < head_dim else 0):  # the dims the vector pass left
            total = scores[hh, j]
            for d in range(vector_dims, head_dim):
                total += scaled_q[hh, d] * _cached(keys[first + j], d, k_kind)
            scores[hh, j] = total
        sink = sinks[g * group + hh] if sinks.shape[0] else np.float32(-np.inf)
        totals[hh] = _exponentiate(scores[hh, :n], sink)
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
                if v_kind == KV_F16:
                    _values_wide_f16(scores, hh, j0, j1, values, first, c, out, t, at + c)
                elif v_kind == KV_Q8_0:
                    _values_wide_q8_0(scores, hh, j0, j1, values, first, c, out, t, at + c)
                else:
                    _values_wide_f32(scores, hh, j0, j1, values, first, c, out, t, at + c)
            for c in range(wide, vector_dims, LANES):
                if v_kind == KV_F16:
                    _values_one_f16(scores, hh, j0, j1, values, first, c, out, t, at + c)
                elif v_kind == KV_Q8_0:
                    _values_one_q8_0(scores, hh, j0, j1, values, first, c, out, t, at + c)
                else:
                    _values_one_f32(scores, hh, j0, j1, values, first, c, out, t, at + c)
            for d in range(vector_dims, head_dim):
                weighted = np.float32(0.0)
                for j in range(j0, j1):
                    weighted += scores[hh, j] * _cached(values[first + j], d, v_kind)
                out[t, at + d] += weighted
    for hh in range(group):
        for d in range(head_dim):
            out[t, base + hh * head_dim + d] /= totals[hh]
