"""OpenCL C for the hand-written kernels (everything but fused elementwise groups, which cgen writes).

Written for PoCL on CPUs first: one work-item does a register-blocked tile with vector loads (the
compiler keeps the tile in registers; local-memory tiling is much slower there) and plain loops the
vectorizer handles. Semantics follow lse_core.graph.ir exactly.

Quantized weights are repacked at upload (device.py): ``scale`` (and ``minimum``) float32
[rows, blocks], and the quants [rows, blocks, 16] uchar for 4-bit types — byte j holds element j in
its low nibble and element j + 16 in its high one, as GGUF stores them — or [rows, blocks, 32] char
for Q8_0; Q5 types add ``high`` [rows, blocks, 4], their fifth bits. Q4_0 is stored as Q4_1 with
minimum = -8 * scale, Q5_0 as Q5_1 with minimum = -16 * scale, so one kernel serves all four.
"""

from __future__ import annotations

COMMON = r"""
#define IDX(a, b, n) ((size_t)(a) * (size_t)(n) + (size_t)(b))
"""

EMBEDDING = COMMON + r"""
__kernel void embedding_f32(__global float* out, __global const float* table, __global const int* tokens,
                            const int width, const float emb_scale) {
  const int c = get_global_id(0), t = get_global_id(1);
  if (c >= width) return;
  out[IDX(t, c, width)] = table[IDX(tokens[t], c, width)] * emb_scale;
}

__kernel void embedding_q4(__global float* out, __global const float* scale, __global const float* minimum,
                           __global const uchar* quants, __global const uchar* high,
                           __global const int* tokens, const int width, const float emb_scale) {
  const int c = get_global_id(0), t = get_global_id(1);
  if (c >= width) return;
  const size_t block = IDX(tokens[t], c / 32, width / 32);
  const int j = c % 32;
  const uchar byte = quants[block * 16 + (j & 15)];
  int q = j < 16 ? byte & 15 : byte >> 4;
#if FIFTH_BIT
  q |= ((high[block * 4 + j / 8] >> (j % 8)) & 1) << 4;
#endif
  out[IDX(t, c, width)] = ((float)q * scale[block] + minimum[block]) * emb_scale;
}

__kernel void embedding_q8(__global float* out, __global const float* scale, __global const char* quants,
                           __global const int* tokens, const int width, const float emb_scale) {
  const int c = get_global_id(0), t = get_global_id(1);
  if (c >= width) return;
  const size_t row = tokens[t];
  out[IDX(t, c, width)] = (float)quants[IDX(row, c, width)] * scale[IDX(row, c / 32, width / 32)] * emb_scale;
}
"""

# One work-item per (row, group): a serial sum of squares, then the scaled copy.
RMS_NORM = COMMON + r"""
__kernel void rms_norm(__global float* out, __global const float* x, __global const float* weight,
                       const int group_size, const float eps, const int n) {
  const int g = get_global_id(0);
  if (g >= n) return;
  __global const float* xg = x + IDX(g, 0, group_size);
  float ss = 0.0f;
  for (int i = 0; i < group_size; i++) ss += xg[i] * xg[i];
  const float inv = 1.0f / sqrt(ss / (float)group_size + eps);
  for (int i = 0; i < group_size; i++) out[IDX(g, i, group_size)] = xg[i] * inv * weight[i];
}
"""

# One work-item per rotated pair (i, i + rotary_dim / 2) of a head: one sincos serves both; columns
# past rotary_dim are copied by the pairs' work-items.
ROPE = COMMON + r"""
__kernel void rope(__global float* out, __global const float* x, __global const int* positions,
                   __global const float* inv_freq, const int width, const int head_dim, const int rotary_dim) {
  const int c = get_global_id(0), t = get_global_id(1);   // c indexes (head, i), i < head_dim / 2
  const int half_head = head_dim / 2, half_rot = rotary_dim / 2;
  if (c >= width / 2) return;
  const int i = c % half_head;
  const size_t base = IDX(t, (c / half_head) * head_dim, width);
  if (i >= half_rot) {   // the pass-through tail: this work-item copies two of its columns
    const int j = rotary_dim + 2 * (i - half_rot);
    out[base + j] = x[base + j];
    out[base + j + 1] = x[base + j + 1];
    return;
  }
  float cs;
  const float sn = sincos((float)positions[t] * inv_freq[i], &cs);
  const float x1 = x[base + i], x2 = x[base + i + half_rot];
  out[base + i] = x1 * cs - x2 * sn;
  out[base + i + half_rot] = x2 * cs + x1 * sn;
}
"""

LAST_ROWS = COMMON + r"""
__kernel void last_rows(__global float* out, __global const float* x, __global const int* rows, const int width) {
  const int c = get_global_id(0), s = get_global_id(1);
  if (c >= width) return;
  out[IDX(s, c, width)] = x[IDX(rows[s], c, width)];
}
"""

# Built with -DHEAD_DIM=<d> -DK_HALF=<0|1> -DV_HALF=<0|1>. The cache is [slots, kv_len, n_kv_heads * HEAD_DIM]
# per layer, of floats or (K_HALF, V_HALF) of halves: vstore_half_rte rounds to nearest even and vload_half
# widens to float, core OpenCL C that needs no cl_khr_fp16 (half may type only such a buffer's pointer).
ATTENTION = COMMON + r"""
#if K_HALF
typedef half k_t;
#define K_STORE(x, i, p) vstore_half_rte(x, i, p)
#else
typedef float k_t;
#define K_STORE(x, i, p) ((p)[i] = (x))
#endif
#if V_HALF
typedef half v_t;
#define V_STORE(x, i, p) vstore_half_rte(x, i, p)
#else
typedef float v_t;
#define V_STORE(x, i, p) ((p)[i] = (x))
#endif

__kernel void kv_write(__global k_t* k_cache, __global v_t* v_cache, __global const float* k,
                       __global const float* v, __global const int* positions, __global const int* token_slot,
                       const int kv_width, const int kv_len) {
  const int c = get_global_id(0), t = get_global_id(1);
  if (c >= kv_width) return;
  const size_t dst = IDX(IDX(token_slot[t], positions[t], kv_len), c, kv_width);
  K_STORE(k[IDX(t, c, kv_width)], dst, k_cache);
  V_STORE(v[IDX(t, c, kv_width)], dst, v_cache);
}

// One work-item per (query row, head): online softmax over the row's window of cached positions,
// rescaling the accumulator only when the running maximum grows. Head vectors are handled VW floats
// at a time, the widest vector that divides HEAD_DIM.
#if HEAD_DIM % 8 == 0
#define VW 8
typedef float8 vec;
#define VLOAD(i, p) vload8(i, p)
#define VLOAD_HALF(i, p) vload_half8(i, p)
#define VSTORE(v, i, p) vstore8(v, i, p)
float vsum(const vec v) { const float4 a = v.lo + v.hi; return (a.x + a.y) + (a.z + a.w); }
#elif HEAD_DIM % 4 == 0
#define VW 4
typedef float4 vec;
#define VLOAD(i, p) vload4(i, p)
#define VLOAD_HALF(i, p) vload_half4(i, p)
#define VSTORE(v, i, p) vstore4(v, i, p)
float vsum(const vec v) { return (v.x + v.y) + (v.z + v.w); }
#else
#define VW 1
typedef float vec;
#define VLOAD(i, p) ((p)[i])
#define VLOAD_HALF(i, p) vload_half(i, p)
#define VSTORE(v, i, p) ((p)[i] = (v))
float vsum(const vec v) { return v; }
#endif
#define NV (HEAD_DIM / VW)
#if K_HALF
#define K_LOAD(i, p) VLOAD_HALF(i, p)
#else
#define K_LOAD(i, p) VLOAD(i, p)
#endif
#if V_HALF
#define V_LOAD(i, p) VLOAD_HALF(i, p)
#else
#define V_LOAD(i, p) VLOAD(i, p)
#endif

__kernel void attention(__global float* out, __global const float* q, __global const k_t* k_cache,
                        __global const v_t* v_cache, __global const int* positions,
                        __global const int* token_slot, const int n_heads, const int n_kv_heads,
                        const int kv_len, const int window, const float scale) {
  const int h = get_global_id(0), t = get_global_id(1);
  if (h >= n_heads) return;
  const int kv_width = n_kv_heads * HEAD_DIM;
  const int p = positions[t];
  const int start = window > 0 ? max(0, p - window + 1) : 0;
  __global const float* qh = q + IDX(t, h * HEAD_DIM, n_heads * HEAD_DIM);
  const size_t base = IDX(token_slot[t], 0, kv_len) * kv_width + (size_t)(h / (n_heads / n_kv_heads)) * HEAD_DIM;
  vec qs[NV], acc[NV];
  for (int d = 0; d < NV; d++) { qs[d] = VLOAD(d, qh) * scale; acc[d] = (vec)(0.0f); }
  float m = -INFINITY, l = 0.0f;
  for (int j = start; j <= p; j++) {
    __global const k_t* kj = k_cache + base + (size_t)j * kv_width;
    __global const v_t* vj = v_cache + base + (size_t)j * kv_width;
    vec dot = (vec)(0.0f);
    for (int d = 0; d < NV; d++) dot = fma(qs[d], K_LOAD(d, kj), dot);
    const float s = vsum(dot);
    if (s > m) {
      const float correction = exp(m - s);
      for (int d = 0; d < NV; d++) acc[d] *= correction;
      l *= correction;
      m = s;
    }
    const float e = exp(s - m);
    l += e;
    for (int d = 0; d < NV; d++) acc[d] = fma((vec)(e), V_LOAD(d, vj), acc[d]);
  }
  __global float* oh = out + IDX(t, h * HEAD_DIM, n_heads * HEAD_DIM);
  for (int d = 0; d < NV; d++) VSTORE(acc[d] / l, d, oh);
}
"""

# y[t, o] = x[t, :] . w[o, :] (+ bias[o]). Built with -DROWS=<r> -DTOKS=<t>: each work-item computes
# ROWS outputs for TOKS tokens, so one weight load serves TOKS tokens and one activation load ROWS
# rows. Rows and tokens past the end are clamped for loading and not stored. Weights are taken eight
# at a time (the CPU's vector width; wider builtins go through memory there); a quantized block of 32
# is four such chunks, dequantized in registers (q * scale + minimum) and reused for every token.
LINEAR = COMMON + r"""
float hsum8(const float8 v) {
  const float4 a = v.lo + v.hi;
  return (a.x + a.y) + (a.z + a.w);
}

// The products past the last full chunk of eight (float32 rows of any length).
float tail(__global const float* w, __global const float* x, const int from, const int n) {
  float s = 0.0f;
  for (int i = from; i < n; i++) s += w[i] * x[i];
  return s;
}

#define LINEAR_ARGS __global const float* bias, const int n_in, const int n_out, const int n_tok, const int has_bias

#define TILE_SETUP                                                                   \
  const int o0 = get_global_id(0) * ROWS, t0 = get_global_id(1) * TOKS;             \
  int orow[ROWS], trow[TOKS];                                                        \
  for (int r = 0; r < ROWS; r++) orow[r] = min(o0 + r, n_out - 1);                   \
  for (int t = 0; t < TOKS; t++) trow[t] = min(t0 + t, n_tok - 1);                   \
  float8 acc[ROWS][TOKS];                                                            \
  for (int r = 0; r < ROWS; r++) for (int t = 0; t < TOKS; t++) acc[r][t] = (float8)(0.0f);

// acc += the weights' chunk c (CHUNK(r) for row r) times the activations' chunk c, every row and token
#define TILE_FMA(c, CHUNK) {                                                         \
  float8 xv[TOKS];                                                                   \
  for (int t = 0; t < TOKS; t++) xv[t] = vload8(c, x + IDX(trow[t], 0, n_in));       \
  for (int r = 0; r < ROWS; r++) {                                                   \
    const float8 wv = CHUNK(r);                                                      \
    for (int t = 0; t < TOKS; t++) acc[r][t] = fma(wv, xv[t], acc[r][t]);            \
  } }

#define TILE_STORE(value)                                                            \
  for (int r = 0; r < ROWS; r++)                                                     \
    for (int t = 0; t < TOKS; t++)                                                   \
      if (o0 + r < n_out && t0 + t < n_tok)                                          \
        y[IDX(t0 + t, o0 + r, n_out)] = (value) + (has_bias ? bias[o0 + r] : 0.0f);

__kernel void linear_f32(__global float* y, __global const float* x, __global const float* w, LINEAR_ARGS) {
  TILE_SETUP
  const int n8 = n_in / 8;
#define F32_CHUNK(r) vload8(c, w + IDX(orow[r], 0, n_in))
  for (int c = 0; c < n8; c++) TILE_FMA(c, F32_CHUNK)
  TILE_STORE(hsum8(acc[r][t]) + tail(w + IDX(orow[r], 0, n_in), x + IDX(trow[t], 0, n_in), n8 * 8, n_in))
}

// A 4-bit block b of a row: 16 bytes, byte j holding element j (low nibble) and j + 16 (high
// nibble), so chunk k is bytes (k & 1) * 8.. shifted by (k >> 1) * 4. Q5 types (built with
// -DFIFTH_BIT=1; a select at run time halves the speed) add a fifth bit per element from the
// block's 4 ``high`` bytes: byte k, bit i for element 8k + i.
#define NIBBLES(blk, k) ((vload8((k) & 1, quants + (blk) * 16) >> (uchar8)(((k) >> 1) * 4)) & (uchar8)(15))
#define FIFTH_BITS(blk, k) \
  ((((uchar8)(high[(blk) * 4 + (k)]) >> (uchar8)(0, 1, 2, 3, 4, 5, 6, 7)) & (uchar8)(1)) << (uchar8)(4))

__kernel void linear_q4(__global float* y, __global const float* x, __global const float* scale,
                        __global const float* minimum, __global const uchar* quants, __global const uchar* high,
                        LINEAR_ARGS) {
  TILE_SETUP
  const int nb = n_in / 32;
  for (int b = 0; b < nb; b++) {
    float d[ROWS], m[ROWS];
    for (int r = 0; r < ROWS; r++) { d[r] = scale[IDX(orow[r], b, nb)]; m[r] = minimum[IDX(orow[r], b, nb)]; }
    for (int k = 0; k < 4; k++) {
#if FIFTH_BIT
#define Q4_BITS(r) (NIBBLES(IDX(orow[r], b, nb), k) | FIFTH_BITS(IDX(orow[r], b, nb), k))
#else
#define Q4_BITS(r) NIBBLES(IDX(orow[r], b, nb), k)
#endif
#define Q4_CHUNK(r) fma(convert_float8(Q4_BITS(r)), (float8)(d[r]), (float8)(m[r]))
      TILE_FMA(b * 4 + k, Q4_CHUNK)
    }
  }
  TILE_STORE(hsum8(acc[r][t]))
}

__kernel void linear_q8(__global float* y, __global const float* x, __global const float* scale,
                        __global const char* quants, LINEAR_ARGS) {
  TILE_SETUP
  const int nb = n_in / 32;
  for (int b = 0; b < nb; b++) {
    float d[ROWS];
    for (int r = 0; r < ROWS; r++) d[r] = scale[IDX(orow[r], b, nb)];
    for (int k = 0; k < 4; k++) {
#define Q8_CHUNK(r) (convert_float8(vload8(b * 4 + k, quants + IDX(orow[r], 0, n_in))) * d[r])
      TILE_FMA(b * 4 + k, Q8_CHUNK)
    }
  }
  TILE_STORE(hsum8(acc[r][t]))
}
"""

# Sampling: one work-group of WG work-items per sequence (row of logits), built with -DWG=<n> and
# -DWINDOW=<the penalty window>.
# Every kernel writes its row to ``out`` (the input stays intact: the caller may read the logits);
# a row whose parameter leaves the op off is copied unchanged. Thresholds are found by bisection on
# the order-preserving integer key of a float (32 passes, each a work-group reduction).
SAMPLING = COMMON + r"""
uint order_key(float f) {
  const uint b = as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

float group_max(float v, __local float* tmp) {
  const int lid = get_local_id(0);
  tmp[lid] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = WG / 2; s > 0; s >>= 1) {
    if (lid < s) tmp[lid] = fmax(tmp[lid], tmp[lid + s]);
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r = tmp[0];
  barrier(CLK_LOCAL_MEM_FENCE);
  return r;
}

float group_sum(float v, __local float* tmp) {
  const int lid = get_local_id(0);
  tmp[lid] = v;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int s = WG / 2; s > 0; s >>= 1) {
    if (lid < s) tmp[lid] += tmp[lid + s];
    barrier(CLK_LOCAL_MEM_FENCE);
  }
  const float r = tmp[0];
  barrier(CLK_LOCAL_MEM_FENCE);
  return r;
}

float row_max(__global const float* row, const int vocab, __local float* tmp) {
  float m = -INFINITY;
  for (int i = get_local_id(0); i < vocab; i += WG) m = fmax(m, row[i]);
  return group_max(m, tmp);
}

void copy_row(__global float* dst, __global const float* src, const int vocab) {
  for (int i = get_local_id(0); i < vocab; i += WG) dst[i] = src[i];
}

// The largest key K with weight(keys >= K) >= target, where weight counts tokens (probs == 0) or
// sums probs[i]; the keys are those of ``row``.
uint bisect_key(__global const float* row, __global const float* probs, const int vocab, const float target,
                __local float* tmp) {
  uint key = 0;
  for (int bit = 31; bit >= 0; bit--) {
    const uint candidate = key | (1u << bit);
    float w = 0.0f;
    for (int i = get_local_id(0); i < vocab; i += WG)
      if (order_key(row[i]) >= candidate) w += probs ? probs[i] : 1.0f;
    if (group_sum(w, tmp) >= target) key = candidate;
  }
  return key;
}

// mask: structured output's allowed tokens, one bit each (bit j % 32 of word j / 32); a constrained
// row's other tokens get -inf.
__kernel void mask(__global float* out, __global const float* logits, __global const int* constrained,
                   __global const int* token_mask, const int vocab) {
  const int s = get_group_id(0);
  __global const float* row = logits + IDX(s, 0, vocab);
  __global float* dst = out + IDX(s, 0, vocab);
  __global const int* bits = token_mask + IDX(s, 0, (vocab + 31) / 32);
  for (int i = get_local_id(0); i < vocab; i += WG) {
    const int allowed = !constrained[s] || ((bits[i >> 5] >> (i & 31)) & 1);
    dst[i] = allowed ? row[i] : -INFINITY;
  }
}

__kernel void penalize(__global float* out, __global const float* logits, __global const int* recent,
                       __global const float* repetition, __global const float* presence, const int vocab) {
  const int s = get_group_id(0), lid = get_local_id(0);
  __global float* row = out + IDX(s, 0, vocab);
  copy_row(row, logits + IDX(s, 0, vocab), vocab);
  barrier(CLK_GLOBAL_MEM_FENCE);
  __global const int* seen = recent + IDX(s, 0, WINDOW);
  for (int j = lid; j < WINDOW; j += WG) {
    const int token = seen[j];
    bool first = token >= 0 && token < vocab;
    for (int i = 0; i < j && first; i++) first = seen[i] != token;
    if (!first) continue;
    const float rp = repetition[s], v = row[token];
    row[token] = (v > 0.0f ? v / rp : v * rp) - presence[s];
  }
}

__kernel void temperature(__global float* out, __global const float* logits, __global const float* temp,
                          const int vocab) {
  const int s = get_group_id(0);
  const float ts = temp[s];
  for (int i = get_local_id(0); i < vocab; i += WG) {
    const float v = logits[IDX(s, i, vocab)];
    out[IDX(s, i, vocab)] = ts > 0.0f ? v / ts : v;
  }
}

__kernel void top_k(__global float* out, __global const float* logits, __global const float* temp,
                    __global const int* top_k, const int vocab) {
  __local float tmp[WG];
  const int s = get_group_id(0), k = top_k[s];
  __global const float* row = logits + IDX(s, 0, vocab);
  if (temp[s] <= 0.0f || k <= 0 || k >= vocab) { copy_row(out + IDX(s, 0, vocab), row, vocab); return; }
  const uint key = bisect_key(row, 0, vocab, (float)k, tmp);
  for (int i = get_local_id(0); i < vocab; i += WG)
    out[IDX(s, i, vocab)] = order_key(row[i]) >= key ? row[i] : -INFINITY;
}

__kernel void top_p(__global float* out, __global const float* logits, __global const float* temp,
                    __global const float* top_p, const int vocab) {
  __local float tmp[WG];
  const int s = get_group_id(0);
  __global const float* row = logits + IDX(s, 0, vocab);
  __global float* dst = out + IDX(s, 0, vocab);
  if (temp[s] <= 0.0f || top_p[s] >= 1.0f) { copy_row(dst, row, vocab); return; }
  const float m = row_max(row, vocab, tmp);
  float z = 0.0f;
  for (int i = get_local_id(0); i < vocab; i += WG) { dst[i] = exp(row[i] - m); z += dst[i]; }
  z = group_sum(z, tmp);
  barrier(CLK_GLOBAL_MEM_FENCE);
  const float target = top_p[s] * z;
  const uint key = min(bisect_key(row, dst, vocab, target, tmp), order_key(m));
  // of the tokens tied with the last kept value, the lowest ids until the mass reaches the target (at
  // least one), as the interpreter keeps them
  float above = 0.0f, tied = 0.0f, at = -INFINITY;
  for (int i = get_local_id(0); i < vocab; i += WG) {
    const uint k = order_key(row[i]);
    if (k > key) above += dst[i];
    else if (k == key) { tied += 1.0f; at = row[i]; }
  }
  float mass = group_sum(above, tmp);
  const float n_tied = group_sum(tied, tmp), weight = exp(group_max(at, tmp) - m);
  float taken = 0.0f;
  for (; taken < n_tied && (taken == 0.0f || mass < target); taken += 1.0f) mass += weight;
  int lo = 0, hi = vocab;   // the smallest id bound below which `taken` tied tokens lie
  while (taken < n_tied && lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    float below = 0.0f;
    for (int i = get_local_id(0); i < mid; i += WG) below += order_key(row[i]) == key ? 1.0f : 0.0f;
    if (group_sum(below, tmp) >= taken) hi = mid; else lo = mid + 1;
  }
  const int bound = taken < n_tied ? lo : vocab;
  barrier(CLK_GLOBAL_MEM_FENCE);
  for (int i = get_local_id(0); i < vocab; i += WG) {
    const uint k = order_key(row[i]);
    dst[i] = k > key || (k == key && i < bound) ? row[i] : -INFINITY;
  }
}

__kernel void min_p(__global float* out, __global const float* logits, __global const float* temp,
                    __global const float* min_p, const int vocab) {
  __local float tmp[WG];
  const int s = get_group_id(0);
  __global const float* row = logits + IDX(s, 0, vocab);
  if (temp[s] <= 0.0f || min_p[s] <= 0.0f) { copy_row(out + IDX(s, 0, vocab), row, vocab); return; }
  const float m = row_max(row, vocab, tmp), floor_p = min_p[s];
  for (int i = get_local_id(0); i < vocab; i += WG)
    out[IDX(s, i, vocab)] = exp(row[i] - m) < floor_p ? -INFINITY : row[i];
}

// Greedy rows: the argmax, lowest id on ties. Others: the first token, in id order, whose cumulative
// probability exceeds uniform * total; each work-item sums one contiguous chunk, then the chunk
// where the crossing falls is scanned.
__kernel void sample(__global int* out, __global const float* logits, __global const float* temp,
                     __global const float* uniform, const int vocab) {
  __local float tmp[WG];
  __local float chunk_sum[WG];
  __local int best[WG];
  const int s = get_group_id(0), lid = get_local_id(0);
  __global const float* row = logits + IDX(s, 0, vocab);
  const float m = row_max(row, vocab, tmp);
  if (temp[s] <= 0.0f) {
    int first = vocab;
    for (int i = lid; i < vocab; i += WG) if (row[i] == m) { first = i; break; }
    best[lid] = first;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = WG / 2; w > 0; w >>= 1) {
      if (lid < w) best[lid] = min(best[lid], best[lid + w]);
      barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) out[s] = best[0];
    return;
  }
  const int chunk = (vocab + WG - 1) / WG, lo = min(lid * chunk, vocab), hi = min(lo + chunk, vocab);
  float sum = 0.0f;
  for (int i = lo; i < hi; i++) sum += exp(row[i] - m);
  chunk_sum[lid] = sum;
  barrier(CLK_LOCAL_MEM_FENCE);
  if (lid != 0) return;
  float total = 0.0f;
  for (int c = 0; c < WG; c++) total += chunk_sum[c];
  const float target = uniform[s] * total;
  float cum = 0.0f;
  int chosen = -1, last_nonzero = 0;
  for (int c = 0; c < WG && chosen < 0; c++) {
    if (cum + chunk_sum[c] <= target) { cum += chunk_sum[c]; continue; }
    for (int i = min(c * chunk, vocab); i < min(c * chunk + chunk, vocab); i++) {
      cum += exp(row[i] - m);
      if (cum > target) { chosen = i; break; }
    }
  }
  if (chosen < 0)  // rounding left the target at the total: the last token with any probability
    for (int i = 0; i < vocab; i++) if (row[i] > -INFINITY) last_nonzero = i;
  out[s] = chosen >= 0 ? chosen : last_nonzero;
}
"""
