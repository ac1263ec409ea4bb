"""What the CUDA device compiles and feeds its kernels, free of CuPy so that machines without a GPU
check it: ``SOURCE``, the hand-written CUDA C of every op in lse_core/graph/ir.py that is neither a
fused elementwise group nor a matmul (cuBLAS), compiled once per device by NVRTC; ``elementwise_source``,
the generated kernel of a fused group (lse_backends/cgen.py); ``STEP_ARRAYS``, the Step's host arrays
the kernels read. Each kernel's comment names its launch shape.

Written for NVRTC, which includes no headers: no INFINITY, no std::; -inf is spelled NEG_INF.
"""

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from lse_backends import cgen
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import SAMPLING_OP_NEEDED, Step

MAX_HEAD_DIM = 256       # attention keeps head_dim / 32 floats per lane in registers
ATTENTION_WARPS = 4      # warps per (token, head) block, each over every 4th cached position
ROW_THREADS = 1024       # threads of the one-block-per-row kernels (norms, sampling)

GEMV_ROWS = 8            # the most activation rows the quantized GEMV takes; more dequantize for cuBLAS
GEMV_WARPS = 4           # output features per GEMV block, one warp each
# GGUF block types read on the device as stored (32 values a block): kernel suffix -> (type id, bytes).
# Other types are dequantized on the host at upload.
QUANT_KINDS = {"Q4_0": ("q4_0", 0, 18), "Q4_1": ("q4_1", 1, 20), "Q8_0": ("q8_0", 2, 34)}

KERNEL_NAMES = ("embedding", "rms_norm", "rope", "kv_write", "attention", "gather_rows",
                "mask", "penalize", "temperature", "top_k", "top_p", "min_p", "sample",
                *(f"{kernel}_{suffix}" for suffix, _, _ in QUANT_KINDS.values()
                  for kernel in ("gemv", "dequantize_rows")))

# The step's host-side facts each kernel may need, as the int32/float32 arrays uploaded for it.
STEP_ARRAYS: dict[str, Callable[[Step], np.ndarray]] = {
    "tokens": lambda s: s.tokens.astype(np.int32),
    "positions": lambda s: s.positions.astype(np.int32),
    "token_slots": lambda s: np.repeat(s.slots, np.diff(s.query_starts)).astype(np.int32),
    "sample_rows": lambda s: s.sample_rows.astype(np.int32),
    "recent": lambda s: s.sampling.recent.astype(np.int32),
    **{name: (lambda s, name=name: getattr(s.sampling, name).astype(np.float32))
       for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "uniform")},
    "top_k": lambda s: s.sampling.top_k.astype(np.int32),
    "token_mask": lambda s: s.sampling.token_mask.astype(np.int32),   # read after the plan awaited it
    **{f"needed.{op}": (lambda s, op=op: SAMPLING_OP_NEEDED[op](s.sampling).astype(np.int32))
       for op in SAMPLING_OP_NEEDED},
}


def elementwise_source(group: FusedGroup) -> cgen.KernelSource:
    """The generated CUDA C of an elementwise fused group: outputs, inputs, then ``int n``. The
    generator's comments name each layer's values; without them the same group in every layer is the
    same source, compiled once."""
    generated = cgen.elementwise_kernel(group, "cuda", "fused")
    return dataclasses.replace(generated, source=re.sub(r"\s*/\*.*?\*/", "", generated.source))


SOURCE = "".join(f"#define {name} {value}\n" for name, value in (
    ("MAX_HEAD_DIM", MAX_HEAD_DIM), ("ATTENTION_WARPS", ATTENTION_WARPS), ("GEMV_ROWS", GEMV_ROWS))) + r"""
#define NEG_INF __int_as_float(0xff800000)
#define PER_LANE (MAX_HEAD_DIM / 32)

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* Block-wide sum / max (blockDim.x a multiple of 32); every thread gets the result. The leading
   barrier keeps a previous call's readers of `partial` safe from this call's writers. */
__device__ float block_sum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_sum(lane < (blockDim.x >> 5) ? partial[lane] : 0.0f);
}

__device__ float block_max(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  return warp_max(lane < (blockDim.x >> 5) ? partial[lane] : NEG_INF);
}

/* The largest value and, among its equals, the lowest index. */
__device__ void block_argmax(float* value, int* index) {
  __shared__ float values[32];
  __shared__ int indices[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v = *value;
  int i = *index;
  for (int round = 0; round < 2; ++round) {
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if (round == 1) break;
    __syncthreads();
    if (lane == 0) { values[warp] = v; indices[warp] = i; }
    __syncthreads();
    const bool live = lane < (blockDim.x >> 5);
    v = live ? values[lane] : NEG_INF;
    i = live ? indices[lane] : 0x7fffffff;
  }
  *value = v;
  *index = i;
}

/* Floats mapped to unsigned ints in the same order (-inf lowest), for exact threshold searches. */
__device__ __forceinline__ unsigned int order_key(float f) {
  const unsigned int u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* embedding: one thread per output element. */
extern "C" __global__ void embedding(float* out, const float* table, const int* tokens,
                                     int n_tokens, int width, float scale) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_tokens * width) return;
  const long t = i / width, c = i % width;
  out[i] = table[(long)tokens[t] * width + c] * scale;
}

/* rms_norm: one block per group of `group` columns (a whole row, or one head). */
extern "C" __global__ void rms_norm(float* out, const float* x, const float* weight, int group, float eps) {
  const long base = (long)blockIdx.x * group;
  float squares = 0.0f;
  for (int c = threadIdx.x; c < group; c += blockDim.x) squares += x[base + c] * x[base + c];
  const float inv = rsqrtf(block_sum(squares) / group + eps);
  for (int c = threadIdx.x; c < group; c += blockDim.x) out[base + c] = x[base + c] * inv * weight[c];
}

/* rope (rotate_half layout): one thread per output element; columns past rotary_dim pass through. */
extern "C" __global__ void rope(float* out, const float* x, const int* positions, const float* inv_freq,
                                int n_tokens, int width, int head_dim, int rotary_dim) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_tokens * width) return;
  const int d = (int)(i % width) % head_dim, half = rotary_dim / 2;
  if (d >= rotary_dim) { out[i] = x[i]; return; }
  const int f = d < half ? d : d - half;
  const float angle = (float)positions[i / width] * inv_freq[f];
  const float c = cosf(angle), s = sinf(angle);
  out[i] = d < half ? x[i] * c - x[i + half] * s : x[i] * c + x[i - half] * s;
}

/* kv_write: one thread per element of k (and v); the caches are [slots, kv_len, kv_width]. */
extern "C" __global__ void kv_write(float* k_cache, float* v_cache, const float* k, const float* v,
                                    const int* token_slots, const int* positions,
                                    int n_tokens, int kv_width, int kv_len) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_tokens * kv_width) return;
  const long t = i / kv_width, c = i % kv_width;
  const long dst = ((long)token_slots[t] * kv_len + positions[t]) * kv_width + c;
  k_cache[dst] = k[i];
  v_cache[dst] = v[i];
}

/* attention: one block per (token, head), blockDim (32, ATTENTION_WARPS). Each warp runs an online
   softmax over every ATTENTION_WARPS-th cached position, each lane holding head_dim / 32 dims of
   the query and the accumulator; the warps' partial results are merged at the end. */
extern "C" __global__ void attention(float* out, const float* q, const float* k_cache, const float* v_cache,
                                     const int* token_slots, const int* positions, int n_heads,
                                     int n_kv_heads, int head_dim, int kv_len, int window, float scale) {
  __shared__ float warp_m[ATTENTION_WARPS], warp_l[ATTENTION_WARPS];
  __shared__ float warp_acc[ATTENTION_WARPS][MAX_HEAD_DIM];
  const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x, warp = threadIdx.y;
  const int kv_width = n_kv_heads * head_dim;
  const int p = positions[t];
  const int first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
  const long cache_base = (long)token_slots[t] * kv_len * kv_width + (h / (n_heads / n_kv_heads)) * head_dim;
  const float* qh = q + ((long)t * n_heads + h) * head_dim;

  float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
  for (int r = 0; r < PER_LANE; ++r) {
    const int d = lane + 32 * r;
    qr[r] = d < head_dim ? qh[d] * scale : 0.0f;
    acc[r] = 0.0f;
  }
  float m = NEG_INF, l = 0.0f;
  for (int j = first + warp; j <= p; j += ATTENTION_WARPS) {
    const float* kj = k_cache + cache_base + (long)j * kv_width;
    const float* vj = v_cache + cache_base + (long)j * kv_width;
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < PER_LANE; ++r) {
      const int d = lane + 32 * r;
      if (d < head_dim) s += qr[r] * kj[d];
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new), weight = expf(s - m_new);
    l = l * correction + weight;
#pragma unroll
    for (int r = 0; r < PER_LANE; ++r) {
      const int d = lane + 32 * r;
      if (d < head_dim) acc[r] = acc[r] * correction + weight * vj[d];
    }
    m = m_new;
  }
  if (lane == 0) { warp_m[warp] = m; warp_l[warp] = l; }
#pragma unroll
  for (int r = 0; r < PER_LANE; ++r) {
    const int d = lane + 32 * r;
    if (d < head_dim) warp_acc[warp][d] = acc[r];
  }
  __syncthreads();
  if (warp != 0) return;
  float m_all = NEG_INF;
  for (int w = 0; w < ATTENTION_WARPS; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float l_all = 0.0f;
  for (int w = 0; w < ATTENTION_WARPS; ++w) l_all += warp_l[w] * expf(warp_m[w] - m_all);
  float* oh = out + ((long)t * n_heads + h) * head_dim;
  for (int d = lane; d < head_dim; d += 32) {
    float o = 0.0f;
    for (int w = 0; w < ATTENTION_WARPS; ++w) o += warp_acc[w][d] * expf(warp_m[w] - m_all);
    oh[d] = o / l_all;
  }
}

/* GGUF blocks of 32 values, read as stored: Q4_0 = f16 d, 16 bytes of nibbles (value (q - 8) * d);
   Q4_1 = f16 d, f16 m, 16 bytes of nibbles (q * d + m); Q8_0 = f16 d, 32 int8 (q * d). A nibble
   byte j holds value j (low) and value j + 16 (high). Blocks are 2-byte aligned (even sizes). */
__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int Q>
__device__ __forceinline__ void dequantize_block(const unsigned char* block, float* w) {
  const float d = half_to_float(*(const unsigned short*)block);
  if (Q == 2) {
    const signed char* qs = (const signed char*)(block + 2);
#pragma unroll
    for (int j = 0; j < 32; ++j) w[j] = d * qs[j];
    return;
  }
  const float m = Q == 1 ? half_to_float(*(const unsigned short*)(block + 2)) : 0.0f;
  const unsigned char* qs = block + (Q == 1 ? 4 : 2);
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int lo = qs[j] & 15, hi = qs[j] >> 4;
    w[j] = Q == 1 ? d * lo + m : d * (lo - 8);
    w[j + 16] = Q == 1 ? d * hi + m : d * (hi - 8);
  }
}

/* gemv: out[t, r] = x[t] . w[r] for n_rows <= GEMV_ROWS activation rows; block (32, GEMV_WARPS),
   one warp per output feature r, each lane over every 32nd block of the weight row. */
template <int Q, int BYTES>
__device__ void gemv(float* out, const float* x, const unsigned char* w, int n_rows, int in, int n_out) {
  const int r = blockIdx.x * blockDim.y + threadIdx.y, lane = threadIdx.x;
  if (r >= n_out) return;
  const int n_blocks = in / 32;
  const unsigned char* row = w + (long)r * n_blocks * BYTES;
  float acc[GEMV_ROWS];
#pragma unroll
  for (int t = 0; t < GEMV_ROWS; ++t) acc[t] = 0.0f;
  for (int b = lane; b < n_blocks; b += 32) {
    float wb[32];
    dequantize_block<Q>(row + (long)b * BYTES, wb);
#pragma unroll
    for (int t = 0; t < GEMV_ROWS; ++t) {
      if (t >= n_rows) break;
      const float* xb = x + (long)t * in + b * 32;
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 32; ++j) s += wb[j] * xb[j];
      acc[t] += s;
    }
  }
#pragma unroll
  for (int t = 0; t < GEMV_ROWS; ++t) {
    if (t >= n_rows) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) out[(long)t * n_out + r] = s;
  }
}

/* dequantize_rows: out row i = scale * weight row rows[i], one thread per block (embedding lookups,
   and whole weights for cuBLAS when a step has more rows than the GEMV takes). */
template <int Q, int BYTES>
__device__ void dequantize_rows(float* out, const unsigned char* w, const int* rows, int n_rows,
                                int blocks_per_row, float scale) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_rows * blocks_per_row) return;
  const long row = rows[i / blocks_per_row], b = i % blocks_per_row;
  float wb[32];
  dequantize_block<Q>(w + (row * blocks_per_row + b) * BYTES, wb);
#pragma unroll
  for (int j = 0; j < 32; ++j) out[i * 32 + j] = wb[j] * scale;
}

#define QUANT_KERNELS(NAME, Q, BYTES)                                                                   \
  extern "C" __global__ void gemv_##NAME(float* out, const float* x, const unsigned char* w, int n_rows, \
                                         int in, int n_out) {                                           \
    gemv<Q, BYTES>(out, x, w, n_rows, in, n_out);                                                       \
  }                                                                                                     \
  extern "C" __global__ void dequantize_rows_##NAME(float* out, const unsigned char* w, const int* rows, \
                                                    int n_rows, int blocks_per_row, float scale) {     \
    dequantize_rows<Q, BYTES>(out, w, rows, n_rows, blocks_per_row, scale);                            \
  }
QUANT_KERNELS(q4_0, 0, 18)
QUANT_KERNELS(q4_1, 1, 20)
QUANT_KERNELS(q8_0, 2, 34)

/* last_rows: one thread per output element. */
extern "C" __global__ void gather_rows(float* out, const float* x, const int* rows, int n_rows, int width) {
  const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long)n_rows * width) return;
  out[i] = x[(long)rows[i / width] * width + i % width];
}

/* The sampling kernels work in place on a copy of the logits, one row per sequence; `needed` says
   which rows the op applies to (the others stay unchanged). */

/* penalize: one block of `window` threads per row, one thread per recent token; a token that
   occurs twice is penalized once, by its first occurrence's thread. */
extern "C" __global__ void penalize(float* logits, const int* recent, const float* repetition,
                                    const float* presence, const int* needed, int vocab, int window) {
  const int row = blockIdx.x, j = threadIdx.x;
  if (!needed[row] || j >= window) return;
  const int* seen = recent + (long)row * window;
  const int token = seen[j];
  if (token < 0 || token >= vocab) return;
  for (int i = 0; i < j; ++i)
    if (seen[i] == token) return;
  float* x = logits + (long)row * vocab + token;
  const float rp = repetition[row];
  const float v = *x > 0.0f ? *x / rp : *x * rp;
  *x = v - presence[row];
}

/* mask: grid (ceil(vocab / blockDim), rows); a constrained row's tokens whose bit is clear (bit j % 32 of
   word j / 32 of the row's ceil(vocab / 32) words) get -inf. */
extern "C" __global__ void mask(float* logits, const int* token_mask, const int* needed, int vocab) {
  const int row = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (!needed[row] || i >= vocab) return;
  const long word = (long)row * ((vocab + 31) / 32) + (i >> 5);
  if (!((token_mask[word] >> (i & 31)) & 1)) logits[(long)row * vocab + i] = NEG_INF;
}

/* temperature: grid (ceil(vocab / blockDim), rows), one thread per element. */
extern "C" __global__ void temperature(float* logits, const float* temperature, const int* needed, int vocab) {
  const int row = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
  if (!needed[row] || i >= vocab) return;
  logits[(long)row * vocab + i] /= temperature[row];
}

/* The largest key K <= hi with count(x >= K) >= k (count_mode) or with mass(x >= K) >= target, where
   mass sums exp(x - max): a binary search over the 32-bit keys, 32 passes over the row. */
__device__ unsigned int threshold_key(const float* x, int vocab, unsigned int hi, bool count_mode,
                                      float k_or_target, float max) {
  unsigned int lo = 0;
  while (lo < hi) {
    const unsigned int mid = lo + (hi - lo + 1u) / 2u;
    float part = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
      if (order_key(x[i]) >= mid) part += count_mode ? 1.0f : expf(x[i] - max);
    if (block_sum(part) >= k_or_target) lo = mid; else hi = mid - 1u;
  }
  return lo;
}

/* top_k: one block per row; keeps every value >= the k-th largest (ties kept). */
extern "C" __global__ void top_k(float* logits, const int* top_k, const int* needed, int vocab) {
  const int row = blockIdx.x, k = top_k[row];
  if (!needed[row] || k >= vocab) return;
  float* x = logits + (long)row * vocab;
  float max = NEG_INF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) max = fmaxf(max, x[i]);
  max = block_max(max);
  const unsigned int keep = threshold_key(x, vocab, order_key(max), true, (float)k, max);
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    if (order_key(x[i]) < keep) x[i] = NEG_INF;
}

/* top_p: one block per row; keeps the smallest prefix by descending probability whose mass reaches
   top_p, id order on ties as in the interpreter: every value above the last kept one, then, of the
   tokens tied with it, the lowest ids until the mass reaches the target. */
extern "C" __global__ void top_p(float* logits, const float* top_p, const int* needed, int vocab) {
  const int row = blockIdx.x;
  if (!needed[row]) return;
  float* x = logits + (long)row * vocab;
  float max = NEG_INF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) max = fmaxf(max, x[i]);
  max = block_max(max);
  float total = 0.0f;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) total += expf(x[i] - max);
  const float target = top_p[row] * block_sum(total);
  const unsigned int keep = threshold_key(x, vocab, order_key(max), false, target, max);
  float above = 0.0f, tied = 0.0f, at = NEG_INF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const unsigned int key = order_key(x[i]);
    if (key > keep) above += expf(x[i] - max);
    else if (key == keep) { tied += 1.0f; at = x[i]; }
  }
  float mass = block_sum(above);
  const float n_tied = block_sum(tied), weight = expf(block_max(at) - max);
  float taken = 0.0f;   /* at least one, as the interpreter keeps the token whose mass reaches the target */
  for (; taken < n_tied && (taken == 0.0f || mass < target); taken += 1.0f) mass += weight;
  int lo = 0, hi = vocab;   /* the smallest id bound below which `taken` tied tokens lie */
  while (taken < n_tied && lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    float below = 0.0f;
    for (int i = threadIdx.x; i < mid; i += blockDim.x) below += order_key(x[i]) == keep ? 1.0f : 0.0f;
    if (block_sum(below) >= taken) hi = mid; else lo = mid + 1;
  }
  const int bound = taken < n_tied ? lo : vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
    const unsigned int key = order_key(x[i]);
    if (key < keep || (key == keep && i >= bound)) x[i] = NEG_INF;
  }
}

/* min_p: one block per row; p < min_p * p_top  <=>  exp(x - max) < min_p. */
extern "C" __global__ void min_p(float* logits, const float* min_p, const int* needed, int vocab) {
  const int row = blockIdx.x;
  if (!needed[row]) return;
  float* x = logits + (long)row * vocab;
  float max = NEG_INF;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) max = fmaxf(max, x[i]);
  max = block_max(max);
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    if (expf(x[i] - max) < min_p[row]) x[i] = NEG_INF;
}

/* sample: one block per row. Greedy rows take the argmax; the others the first token (in id order)
   whose cumulative probability exceeds uniform * total. Each thread owns a contiguous chunk: chunk
   sums are scanned across the block, then every thread walks its own chunk from its prefix. */
extern "C" __global__ void sample(int* out, const float* logits, const float* temperature,
                                  const float* uniform, int vocab) {
  __shared__ float prefix[1024];
  __shared__ int chosen, last_positive;
  const int row = blockIdx.x, tid = threadIdx.x;
  const float* x = logits + (long)row * vocab;
  float max = NEG_INF;
  int best = 0x7fffffff;
  for (int i = tid; i < vocab; i += blockDim.x)
    if (x[i] > max) { max = x[i]; best = i; }
  block_argmax(&max, &best);
  if (temperature[row] <= 0.0f) {
    if (tid == 0) out[row] = best;
    return;
  }
  const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
  const int begin = tid * chunk < vocab ? tid * chunk : vocab;
  const int end = begin + chunk < vocab ? begin + chunk : vocab;
  float mine = 0.0f;
  for (int i = begin; i < end; ++i) mine += expf(x[i] - max);
  prefix[tid] = mine;
  if (tid == 0) { chosen = vocab; last_positive = best; }
  __syncthreads();
  for (int o = 1; o < blockDim.x; o <<= 1) {   /* inclusive Hillis-Steele scan of the chunk sums */
    const float add = tid >= o ? prefix[tid - o] : 0.0f;
    __syncthreads();
    prefix[tid] += add;
    __syncthreads();
  }
  const float target = uniform[row] * prefix[blockDim.x - 1];
  float cumulative = prefix[tid] - mine;
  int last = -1;
  for (int i = begin; i < end; ++i) {
    const float p = expf(x[i] - max);
    if (p <= 0.0f) continue;
    last = i;
    cumulative += p;
    if (cumulative > target) { atomicMin(&chosen, i); break; }
  }
  if (last >= 0) atomicMax(&last_positive, last);
  __syncthreads();
  if (tid == 0) out[row] = chosen < vocab ? chosen : last_positive;
}
"""
