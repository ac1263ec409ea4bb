"""Quantized linear layers: GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and Q5_0 weights, the blocks decoded in
registers or, for Q8_0, Q6_K and Q5_K steps of 8 to 16 tokens, sixteen rows at a time into a float32 panel
that stays in cache (never a dequantized copy of the weights). Steps of more than INT8_TOKENS tokens (prefill)
quantize each block of 32 activations to int8 once per product, as llama.cpp quantizes them to Q8_0/Q8_K for
its GEMMs, and multiply in integer dot products (GEMM tiles: a 512-token chunk of Qwen2.5-0.5B shaped layers,
one thread, 1.7-1.8x faster than through float32 panels). Steps of up to INT8_TOKENS tokens (decode) take
int8 activations where they meet Q4 (and Q5_0) weights, the nibbles multiplying the activation bytes in 16-bit
integer lanes (SmolLM2's whole step at 8 and 16 sequences was 1.17x and 1.13x faster than through float32
panels), and where steps of one or two tokens meet the byte kinds (Q8_0, Q6_K, Q5_K, Q5_1), and float32 ones
elsewhere. Q4 weights take two int8 planes, 15 bits a value (``int8``), in the steps that their product's
``wide`` names (every product's prefill, a gated MLP's down projection's decode too), the byte kinds in
their one-token steps (``_planes``).
Q4_K is read as Q4_1 blocks whose d and m are d sc and -dmin m (``_from_q4_k``: the same values, 0.578
bytes each), Q6_K as blocks with a d sc for each half (``_from_q6_k``, 0.82 bytes each), Q5_K as blocks with
a d and an m (``_from_q5_k``, 0.703 bytes each), their values' bits as GGUF's (nibbles and high bits, which
the tiles turn into Q8_0's bytes: ``_bytes``), each of those scales stored as the super-block's
f16 field and the block's int8 multiplier (LAYOUT), multiplied in the tiles: on SmolLM2-shaped layers, one
thread, a decode token 4.7x (Q4_K), 2.6x (Q6_K) and 2.5x (Q5_K) faster than through the float32 copy they
used to be decoded to (measured when the scales were float32, 0.75 and 1.25 bytes a value). Q5_0 is read in
place, as Q4_0 with the fifth bits ORed into the nibbles' bytes (22 bytes a block: it used to be read as
34-byte Q8_0 blocks), Q5_1 as Q5_K's values with a d and m of its own per block.
The jit device decodes other GGUF types (Q2_K, Q3_K...) exactly to float32 once at load.

Layout. ``prepare`` re-lays a weight once at load into a new array of the same shape and bytes (the K types
and Q5_1: of their conversion's): rows go in groups of GROUP = 8, and block b of a group's rows is stored as
one group block: the eight rows' scales d (f16; for the converted types, f16 fields and then int8
multipliers: LAYOUT), then, where the type has them, their eight mins m (Q6_K: the second half's d; Q5_0:
the fifth bits, two 16-bit fields a row), then the quant bytes four bytes of a row together (bytes
4 p .. 4 p + 3 of row r at ``32 p + 4 r``), so that a tile's 32-byte load p holds a row in each 32-bit lane
as the int8 dot products sum them (the float32 tiles take a byte of each lane by two shifts). Q4_K's and
Q6_K's f16 fields, their super-block's, come once before each run of eight group blocks (SHARED). A Q4 byte
j holds elements j (low nibble) and j + 16 (high nibble); Q8_0 byte j is element j. One vcvtph2ps converts
eight rows' scales, and each vector lane belongs to one row: no horizontal sums, no per-row broadcasts of
scales.
The last rows % 8 rows stay as GGUF stores them (which is this layout for groups of one row) and are
dequantized and dotted one at a time.

Arithmetic, in LLVM vector IR emitted through numba ``@intrinsic``s (numba's own loops widen the
nibbles to int64 and do not vectorize), per tile of row groups x tokens:
  GEMM        (past INT8_TOKENS; Q4 and Q5_0 weights at every step) x = xs * xq per block
              (``int8.quantize_compact``, once per product and thread; for Q4 weights, in the steps ``wide``
              names, two planes, xq = 128 hi + lo), t = sum_i q_i * xq_i exactly in int32 lanes,
              four bytes of a row a lane (``_dot4``: vpdpbusd, or pmaddubsw and pmaddwd, per plane; signed
              weights as |q| times xq with q's sign, psignb), then acc += d * xs * t, plus m * s (Q4_1, Q4_K,
              Q5_K) or - 8 d * s (Q4_0; Q5_0: - 16), s = xs * sum_i xq_i. Tiles of GEMM_GROUPS groups x
              GEMM_TOKENS tokens, or of one group x one token up to ONE_TOKEN_PASSES tokens (every kind;
              the byte kinds in two planes): each weight vector, loaded once, meets every token's four
              activation bytes broadcast. (The Q4 decode tiles once read a layout of eight copies of each
              activation, one per row of a group, that left L1 on wide rows: the compact one streams
              Qwen2.5-1.5B's decode step 1.31x faster. The byte kinds' one-token steps were float32 tiles,
              t = sum_i q_i * x_i, until two planes without a shuffle of the weights measured 1.2-1.4x
              faster, one thread; one plane there flipped near-tied next tokens of output layers, SmolLM2's
              first answer token among them. Prefill computes the output layer for its sampled rows only:
              a decode-sized step.)
  4 tokens    (the byte kinds, Q8_0, Q6_K, Q5_K and Q5_1, from ONE_TOKEN_PASSES to PANEL_TOKENS) w_i = d * q_i,
              then acc_c += w_i * x_ci: each block is decoded once for all the tile's tokens.
  panels      (the byte kinds from PANEL_TOKENS to INT8_TOKENS tokens) a pair of row groups is decoded
              once, the same w_i, to a float32 panel [n, 16]; 4-token panel tiles then run
              acc_ck += w_ik * x_ci with 2 x 4 accumulators: a weight vector loaded serves four tokens, a
              broadcast two weight vectors.
All agree with ``x @ dequantized_W.T`` to float32 summation-order rounding, x being the activations as the
tile sees them (int8 ones times their scales, or float32). The instruction set is vector.ISA, chosen from the
host's features (``vector.select_isa``, ``LSE_JIT_ISA``): the integer dot products are exact on every one, so
the results are the same bit for bit. Where the host has AVX2, F16C and FMA, LLVM lowers the f16 scales to
vcvtph2ps and the int8 products to pmaddubsw and pmaddwd, or vpdpbusd where it has AVX-512 VNNI or AVX-VNNI;
with ``LSE_JIT_ISA=portable`` (or on other targets) they are integer vector ops any LLVM target lowers. Where
it has AMX (``vector.AMX``), GEMM steps of 16 tokens or more multiply in the tile registers instead: each pair
of row groups is widened once to bytes laid out as tile rows with its scales as float32, the activations are
laid out as tiles of 16 tokens once per product and thread, and a tile instruction per block and plane gives
16 x 16 exact int32 dot products, which 512-bit vectors scale by the GEMM tiles' float operations in their
order (``_make_amx_tile``): the same bits. One thread of the 2-core Xeon, 512 tokens of 4864 x 896:
Q8_0 11 ms against 28.6 through the VNNI GEMM tiles, Q4_0 one plane 10-14 against 16-18, two planes 18-23
against 28-29 (the scaling, per block of 32, bounds it: the tile unit does a tile of K = 64 in the time).

Drivers: a product splits into work items, each a range of row groups that every token tile passes over
(the range's weights stay in cache while the tiles pass); the tiles prefetch the weight stream ahead.
``linear_item`` runs one item (programs hand items to their threads; ``linear_pairs_for``'s a range of row
groups), ``linear`` all of them.

Row-invariant (--deterministic): which tile a row meets depends on the step's row count, and the float32
register tiles of four tokens and the panels round differently from the GEMM tiles. With ``row_invariant``
every step takes the path of a one-token step, GEMM tiles for the int8 kinds (a row's result is the same in
a tile of one token or of several, in as many planes) and one-token GEMM tiles on two planes for the byte
kinds, so a row's bits do not depend on the other rows. The measured cost is small (benchmarks/deterministic.py).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from gguf import quants as gguf_quants
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.dispatcher import Dispatcher
from numba.core.errors import TypingError
from numba.extending import intrinsic

from lse_core.devices.host_memory import release_file_pages

from . import amx, int8
from .int8 import BLOCK, PLANE_SCALE
from .vector import (
    AMX,
    AVX2,
    LANES,
    VNNI,
    clamp,
    f32,
    fma,
    i8,
    i16,
    i32,
    integer,
    load,
    prefetch,
    row_pointer,
    splat,
    store,
    store_floats,
    tree_sum,
    v8f16,
    v8f32,
    v8i8,
    v8i16,
    v8i32,
    v32i8,
    vector,
)

Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_K, Q5_0, Q5_1 = range(8)
KINDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0, "Q4_K": Q4_K, "Q6_K": Q6_K, "Q5_K": Q5_K, "Q5_0": Q5_0,
         "Q5_1": Q5_1}
# LAYOUT[kind] = (bytes per 32-value block, bytes of its header: d, or d and m); a tuple numba reads too.
# Header fields are f16 (FIELD bytes). The converted kinds' headers are f16 fields and then MULTIPLIERS[kind]
# int8 multipliers, header value i being f16 field min(i, FIELDS - 1) times multiplier i, as GGUF's K types
# store d sc and dmin m (exact in float32: 11 + 8 significant bits): Q4_K is laid out as Q4_1 blocks whose d
# and m are d sc and -dmin m (_from_q4_k); Q6_K as blocks with a d for each half of the block, d sc0 and
# d sc1, each value d (q - 32) (_from_q6_k); Q5_K as blocks with a d and an m, each value d q + m
# (_from_q5_k), and Q5_1 as blocks of the same values whose d and m are their own f16 fields (multipliers
# 1: _from_q5_1). Q5_0 is read as GGUF stores it, d and 4 bytes of fifth bits, then the nibbles; in a group
# block the fifth bits are rearranged to be cheap to apply (_q5_0_fifth_bits).
# Q6_K's, Q5_K's and Q5_1's values keep their GGUF bits (6, 5, 5): a block's 16 bytes of nibbles as Q4's, then
# 4 HIGH_BITS[kind] bytes of the rest (_packed_values), which the tiles rebuild into the bytes Q8_0's hold
# (_bytes). As whole bytes (34 and 38 a block) they made a Q4_K_M model's decode step stream 1.1x, and a
# Q5_K_M one's 1.6x, the bytes of its file.
# The K types' f16 fields (Q4_K's and Q5_K's d and -dmin; Q6_K's d) are their super-block's, so they are held
# once per SUPER blocks, SHARED[kind] of them before the run of blocks they serve (a group's eight rows'
# together), and their blocks hold the multipliers and the quants alone: 18.5, 26.25 and 22.5 bytes per 32
# values (GGUF's 18, 26.25 and 22), the bytes a decode step streams (one thread-pair streaming 8192 x 2048
# Q4_K, Zen 3: 0.335 -> 0.287 ms, 34 GB/s either way). The other kinds' fields are in each block's header.
LAYOUT = ((18, 2), (20, 4), (34, 2), (18, 2), (26, 2), (22, 2), (22, 6), (26, 6))
HIGH_BITS = (0, 0, 0, 0, 2, 1, 0, 1)   # bits of a value past its nibble, held after the block's nibbles
FIELD = 2
MULTIPLIERS = (0, 0, 0, 2, 2, 2, 0, 2)
SHARED = (0, 0, 0, 2, 1, 2, 0, 0)
WITH_MIN = (Q4_1, Q4_K, Q5_K, Q5_1)   # kinds whose values are d q + m
SUPER = 8   # blocks of a K super-block (256 values)
GROUP = LANES  # rows per group: one vector lane each
NIBBLES = (Q4_0, Q4_1, Q4_K, Q5_0)   # kinds whose quant bytes hold two 4-bit values (Q5_0's fifth bits apart)
# Decoding outruns one core's stream of weights from memory; prefetching this far ahead in each row group's
# stream made one thread's 210 layer GEMVs of SmolLM2 1.5x faster on Zen 3 (5.7 to 46 KB measured alike).
# On the Xeon a prefetch into L1 holds one of the core's few fill buffers until the line arrives: 8 KB ahead
# kept too many lines in flight there. 800 MB of 8192 x 2048 weights, one token, 2 threads, GB/s at 1.5 / 2 /
# 2.5 / 3 / 4 / 8 KB: Q4_K 23.9 / 24.3 / 22.4 / 23.3 / 21.0 / 20.3 (none: 17.8); Q8_0 26.2 at 2 KB, 22.9 at 8.
PREFETCH_BYTES = 8192 if llvm.get_host_cpu_name().startswith("znver") else 2048
# f16 fields that a block's header values are made of (the shared ones, or those in its header)
FIELDS = tuple(SHARED[k] or (LAYOUT[k][1] - MULTIPLIERS[k]) // FIELD for k in range(len(LAYOUT)))
RUN_BYTES = tuple(FIELD * SHARED[k] + SUPER * LAYOUT[k][0] for k in range(len(LAYOUT)))   # a row's, per SUPER blocks


@njit(cache=True, nogil=True, inline="always")
def row_bytes(kind: int, n: int) -> int:
    """The bytes a row of n values holds as ``prepare`` lays this kind out; -1 where it holds no such row."""
    blocks = n // BLOCK
    if n % BLOCK or (SHARED[kind] and blocks % SUPER):
        return -1
    return blocks // SUPER * RUN_BYTES[kind] if SHARED[kind] else blocks * LAYOUT[kind][0]


@njit(cache=True, nogil=True, inline="always")
def _block_at(kind, b, size):
    """(the byte where block b of a row group of ``size`` rows starts, the byte where its f16 fields do)."""
    if SHARED[kind]:
        run = b // SUPER * size * RUN_BYTES[kind]
        return run + size * (FIELD * SHARED[kind] + b % SUPER * LAYOUT[kind][0]), run
    at = b * size * LAYOUT[kind][0]
    return at, at


def _group_block(builder: ir.IRBuilder, weights: ir.Value, b: ir.Value, kind: int) -> tuple[ir.Value, ir.Value]:
    """(byte pointers to group block b of the row group at ``weights``, to the f16 fields it reads): ``_block_at``."""
    group_block = GROUP * LAYOUT[kind][0]
    if not SHARED[kind]:
        block = builder.gep(weights, [builder.mul(b, integer(group_block))])
        return block, block
    run = builder.gep(weights, [builder.mul(builder.lshr(b, integer(SUPER.bit_length() - 1)),
                                            integer(GROUP * RUN_BYTES[kind]))])
    within = builder.and_(b, integer(SUPER - 1))
    return builder.gep(run, [builder.add(integer(GROUP * FIELD * SHARED[kind]),
                                         builder.mul(within, integer(group_block)))]), run


def _row_blocks(builder: ir.IRBuilder, n_bytes: ir.Value, kind: int) -> ir.Value:
    """The blocks in a row of ``n_bytes`` bytes of this kind (``row_bytes``)."""
    if SHARED[kind]:
        return builder.mul(builder.udiv(n_bytes, integer(RUN_BYTES[kind])), integer(SUPER))
    return builder.udiv(n_bytes, integer(LAYOUT[kind][0]))


def _halves_to_floats(builder: ir.IRBuilder, halves: ir.Value) -> ir.Value:
    """<8 x float> of eight f16 bit patterns (<8 x i16>) in integer ops every target has: the exponent
    and mantissa moved into float32 position and scaled by 2^112 (exact for normals and subnormals),
    infinities and NaNs rebuilt, the sign put back."""
    bits = builder.zext(halves, v8i32)
    magnitude = builder.shl(builder.and_(bits, vector(0x7FFF, v8i32)), vector(13, v8i32))
    finite = builder.fmul(builder.bitcast(magnitude, v8f32), vector(2.0 ** 112))
    special = builder.or_(builder.shl(builder.and_(bits, vector(0x3FF, v8i32)), vector(13, v8i32)),
                          vector(0x7F800000, v8i32))
    is_special = builder.icmp_unsigned("==", builder.and_(bits, vector(0x7C00, v8i32)), vector(0x7C00, v8i32))
    value = builder.select(is_special, special, builder.bitcast(finite, v8i32))
    sign = builder.shl(builder.and_(bits, vector(0x8000, v8i32)), vector(16, v8i32))
    return builder.bitcast(builder.or_(value, sign), v8f32)


def _halves(builder: ir.IRBuilder, at: ir.Value) -> ir.Value:
    """Eight f16 values at byte pointer ``at`` as <8 x float>."""
    if AVX2:
        return builder.fpext(load(builder, at, 0, v8f16), v8f32)
    return _halves_to_floats(builder, load(builder, at, 0, v8i16))


def _scales(builder: ir.IRBuilder, block: ir.Value, fields: ir.Value, kind: int, index: int) -> ir.Value:
    """Header value ``index`` (d; then m, or Q6_K's second d) of the group block at byte pointer ``block``
    whose f16 fields are at ``fields`` (``_group_block``), the group's eight rows' as <8 x float>: an f16
    field, or for the converted kinds an f16 field times an int8 multiplier (see LAYOUT)."""
    multipliers = MULTIPLIERS[kind]
    if not multipliers:
        return _halves(builder, builder.gep(block, [integer(GROUP * FIELD * index)]))
    field = _halves(builder, builder.gep(fields, [integer(GROUP * FIELD * min(index, FIELDS[kind] - 1))]))
    in_header = 0 if SHARED[kind] else FIELDS[kind]
    multiplier = load(builder, block, GROUP * (FIELD * in_header + index), v8i8)
    return builder.fmul(field, builder.sitofp(builder.sext(multiplier, v8i32), v8f32))


def _shift_bytes(builder: ir.IRBuilder, value: ir.Value, shift: int) -> ir.Value:
    """Each byte of ``value`` (<32 x i8>) shifted left by ``shift`` bits, or right by -shift."""
    if shift > 0:
        return builder.shl(value, vector(shift, v32i8))
    return builder.lshr(value, vector(-shift, v32i8)) if shift < 0 else value


@njit(cache=True, nogil=True, inline="always")
def _high_bit_at(high_bits, half, j):
    """a, where element j + 16 half of a block keeps its high bits among its row's high bytes: from bit a % 8
    of byte 4 (a // 8) + j % 4 (``_packed_values``). The four elements of a nibble load (j // 4) share a, so
    one shift puts them all in place (``_bytes``)."""
    return high_bits * (2 * (j // 4) + half)


def _bytes(builder: ir.IRBuilder, kind: int, block: ir.Value, p: int, centred: bool = True) -> ir.Value:
    """<32 x i8>: quant load p of a byte kind's (Q8_0, Q6_K, Q5_K, Q5_1) group block at ``block``, elements
    4 p .. 4 p + 3 of a row in each 32-bit lane, as the tiles multiply them: Q8_0's bytes as stored; Q6_K's
    q - 32 (``centred``, else q) and Q5_K's q, rebuilt from the nibbles and HIGH_BITS of each element (see
    ``_packed_values``)."""
    quants = GROUP * LAYOUT[kind][1]
    high_bits = HIGH_BITS[kind]
    if not high_bits:
        return load(builder, block, quants + 32 * p, v32i8)
    half, nibble_load = divmod(p, 4)     # element 4 p + e is nibble ``half`` of byte 4 nibble_load + e
    raw = load(builder, block, quants + 32 * nibble_load, v32i8)
    value = builder.lshr(raw, vector(4, v32i8)) if half else builder.and_(raw, vector(15, v32i8))
    at = _high_bit_at.py_func(high_bits, half, 4 * nibble_load)   # the same bit of each of the load's bytes
    high = load(builder, block, quants + 32 * (4 + at // 8), v32i8)
    mask = vector(((1 << high_bits) - 1) << 4, v32i8)
    value = builder.or_(value, builder.and_(_shift_bytes(builder, high, 4 - at % 8), mask))
    return builder.sub(value, vector(32, v32i8)) if kind == Q6_K and centred else value


def _quants(builder: ir.IRBuilder, kind: int, block: ir.Value) -> Iterator[tuple[int, ir.Value]]:
    """(element index, <8 x float> of that element's eight rows) for a byte kind's block's 32 elements
    (Q8_0, Q6_K, Q5_K, Q5_1), in load order, so that the caller consumes each vector as it is made (fewer live
    registers): each 32-bit lane of a load (``_bytes``) holds four of a row's bytes, byte e moved to the
    top and shifted back down with its sign."""
    for p in range(BLOCK // 4):
        rows = builder.bitcast(_bytes(builder, kind, block, p), v8i32)
        for e in range(4):
            top = builder.shl(rows, vector(24 - 8 * e, v8i32)) if e < 3 else rows
            yield 4 * p + e, builder.sitofp(builder.ashr(top, vector(24, v8i32)), v8f32)




def _with_min(builder: ir.IRBuilder, quants: Iterator[tuple[int, ir.Value]], d: ir.Value,
              m: ir.Value) -> Iterator[tuple[int, ir.Value]]:
    """(i, d q_i + m) for each (i, q_i) of ``quants``."""
    for i, q in quants:
        yield i, fma(builder, q, d, m)


def _make_q8_0_tile(n_tokens: int, n_chains: int, kind: int = Q8_0):
    """The typer of a tile (``_by_kind`` makes its intrinsic) ``tile(w, g, g_last, x, t, out)`` for Q8_0 (or Q6_K, a
    scale for each half block; or Q5_K, whose values are d q + m): out[t + c, rows of group g] for c < n_tokens,
    over float32 activations, each weight decoded once for the tile's tokens. Group and token indices past g_last
    and x's last row are clamped to them: the clamped tile recomputes and rewrites the same values, so any remainder
    can use it."""
    group_block = GROUP * LAYOUT[kind][0]
    span = BLOCK // 2 if kind == Q6_K else BLOCK   # the elements each scale covers

    def tile(typingctx, w, g, g_last, x, t, out):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, x, out)):
            raise TypingError("quantized tiles take C-contiguous 2-D arrays")
        sig = types.void(w, g, g_last, x, t, out)

        def codegen(context, builder, signature, args):
            w_a, x_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 5))
            group, last_group, first_token = (context.cast(builder, args[i], signature.args[i], types.intp)
                                              for i in (1, 2, 4))
            last_token = builder.sub(builder.extract_value(x_a.shape, 0), integer(1))
            tokens = [clamp(builder, builder.add(first_token, integer(c)), last_token) for c in range(n_tokens)]
            group_row = builder.mul(clamp(builder, group, last_group), integer(GROUP))
            weights = row_pointer(builder, w_a, group_row, i8)
            x_rows = [row_pointer(builder, x_a, c, f32) for c in tokens]
            n_blocks = builder.lshr(builder.extract_value(x_a.shape, 1), integer(5))
            zero = ir.Constant(v8f32, None)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_chains)] for _ in tokens]

            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                first = builder.mul(b, integer(BLOCK))
                broadcasts = {}

                def x_at(c: int, i: int) -> ir.Value:
                    """x[token c, element i of block b] in all lanes, loaded where first used."""
                    if (c, i) not in broadcasts:
                        value = builder.load(builder.gep(x_rows[c], [builder.add(first, integer(i))]))
                        broadcasts[c, i] = splat(builder, value)
                    return broadcasts[c, i]

                block, fields = _group_block(builder, weights, b, kind)
                _prefetch_ahead(builder, block, group_block)
                scales = [_scales(builder, block, fields, kind, h) for h in range(BLOCK // span)]
                quants = _quants(builder, kind, block)
                if kind in WITH_MIN:  # w_i = d q_i + m, decoded once a block for every token, as consumed
                    quants = _with_min(builder, quants, scales[0], _scales(builder, block, fields, kind, 1))
                    scales = [vector(1.0)]
                values = [[builder.load(a) for a in accs[c]] for c in range(n_tokens)]   # acc_c += (d * q_i) x_ci
                for n, (i, q) in enumerate(quants):
                    weight = builder.fmul(q, scales[i // span])
                    for c in range(n_tokens):
                        values[c][n % n_chains] = fma(builder, weight, x_at(c, i), values[c][n % n_chains])
                for c in range(n_tokens):
                    for a, v in zip(accs[c], values[c]):
                        builder.store(v, a)

            for c in range(n_tokens):
                store(builder, out_a, tokens[c], group_row, tree_sum(builder, [builder.load(a) for a in accs[c]]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


v16i16 = ir.VectorType(i16, 16)


def _fifth_bits(builder: ir.IRBuilder, kind: int, block: ir.Value) -> ir.Value | None:
    """Q5_0: the group block's fifth bits as ``_nibbles`` takes them (byte 4 r + e holds row r's bits of its
    byte 4 p + e of each quant load p, see ``_q5_0_fifth_bits``); None for the other kinds."""
    if kind != Q5_0:
        return None
    return load(builder, block, GROUP * FIELD, v32i8)


def _nibbles(builder: ir.IRBuilder, kind: int, block: ir.Value, p: int,
             fifth: ir.Value | None) -> tuple[ir.Value, ir.Value]:
    """(low, high) <32 x i8> of quant load p of a Q4 (or Q5_0) group block at ``block``, a row's four bytes
    in each 32-bit lane: the low nibbles' and the high nibbles' values, with Q5_0's fifth bits
    (``_fifth_bits``: bit 2 p + h of a lane's byte, moved to bit 4) ORed in."""
    raw = load(builder, block, GROUP * LAYOUT[kind][1] + 32 * p, v32i8)
    values = [builder.and_(raw, vector(15, v32i8)), builder.lshr(raw, vector(4, v32i8))]
    if fifth is None:
        return values[0], values[1]
    for h in (0, 1):
        values[h] = builder.or_(values[h], builder.and_(_shift_bytes(builder, fifth, 4 - (2 * p + h)),
                                                        vector(16, v32i8)))
    return values[0], values[1]


def _pair_products(builder: ir.IRBuilder, quants: ir.Value, x: ir.Value) -> ir.Value:
    """<16 x i16>: lane i = quants[2i] * x[2i] + quants[2i + 1] * x[2i + 1], quants unsigned, x signed
    (pmaddubsw; never saturates here, as |sum| <= 2 * 128 * 127)."""
    if AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i16, [v32i8, v32i8]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [quants, x])
    v32i16 = ir.VectorType(i16, 32)
    products = builder.mul(builder.zext(quants, v32i16), builder.sext(x, v32i16))
    even, odd = (builder.shuffle_vector(products, products, ir.Constant(ir.VectorType(i32, 16), list(range(e, 32, 2))))
                 for e in (0, 1))
    return builder.add(even, odd)


OFFSET = {Q4_0: -8.0, Q5_0: -16.0}
# Signed weights the int8 tiles multiply as the unsigned bytes w + o, their products then less o sum(xq) (the
# half sums int8.quantize_compact writes): Q6_K's q (o = 32), and Q8_0's q + 128 where vpdpbusd sums the
# products in int32 (pairs of 255 * 127 overflow pmaddubsw's 16-bit lanes and the portable path's). The others
# multiply as |w| times x with w's sign (two more instructions a load, one of them per token).
UNSIGNED_OFFSET = {Q6_K: 32} | ({Q8_0: 128} if VNNI else {})
# The largest |value| a tile multiplies, of each kind's bytes as multiplied (Q6_K's q, Q8_0's any int8)
LARGEST = {Q4_0: 15, Q4_1: 15, Q4_K: 15, Q5_0: 31, Q5_K: 31, Q5_1: 31, Q6_K: 63, Q8_0: 128}


def _dot4(builder: ir.IRBuilder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """<8 x i32>: acc + each 32-bit lane's four products of unsigned bytes and signed bytes (<32 x i8>),
    exactly: vpdpbusd on VNNI; pmaddubsw (pair sums at most 2 * 128 * 127: no saturation for the weights
    here) then pmaddwd by ones on AVX2; widened integer ops elsewhere."""
    if VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i32, [v8i32] * 3),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [acc, builder.bitcast(unsigned, v8i32), builder.bitcast(signed, v8i32)])
    return _widen_pairs(builder, acc, _pair_products(builder, unsigned, signed))


def _widen_pairs(builder: ir.IRBuilder, acc: ir.Value, pairs: ir.Value) -> ir.Value:
    """<8 x i32>: acc + the sums of adjacent 16-bit lanes of ``pairs`` (<16 x i16>): pmaddwd by ones on AVX2,
    widened integer ops elsewhere."""
    if AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i32, [v16i16, v16i16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.add(acc, builder.call(fn, [pairs, vector(1, v16i16)]))
    wide = builder.sext(pairs, ir.VectorType(i32, 16))
    even, odd = (builder.shuffle_vector(wide, wide, ir.Constant(v8i32, list(range(e, 16, 2)))) for e in (0, 1))
    return builder.add(acc, builder.add(even, odd))


def _widen_held(builder: ir.IRBuilder, dots: list[list[ir.Value]], pairs: list[list[ir.Value | None]]) -> None:
    """dots[k][c] += the 16-bit pair sums pairs[k][c] holds (``_widen_pairs``), which are then None."""
    for row_dots, row_pairs in zip(dots, pairs):
        for c, held in enumerate(row_pairs):
            if held is not None:
                row_dots[c], row_pairs[c] = _widen_pairs(builder, row_dots[c], held), None


def _sign_of(builder: ir.IRBuilder, x: ir.Value, w: ir.Value) -> ir.Value:
    """x with w's sign, byte by byte (x, -x or 0 where w > 0, < 0, = 0): psignb. With |w| it makes the
    unsigned-times-signed products w * x for signed weights, as llama.cpp's q8_0 dot products do."""
    if AVX2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32i8, [v32i8, v32i8]),
                                            "llvm.x86.avx2.psign.b")
        return builder.call(fn, [x, w])
    zero = ir.Constant(v32i8, None)
    signed = builder.select(builder.icmp_signed("<", w, zero), builder.neg(x), x)
    return builder.select(builder.icmp_signed("==", w, zero), zero, signed)


def _magnitude(builder: ir.IRBuilder, w: ir.Value) -> ir.Value:
    """|w| byte by byte, as unsigned bytes (|-128| = 128)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32i8, [v32i8, ir.IntType(1)]),
                                        "llvm.abs.v32i8")
    return builder.call(fn, [w, ir.Constant(ir.IntType(1), 0)])


def _make_gemm_tile(kind: int, n_groups: int, n_tokens: int, planes: int = 1):
    """The typer of a tile ``tile(w, g, g_last, scratch, t, t_last, out)`` for any kind (``_by_kind``): out[t + c,
    rows of groups g + k], c < n_tokens, k < n_groups (indices past t_last and g_last clamped to them, as the other
    tiles'), from int8 activations in ``int8.quantize_compact``'s layout of ``planes`` planes. Per block and row,
    the dot products of the block's (or, Q6_K, each half's) int8 weights or nibbles with the activation bytes are
    exact in int32 lanes (``_dot4``, four bytes of a row a lane: each weight vector, gathered once, meets every
    token's four activation bytes broadcast; with two planes, each plane's, the first's shifted by PLANE_SCALE's
    bits and added), then acc += d xs dot, plus the offset term m xs sum(xq) (Q4_1, Q4_K, Q5_K) or o d xs sum(xq)
    (OFFSET: Q4_0, Q5_0), x @ W.T for x = xs * xq. Signed weights (Q6_K; Q8_0 on VNNI) multiply as unsigned bytes
    w + o, less o sum(xq) (UNSIGNED_OFFSET); Q8_0 elsewhere as |w| times x with w's sign."""
    group_block = GROUP * LAYOUT[kind][0]
    offset = UNSIGNED_OFFSET.get(kind, 0)
    nibbles, signed = kind in NIBBLES, kind in (Q8_0, Q6_K) and not offset
    loads = BLOCK // 2 // 4 if nibbles else BLOCK // 4   # 32-byte loads of a group block's quants
    # Without VNNI, each (group, token)'s pmaddubsw results add up in 16-bit lanes, pair_sums of them
    # exactly (|pair| <= 2 * 127 * LARGEST[kind]), before one pmaddwd widens them: a multiply per four
    # bytes instead of two.
    pair_sums = 32767 // (2 * 127 * LARGEST[kind])
    spans = 2 if kind == Q6_K else 1   # Q6_K: a d for each half block (loads 0-3, 4-7)
    two_chains = VNNI and n_groups * n_tokens == 1

    def tile(typingctx, w, g, g_last, scratch, t, t_last, out):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, scratch, out)):
            raise TypingError("quantized tiles take C-contiguous 2-D arrays")
        sig = types.void(w, g, g_last, scratch, t, t_last, out)

        def codegen(context, builder, signature, args):
            w_a, scratch_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                     for i in (0, 3, 6))
            group, last_group, first_token, last_token = (context.cast(builder, args[i], signature.args[i],
                                                                       types.intp) for i in (1, 2, 4, 5))
            tokens = [clamp(builder, builder.add(first_token, integer(c)), last_token) for c in range(n_tokens)]
            group_rows = [builder.mul(clamp(builder, builder.add(group, integer(k)), last_group), integer(GROUP))
                          for k in range(n_groups)]
            weights = [row_pointer(builder, w_a, row, i8) for row in group_rows]
            n_blocks = _row_blocks(builder, builder.extract_value(w_a.shape, 1), kind)
            scales = [row_pointer(builder, scratch_a, c, f32) for c in tokens]  # a row: int8.quantize_compact
            sums = [builder.gep(row, [n_blocks]) for row in scales]
            values = [builder.bitcast(builder.gep(row, [n_blocks]), i8.as_pointer()) for row in sums]
            plane_bytes = builder.mul(n_blocks, integer(BLOCK))
            half_sums = [builder.bitcast(builder.gep(v, [builder.mul(plane_bytes, integer(planes))]),
                                         i32.as_pointer()) for v in values]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in tokens] for _ in weights]
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                blocks, fields = zip(*(_group_block(builder, w_k, b, kind) for w_k in weights))
                for block in blocks:
                    _prefetch_ahead(builder, block, group_block)
                fifths = [_fifth_bits(builder, kind, block) for block in blocks]
                x_blocks = [builder.gep(v, [builder.mul(b, integer(BLOCK))]) for v in values]
                x_scales = [splat(builder, builder.load(builder.gep(r, [b]))) for r in scales]
                x_sums = [splat(builder, builder.load(builder.gep(r, [b]))) for r in sums]

                def x_bytes(c: int, first: int, plane: int) -> ir.Value:
                    """Token c's activations first .. first + 3 of the block in every 32-bit lane (of a plane)."""
                    at = builder.gep(x_blocks[c], [builder.add(integer(first),
                                                               builder.mul(plane_bytes, integer(plane)))])
                    four = builder.load(builder.bitcast(at, i32.as_pointer()), align=1)
                    return builder.bitcast(_splat_i32(builder, four), v32i8)

                for span in range(spans):
                    # per plane: int32 dot products, and pmaddubsw's sums not yet widened
                    dots = [[[ir.Constant(v8i32, None)] * n_tokens for _ in weights] for _ in range(planes)]
                    # One-token tiles on VNNI: every other part's products in a second chain, added at the span's
                    # end. In one chain each vpdpbusd waits for the last (5 cycles), with nothing else of the tile
                    # to run meanwhile (Llama-3.2-1B's Q6_K output layer, decode: 9.55 -> 8.4-8.75 ms).
                    odd_dots = [[[ir.Constant(v8i32, None)] * n_tokens for _ in weights] for _ in range(planes)]
                    pairs = [[[None] * n_tokens for _ in weights] for _ in range(planes)]
                    held = parts = 0
                    for p in range(span * loads // spans, (span + 1) * loads // spans):
                        operands = []   # per weight group: (unsigned bytes, signed bytes' sign or None, element)
                        for block, fifth in zip(blocks, fifths):
                            if nibbles:
                                low, high = _nibbles(builder, kind, block, p, fifth)
                                operands.append([(low, None, 4 * p), (high, None, BLOCK // 2 + 4 * p)])
                            elif offset:   # w + o
                                raw = _bytes(builder, kind, block, p, centred=False)
                                unsigned = builder.xor(raw, vector(-128, v32i8)) if kind == Q8_0 else raw
                                operands.append([(unsigned, None, 4 * p)])
                            else:
                                raw = _bytes(builder, kind, block, p)
                                operands.append([(_magnitude(builder, raw) if signed else raw,
                                                  raw if signed else None, 4 * p)])
                        for part in range(len(operands[0])):
                            chain = odd_dots if two_chains and parts % 2 else dots
                            for c, plane in itertools.product(range(n_tokens), range(planes)):
                                x = x_bytes(c, operands[0][part][2], plane)
                                plane_dots, plane_pairs = chain[plane], pairs[plane]
                                for k, group_operands in enumerate(operands):
                                    unsigned, sign, _ = group_operands[part]
                                    signed_x = x if sign is None else _sign_of(builder, x, sign)
                                    if VNNI:
                                        plane_dots[k][c] = _dot4(builder, plane_dots[k][c], unsigned, signed_x)
                                    else:
                                        products = _pair_products(builder, unsigned, signed_x)
                                        held_k = plane_pairs[k][c]
                                        plane_pairs[k][c] = (products if held_k is None
                                                             else builder.add(held_k, products))
                            held, parts = held + 1, parts + 1
                            if held == pair_sums:
                                for plane in range(planes):
                                    _widen_held(builder, dots[plane], pairs[plane])
                                held = 0
                    for plane in range(planes):
                        _widen_held(builder, dots[plane], pairs[plane])
                    if two_chains:
                        dots = [[[builder.add(a, b) for a, b in zip(*rows)] for rows in zip(*plane_dots)]
                                for plane_dots in zip(dots, odd_dots)]
                    if planes == 2:
                        shift = vector(PLANE_SCALE.bit_length() - 1, v8i32)
                        dots = [[builder.add(builder.shl(first, shift), second) for first, second in zip(*rows)]
                                for rows in zip(*dots)]
                    else:
                        dots = dots[0]
                    if offset:   # less o sum(xq) over the span (Q6_K: the half block's; Q8_0: the block's)
                        for c, row_sums in enumerate(half_sums):
                            halves = [builder.load(builder.gep(row_sums, [builder.add(builder.mul(b, integer(2)),
                                                                                     integer(h))]))
                                      for h in ((span,) if spans == 2 else (0, 1))]
                            total = _splat_i32(builder, builder.mul(ir.Constant(i32, offset),
                                                                    functools.reduce(builder.add, halves)))
                            for row_dots in dots:
                                row_dots[c] = builder.sub(row_dots[c], total)
                    for k, (block, fields_k) in enumerate(zip(blocks, fields)):
                        d = _scales(builder, block, fields_k, kind, span)
                        m = _scales(builder, block, fields_k, kind, 1) if kind in WITH_MIN else None
                        for c in range(n_tokens):
                            dot, acc = builder.sitofp(dots[k][c], v8f32), builder.load(accs[k][c])
                            if m is not None:  # acc += d xs dot + m xs sum(xq)
                                acc = fma(builder, builder.fmul(d, x_scales[c]), dot, fma(builder, m, x_sums[c], acc))
                            elif kind in OFFSET:  # acc += d (xs dot + o xs sum(xq))
                                acc = fma(builder, d, fma(builder, x_scales[c], dot,
                                                          builder.fmul(x_sums[c], vector(OFFSET[kind]))), acc)
                            else:  # acc += d xs dot
                                acc = fma(builder, builder.fmul(d, x_scales[c]), dot, acc)
                            builder.store(acc, accs[k][c])
            for k, row in enumerate(group_rows):
                for c, token in enumerate(tokens):
                    store(builder, out_a, token, row, builder.load(accs[k][c]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _splat_i32(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """An i32 in all eight lanes."""
    one = builder.insert_element(ir.Constant(v8i32, None), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(v8i32, None))


def _make_unpack(kind: int, n_groups: int):
    """The typer of ``unpack(w, g, g_last, panel)`` (``_by_kind``): row groups g + k, k < n_groups (clamped to
    g_last), decoded to float32, panel[i, 8 k + r] = W[8 (g + k) + r, i], each w = d q + m (Q8_0: no m; Q6_K: m is
    the second half's d)."""
    group_block = GROUP * LAYOUT[kind][0]

    def unpack(typingctx, w, g, g_last, panel):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, panel)):
            raise TypingError("panels are unpacked from and to C-contiguous 2-D arrays")
        sig = types.void(w, g, g_last, panel)

        def codegen(context, builder, signature, args):
            w_a, panel_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3))
            first_group, last_group = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2))
            groups = [clamp(builder, builder.add(first_group, integer(k)), last_group) for k in range(n_groups)]
            weights = [row_pointer(builder, w_a, builder.mul(group, integer(GROUP)), i8) for group in groups]
            n_blocks = builder.lshr(builder.extract_value(panel_a.shape, 0), integer(5))
            with cgutils.for_range(builder, n_blocks) as loop:
                b = loop.index
                for k, w_k in enumerate(weights):
                    block, fields = _group_block(builder, w_k, b, kind)
                    _prefetch_ahead(builder, block, group_block)
                    d = _scales(builder, block, fields, kind, 0)
                    m = _scales(builder, block, fields, kind, 1) if kind != Q8_0 else None
                    for i, q in _quants(builder, kind, block):
                        if kind == Q6_K:   # m is the second half's d
                            value = builder.fmul(q, d if i < BLOCK // 2 else m)
                        else:
                            value = builder.fmul(q, d) if m is None else fma(builder, q, d, m)
                        at = builder.add(builder.mul(b, integer(BLOCK)), integer(i))
                        store(builder, panel_a, at, integer(GROUP * k), value)
            return context.get_dummy_value()

        return sig, codegen

    return unpack


def _make_panel_tile(n_groups: int, n_tokens: int):
    """An intrinsic ``panel_tile(panel, x, t, g, g_last, out)``: out[t + c, rows of groups g + k] =
    x[t + c] @ panel for c < n_tokens, k < n_groups, panel as ``unpack`` wrote it for g. Token and group
    indices past x's last row and g_last are clamped to them, as the tiles' are. Each weight vector loaded
    serves every token of the tile, each activation broadcast every vector."""

    @intrinsic
    def panel_tile(typingctx, panel, x, t, g, g_last, out):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (panel, x, out)):
            raise TypingError("panel tiles take C-contiguous 2-D arrays")
        sig = types.void(panel, x, t, g, g_last, out)

        def codegen(context, builder, signature, args):
            panel_a, x_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 5))
            first_token, first_group, last_group = (context.cast(builder, args[i], signature.args[i], types.intp)
                                                    for i in (2, 3, 4))
            last_token = builder.sub(builder.extract_value(x_a.shape, 0), integer(1))
            tokens = [clamp(builder, builder.add(first_token, integer(c)), last_token) for c in range(n_tokens)]
            group_rows = [builder.mul(clamp(builder, builder.add(first_group, integer(k)), last_group), integer(GROUP))
                          for k in range(n_groups)]
            x_rows = [row_pointer(builder, x_a, c, f32) for c in tokens]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8f32, None)) for _ in group_rows]
                    for _ in tokens]
            with cgutils.for_range(builder, builder.extract_value(x_a.shape, 1)) as loop:
                i = loop.index
                vectors = [load(builder, row_pointer(builder, panel_a, i, i8), 4 * GROUP * k, v8f32)
                           for k in range(n_groups)]
                for c in range(n_tokens):
                    x_c = splat(builder, builder.load(builder.gep(x_rows[c], [i])))
                    for k in range(n_groups):
                        builder.store(fma(builder, vectors[k], x_c, builder.load(accs[c][k])), accs[c][k])
            for c in range(n_tokens):
                for k in range(n_groups):
                    store(builder, out_a, tokens[c], group_rows[k], builder.load(accs[c][k]))
            return context.get_dummy_value()

        return sig, codegen

    return panel_tile


def _prefetch_ahead(builder: ir.IRBuilder, block: ir.Value, group_block: int) -> None:
    for line in range(0, group_block, 64):
        prefetch(builder, builder.gep(block, [integer(PREFETCH_BYTES + line)]))


# AMX (vector.AMX): the GEMM tiles' products of 16 tokens x 16 weight rows in the tile registers. A pair of
# row groups is first laid out as tile rows, once per product and thread (``_make_amx_unpack``); then each
# 16 tokens' tile multiplies it block by block, a tile instruction per block and plane (or Q6_K half block),
# and applies the scales as the GEMM tiles do (``_make_amx_tile``).
AMX_GROUPS, AMX_TOKENS = 2, amx.ROWS          # a tile's 16 columns are two row groups' rows, its rows tokens
AMX_QUADS = BLOCK // 4                         # tile rows of a block's values: four of each weight row a row
AMX_VALUES = AMX_QUADS * amx.ROW_BYTES         # a block's values as tile rows, in bytes
AMX_HEADERS = 2                                # header values 0 and 1 (d; m or Q6_K's second d), float32
AMX_BLOCK = AMX_VALUES + AMX_HEADERS * 4 * AMX_GROUPS * GROUP   # a block of the unpacked pair, in bytes
v16i32, v16f32 = ir.VectorType(i32, 16), ir.VectorType(f32, 16)


def _put(builder: ir.IRBuilder, base: ir.Value, offset: int, value: ir.Value) -> None:
    builder.store(value, builder.bitcast(builder.gep(base, [integer(offset)]), value.type.as_pointer()), align=1)


def _make_amx_unpack(kind: int):
    """The typer of ``amx_unpack(w, g, g_last, panel)`` (``_by_kind``): row groups g and g + 1 (clamped to g_last)
    as the AMX tiles read them, panel[b] ([n_blocks, AMX_BLOCK] bytes) for block b: the block's values as tile rows
    (row e: elements 4 e .. 4 e + 3 of each of the 16 weight rows, in bytes as the GEMM tiles multiply them: nibbles
    widened, Q5_0's with their fifth bits), then header values 0 and 1 of the 16 rows as float32 (``_scales``: the
    same floats the GEMM tiles compute)."""
    block_bytes = LAYOUT[kind][0]
    headers = 2 if kind in WITH_MIN or kind == Q6_K else 1

    def amx_unpack(typingctx, w, g, g_last, panel):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (w, panel)):
            raise TypingError("AMX panels are unpacked from and to C-contiguous 2-D arrays")
        sig = types.void(w, g, g_last, panel)

        def codegen(context, builder, signature, args):
            w_a, panel_a = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3))
            first_group, last_group = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2))
            weights = [row_pointer(builder, w_a, builder.mul(clamp(builder, builder.add(first_group, integer(k)),
                                                                     last_group), integer(GROUP)), i8)
                       for k in range(AMX_GROUPS)]
            with cgutils.for_range(builder, builder.extract_value(panel_a.shape, 0)) as loop:
                b = loop.index
                out = row_pointer(builder, panel_a, b, i8)
                for k, w_k in enumerate(weights):
                    block, fields = _group_block(builder, w_k, b, kind)
                    _prefetch_ahead(builder, block, GROUP * block_bytes)
                    for index in range(headers):
                        _put(builder, out, AMX_VALUES + 4 * GROUP * (AMX_GROUPS * index + k),
                             _scales(builder, block, fields, kind, index))
                    if kind in NIBBLES:
                        fifth = _fifth_bits(builder, kind, block)
                        for p in range(AMX_QUADS // 2):   # low nibbles: elements 4 p.., high: 16 + 4 p..
                            for half, quants in enumerate(_nibbles(builder, kind, block, p, fifth)):
                                _put(builder, out, amx.ROW_BYTES * (AMX_QUADS // 2 * half + p) + 32 * k, quants)
                    else:
                        for p in range(AMX_QUADS):
                            _put(builder, out, amx.ROW_BYTES * p + 32 * k, _bytes(builder, kind, block, p))
            return context.get_dummy_value()

        return sig, codegen

    return amx_unpack


def _make_amx_tile(kind: int, planes: int):
    """The typer of ``amx_tile(panel, g, g_last, x_tiles, i, t0, out)`` (``_by_kind``): out[t0 + c, rows of groups g
    and g + 1 (clamped to g_last)] for c < 16, from the panel ``amx_unpack`` wrote for g and token tile i of the
    int8 activations ``_amx_quantize`` laid out in ``planes`` planes (its tokens t0 .. t0 + 15). Per block, the tile
    instruction gives each plane's (Q6_K: each half block's) exact int32 dot products, and the float operations
    after it are the GEMM tiles' (``_make_gemm_tile``), in their order, on 16 rows a vector: the same bits as
    theirs. The tile instructions of the next block run while the vector units scale this one's products: two sets
    of product tiles, even and odd blocks (1.5x the rate of one set, measured)."""
    spans = 2 if kind == Q6_K else 1
    quads, products = AMX_QUADS // spans, spans * planes
    assert products <= 2, "two sets of product tiles, activation tiles and value tiles fill the eight"
    # tiles: products 2 parity + product (0-3), activations 4 + product, values 6 + (span, or parity)

    def values_tile(span: int, parity: int) -> int:
        return 6 + (span if spans == 2 else parity)

    shapes = {c: (amx.ROWS, amx.ROW_BYTES) for c in range(4)}
    shapes |= {4 + c: (amx.ROWS, 4 * quads) for c in range(products)}
    shapes |= {values_tile(span, parity): (quads, amx.ROW_BYTES) for span in range(spans) for parity in (0, 1)}
    product_bytes = amx.ROWS * amx.ROW_BYTES
    x_block, plane_bytes = _amx_x_block.py_func(planes), AMX_TOKENS * BLOCK

    def amx_tile(typingctx, panel, g, g_last, x_tiles, i, t0, out):
        if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in (panel, x_tiles, out)):
            raise TypingError("AMX tiles take C-contiguous 2-D arrays")
        sig = types.void(panel, g, g_last, x_tiles, i, t0, out)

        def codegen(context, builder, signature, args):
            panel_a, x_a, out_a = (context.make_array(signature.args[i])(context, builder, args[i])
                                   for i in (0, 3, 6))
            group, last_group, tile, first = (context.cast(builder, args[i], signature.args[i], types.intp)
                                              for i in (1, 2, 4, 5))
            group_rows = [builder.mul(clamp(builder, builder.add(group, integer(k)), last_group), integer(GROUP))
                          for k in range(AMX_GROUPS)]
            x_row = row_pointer(builder, x_a, tile, i8)
            n_blocks = builder.extract_value(panel_a.shape, 0)
            # each set's products, set after set: product c of set ``parity`` at (parity products + c) product_bytes
            dots = cgutils.alloca_once(builder, ir.ArrayType(i8, 2 * products * product_bytes))
            dots.align = amx.ROW_BYTES   # rows stored and loaded whole, never split across cache lines
            dots = builder.bitcast(dots, i8.as_pointer())
            accs = [cgutils.alloca_once_value(builder, ir.Constant(v16f32, None)) for _ in range(amx.ROWS)]

            def multiply(b: ir.Value, parity: int) -> None:
                """Block b's products in tile set ``parity``, stored to its half of ``dots``."""
                block = row_pointer(builder, panel_a, b, i8)
                x = builder.gep(x_row, [builder.mul(b, integer(x_block))])
                for span in range(spans):
                    values = values_tile(span, parity)
                    amx.load(builder, values, builder.gep(block, [integer(span * quads * amx.ROW_BYTES)]),
                             integer(amx.ROW_BYTES))
                    for plane in range(planes):
                        c = span * planes + plane
                        amx.load(builder, 4 + c, builder.gep(x, [integer(plane * plane_bytes + span * 4 * quads)]),
                                 integer(BLOCK))
                        product = 2 * parity + c
                        amx.zero(builder, product)
                        amx.dot(builder, product, 4 + c, values, kind in (Q8_0, Q6_K))
                        at = builder.gep(dots, [integer((parity * products + c) * product_bytes)])
                        amx.store(builder, product, at, integer(amx.ROW_BYTES))

            def scale(b: ir.Value, parity: int) -> None:
                """acc += block b's products (in ``dots``' half ``parity``) times their scales."""
                block = row_pointer(builder, panel_a, b, i8)
                header = [load(builder, block, AMX_VALUES + 4 * AMX_GROUPS * GROUP * index, v16f32)
                          for index in range(AMX_HEADERS)]
                x = builder.gep(x_row, [builder.add(builder.mul(b, integer(x_block)), integer(planes * plane_bytes))])
                heads = builder.bitcast(x, f32.as_pointer())
                for span in range(spans):
                    d, m = header[span], header[1] if kind in WITH_MIN else None
                    for c in range(amx.ROWS):
                        at = (parity * products + span * planes) * product_bytes + c * amx.ROW_BYTES
                        dot = load(builder, dots, at, v16i32)
                        if planes == 2:
                            dot = builder.add(builder.shl(dot, vector(PLANE_SCALE.bit_length() - 1, v16i32)),
                                              load(builder, dots, at + product_bytes, v16i32))
                        x_scale, x_sum = (
                            splat(builder, builder.load(builder.gep(heads, [integer(AMX_TOKENS * h + c)])), v16f32)
                            for h in (0, 1))
                        dot, acc = builder.sitofp(dot, v16f32), builder.load(accs[c])
                        if m is not None:  # as _make_gemm_tile's
                            acc = fma(builder, builder.fmul(d, x_scale), dot, fma(builder, m, x_sum, acc))
                        elif kind in OFFSET:
                            acc = fma(builder, d, fma(builder, x_scale, dot,
                                                      builder.fmul(x_sum, vector(OFFSET[kind], v16f32))), acc)
                        else:
                            acc = fma(builder, builder.fmul(d, x_scale), dot, acc)
                        builder.store(acc, accs[c])

            def before_end(b: ir.Value):
                return cgutils.if_likely(builder, builder.icmp_signed("<", b, n_blocks))

            out_rows = [row_pointer(builder, out_a, builder.add(first, integer(c)), f32) for c in range(amx.ROWS)]
            for row in out_rows:   # the lines the tile writes last, owned by then (a miss each, out of cache)
                for group_row in group_rows:
                    prefetch(builder, builder.gep(row, [group_row]), write=True)
            amx.configure(builder, shapes)
            multiply(integer(0), 0)
            with cgutils.for_range(builder, builder.ashr(builder.add(n_blocks, integer(1)), integer(1))) as loop:
                even = builder.mul(loop.index, integer(2))
                odd = builder.add(even, integer(1))
                with before_end(odd):
                    multiply(odd, 1)
                scale(even, 0)
                with before_end(odd):
                    with before_end(builder.add(even, integer(2))):
                        multiply(builder.add(even, integer(2)), 0)
                    scale(odd, 1)
            amx.release(builder)
            for c, out_row in enumerate(out_rows):
                acc = builder.load(accs[c])
                for k, group_row in enumerate(group_rows):
                    half = builder.shuffle_vector(acc, acc, ir.Constant(v8i32, list(range(GROUP * k, GROUP * (k + 1)))))
                    store_floats(builder, half, out_row, group_row)
            return context.get_dummy_value()

        return sig, codegen

    return amx_tile


@njit(cache=True, nogil=True, inline="always")
def _amx_x_block(planes):
    """Bytes of a token tile's block in ``_amx_quantize``'s layout: each plane's 16 x 32 values, 16 scales,
    16 sums."""
    return planes * AMX_TOKENS * BLOCK + 2 * 4 * AMX_TOKENS


@njit(cache=True, nogil=True, inline="always")
def _from_a_line(buffer, rows, row_bytes):
    """[rows, row_bytes] of byte array ``buffer`` (row_bytes more than that), from its first cache line on:
    tile rows loaded and stored whole, never split across lines."""
    skip = -buffer.ctypes.data % amx.ROW_BYTES
    return buffer[skip:skip + rows * row_bytes].reshape(rows, row_bytes)



ALL_KINDS = (1 << len(LAYOUT)) - 1   # a ``kinds`` mask (bit k: kind k) of every kind
BYTE_KINDS = (Q8_0, Q6_K, Q5_K, Q5_1)   # kinds whose tiles widen every value to a byte (see the module doc)


def kinds_mask(qtypes: Iterable[str]) -> int:
    """The ``kinds`` mask of the GGUF types among these that the tiles read in place."""
    return sum(1 << KINDS[q] for q in set(qtypes) if q in KINDS)


def _by_kind(tiles: dict[int, Callable]) -> Callable:
    """An intrinsic ``call(kinds, kind, *args)`` that runs the tile of weight kind ``kind`` (``tiles``: kind ->
    a tile's typer; kinds may share one) among those whose bit the mask ``kinds`` sets. Where ``kinds`` is a
    literal (a plan's kernels, ``linear_pairs_for``) only those kinds' tiles are emitted: a model compiles the
    tiles of its own weight types and no others. A kind without a tile here does nothing (``_groups`` sends
    none)."""

    @intrinsic(prefer_literal=True)
    def call(typingctx, kinds, kind, *args):
        mask = kinds.literal_value if isinstance(kinds, types.IntegerLiteral) else ALL_KINDS
        emitted: dict[Callable, list[int]] = {}   # each tile once, with the kinds it serves
        for k, tile in tiles.items():
            if mask >> k & 1:
                emitted.setdefault(tile, []).append(k)
        typed = [(tile(typingctx, *args), served) for tile, served in emitted.items()]

        def codegen(context, builder, signature, values):
            which = context.cast(builder, values[1], signature.args[1], types.int64)
            tile_values = [builder.extract_value(values[2], i) for i in range(len(args))]   # *args: a tuple
            done = builder.append_basic_block("kind_done")
            switch = builder.switch(which, done)
            for (tile_signature, tile_codegen), served in typed:
                block = builder.append_basic_block("kinds_" + "_".join(map(str, served)))
                for k in served:
                    switch.add_case(ir.Constant(which.type, k), block)
                builder.position_at_end(block)
                tile_codegen(context, builder, tile_signature, tile_values)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.void(kinds, kind, types.StarArgTuple(args)), codegen

    return call


def _each(kinds: Iterable[int], make: Callable[[int], Callable]) -> dict[int, Callable]:
    return {kind: make(kind) for kind in kinds}


# Tile shapes, the fastest measured on Zen 3. Q8_0 float32 tiles: four tokens with two partial sums each.
_FOUR_TOKENS = _by_kind(_each(BYTE_KINDS, lambda kind: _make_q8_0_tile(4, 2, kind)))
# GEMM tiles (int8 activations, steps past INT8_TOKENS): groups x tokens. One thread on Zen 4 (AVX-512 VNNI),
# 256 rows x 896 x 256 tokens, GMAC/s of CPU time, Q8_0 / Q4_0: 1 x 4 65 / 119, 2 x 2 55 / 102, 2 x 3 80 / 119,
# 2 x 4 74 / 101, 1 x 8 63 / 127, 4 x 2 75 / 95. 2 x 3 keeps 6 float and 6 int32 accumulators, two weight
# vectors and a broadcast within AVX2's 16 registers.
GEMM_GROUPS, GEMM_TOKENS = 2, 3
_GEMM = _by_kind(_each(range(len(LAYOUT)), lambda kind: _make_gemm_tile(kind, GEMM_GROUPS, GEMM_TOKENS)))
# Two-plane tiles (Q4 weights' prefill): one thread on Zen 3, a 512-token chunk of 4864 x 896 Q4_0, 2 x 3
# 29.9 ms, 2 x 2 32.8, 1 x 2 30.0, 2 x 1 30.1, 1 x 4 33.0 (one plane 16.4-18.7, float32 panels 44.5)
_GEMM_PLANES = _by_kind(_each((Q4_0, Q4_1, Q4_K), lambda kind: _make_gemm_tile(kind, GEMM_GROUPS, GEMM_TOKENS, 2)))
# One-token GEMM tiles (the int8 kinds' steps of up to ONE_TOKEN_PASSES tokens: decode), on the compact
# activations: their byte a value stays in L1 where the former int8 tiles' 8 (a copy per row of the group)
# spilled to L2 on wide rows. Streaming 40 distinct Q4_0 weights, 2 threads, Zen 3: 8960 x 1536 27-31 GB/s
# against 20-21 through those tiles, 1536 x 8960 23 against 14, 8960 x 896 34-36 against 26-29 (the same
# bits); two groups a tile ran slower (12-23 GB/s). At 16 tokens the 2 x 3 GEMM tiles took 8960 x 1536 in
# 27 ms against their 36 (1536 x 8960 alike): the int8 kinds' steps of 3 to 16 tokens take them too.
_GEMV = _by_kind(_each((Q4_0, Q4_1, Q4_K, Q5_0), lambda kind: _make_gemm_tile(kind, 1, 1)))
_GEMV_PLANES = _by_kind(_each((Q4_0, Q4_1, Q4_K, *BYTE_KINDS), lambda kind: _make_gemm_tile(kind, 1, 1, 2)))
# AMX tiles, by the float operations after the products: Q4_1's serve Q4_K, Q5_K and Q5_1 too (d and m)
_AMX_UNPACK = _by_kind(_each(range(len(LAYOUT)), _make_amx_unpack))
_amx_q4_1, _amx_q4_1_planes = _make_amx_tile(Q4_1, 1), _make_amx_tile(Q4_1, 2)
_AMX = _by_kind({**_each((Q4_0, Q8_0, Q6_K, Q5_0), lambda kind: _make_amx_tile(kind, 1)),
                 **dict.fromkeys(WITH_MIN, _amx_q4_1)})
_AMX_PLANES = _by_kind({Q4_0: _make_amx_tile(Q4_0, 2), Q4_1: _amx_q4_1_planes, Q4_K: _amx_q4_1_planes})
PANEL_GROUPS = 2  # row groups a panel holds (three measured no faster, and items hold pairs of groups)
_UNPACK = _by_kind(_each(BYTE_KINDS, lambda kind: _make_unpack(kind, PANEL_GROUPS)))
# Panel tiles: 2 x 4 accumulators, two weight vectors and a broadcast fill 11 of the 16 vector registers.
# (A register tile of 8 tokens in one group, one accumulator each, ran at half their rate: a broadcast per
# FMA, and no slack over the FMA latency.)
_panel_tile = _make_panel_tile(PANEL_GROUPS, 4)
# Tokens per step for each path: past INT8_TOKENS (prefill) every weight takes the GEMM tiles; up to it (a
# decode step of up to 16 sequences) Q4 and Q5_0 weights take the GEMM tiles too, every kind one-token GEMM
# tiles up to ONE_TOKEN_PASSES, and the byte kinds (Q8_0, Q6_K, Q5_K, Q5_1) float32 register tiles of four tokens
# below PANEL_TOKENS and panels from it. Measured on SmolLM2's layers, 2 threads: float32 panels against
# register tiles were slower at 3 and 4 tokens, even at 8, 1.15x at 16 and 1.6x at 512.
ONE_TOKEN_PASSES, PANEL_TOKENS, INT8_TOKENS = 2, 8, 16
# A product's ``wide``: bits for the steps whose activations take two planes where its weights are Q4 (_planes)
WIDE_PREFILL, WIDE_DECODE = 1, 2


@njit(cache=True, nogil=True, inline="always")
def _gemm_tile(kinds, kind, planes, w, g, g_last, scratch, t, t_last, out):
    """The GEMM tile of this weight type for activations of one plane or two (Q4 types)."""
    if planes == 2:
        _GEMM_PLANES(kinds, kind, w, g, g_last, scratch, t, t_last, out)
    else:
        _GEMM(kinds, kind, w, g, g_last, scratch, t, t_last, out)


@njit(cache=True, nogil=True, inline="always")
def _gemv_tile(kinds, kind, planes, w, g, g_last, scratch, t, out):
    """The one-token GEMM tile of this weight type for activations of one plane (Q4 types, Q5_0) or two (Q4
    types, Q8_0, Q6_K, Q5_K, Q5_1)."""
    if planes == 2:
        _GEMV_PLANES(kinds, kind, w, g, g_last, scratch, t, t, out)
    else:
        _GEMV(kinds, kind, w, g, g_last, scratch, t, t, out)


@njit(cache=True, nogil=True, inline="always")
def _amx_tile(kinds, kind, planes, panel, g, g_last, x_tiles, i, t0, out):
    """The AMX tile of this weight type for activations of one plane or two (Q4 types)."""
    if planes == 2:
        _AMX_PLANES(kinds, kind, panel, g, g_last, x_tiles, i, t0, out)
    else:
        _AMX(kinds, kind, panel, g, g_last, x_tiles, i, t0, out)


@njit(cache=True, nogil=True)
def _q4_kind(kind):
    """Q4_0, Q4_1, Q4_K: weights that take two activation planes in the steps a product's ``wide`` names."""
    return kind == Q4_0 or kind == Q4_1 or kind == Q4_K


@njit(cache=True, nogil=True)
def _int8_kind(kind):
    """Q4 and Q5_0 weights meet int8 activations at every step; Q8_0, Q6_K and Q5_K (the byte kinds) in
    steps of up to ONE_TOKEN_PASSES tokens (two planes) and past INT8_TOKENS (one), and float32 ones between
    (see the module doc)."""
    return _q4_kind(kind) or kind == Q5_0


@njit(cache=True, nogil=True)
def _gemm_step(kind, n_tokens, row_invariant):
    """Whether x of n_tokens rows meets this weight in the GEMM tiles (int8 activations): the int8 kinds past
    ONE_TOKEN_PASSES tokens (a tile's row has the bits of the one-token tile's in as many planes: the same
    integer dot products, then the same float operations), the byte kinds past INT8_TOKENS unless every row
    must be computed as a one-row step computes it (``_gemv_step``)."""
    if _int8_kind(kind):
        return n_tokens > ONE_TOKEN_PASSES
    return n_tokens > INT8_TOKENS and not row_invariant


@njit(cache=True, nogil=True)
def _planes(kind, n_tokens, row_invariant, wide):
    """Activation planes of this weight's int8 tiles: two (15 bits a value, ``int8``) where Q4 weights meet a
    product whose ``wide`` has this step's bit, WIDE_PREFILL past INT8_TOKENS tokens and WIDE_DECODE up to it
    (and at every step where rows must have the bits of one-token steps: row_invariant); one elsewhere, as
    llama.cpp's Q8 activations. jit:0 sets WIDE_PREFILL for every product and WIDE_DECODE too for a gated MLP's
    down projection (linear's attrs.mlp), whose input, act(gate) * up, has the few large values that rounding
    a block to int8 costs most. On the default model, teacher-forced against the interpreter over 4 x 64
    positions, decode with one plane everywhere agreed on 247 top tokens, with two for the down projections
    250, two everywhere 255 (but 8-22 % slower decode, twice the integer work for every product). Prefill
    with one plane turns the default model's answer to README's question, with its system prompt (a first
    token 0.08 logits from a tie), from 'The capital of France is Paris.' into "L'Étoile, la Cité, ..."
    (llama.cpp's own answer there), even with two for attention and down: two planes keep the float32
    answer at 1.5x the float32 panels' speed (a 512-token chunk of 4864 x 896 Q4_0, one Zen 3 thread: 29.9 ms,
    panels 44.5, one plane 16.4).
    The byte kinds (Q8_0, Q6_K, Q5_K, Q5_1: output layers among them) take two planes in the one-token tiles, whose
    float32 activations they used to keep (one plane there flipped near-tied next tokens, the default
    model's first answer token among them), and one past INT8_TOKENS."""
    if not _int8_kind(kind):
        return 2 if _gemv_step(kind, n_tokens, row_invariant) else 1
    step = WIDE_DECODE if n_tokens <= INT8_TOKENS or row_invariant else WIDE_PREFILL
    return 2 if _q4_kind(kind) and wide & step else 1


@njit(cache=True, nogil=True)
def _gemv_step(kind, n_tokens, row_invariant):
    """Whether x of n_tokens rows meets this weight in the one-token GEMM tiles: steps of up to
    ONE_TOKEN_PASSES tokens (a row's bits are the other GEMM tiles' in as many planes: the same integer dot
    products, then the same float operations), and for the byte kinds every step where each row must be
    computed as a one-row step computes it."""
    return n_tokens <= ONE_TOKEN_PASSES or (row_invariant and not _int8_kind(kind))


@njit(cache=True, nogil=True)
def _compact_planes(kind, n_tokens, row_invariant, wide):
    """The planes of the int8 activations that x of n_tokens rows takes for this weight
    (``int8.quantize_compact``), or 0 where it takes float32 ones."""
    if _gemm_step(kind, n_tokens, row_invariant) or _gemv_step(kind, n_tokens, row_invariant):
        return _planes(kind, n_tokens, row_invariant, wide)
    return 0


@njit(cache=True, nogil=True, inline="always")
def _int8_groups(kinds, kind, planes, w, x, out, g0, g1, rows, scratch):
    """Row groups g0 .. g1 - 1 against every token of x in GEMM tiles, on x's int8 activations (``rows``)."""
    n_tokens = x.shape[0]
    for g in range(g0, g1, GEMM_GROUPS):
        for t in range(0, n_tokens, GEMM_TOKENS):
            _gemm_tile(kinds, kind, planes, w, g, g1 - 1, rows, t, n_tokens - 1, out)


@njit(cache=True, nogil=True)
def _amx_tiles(scratch, x, planes):
    """``scratch`` as x's int8 activations in the AMX tiles' layout (``_amx_quantize``), from its first cache
    line: [token tiles, blocks x ``_amx_x_block(planes)`` bytes] (in place of the compact rows)."""
    n_tokens, n_blocks = x.shape[0], x.shape[1] // BLOCK
    n_tiles = (n_tokens + AMX_TOKENS - 1) // AMX_TOKENS
    return _from_a_line(scratch.view(np.uint8), n_tiles, n_blocks * _amx_x_block(planes))


@njit(cache=True, nogil=True)
def _amx_quantize(x, tiles, planes):
    """x's rows as int8 (``int8.quantize_block``, the same bytes and scales ``int8.quantize_compact`` gives)
    laid out in ``tiles`` (``_amx_tiles``) as the AMX tiles read them: per tile of 16 tokens (the last one's
    the 16 last tokens, overlapping the tile before) and block, each plane's 16 x 32 values, then the 16
    tokens' scales and their sums."""
    n_tokens, n_blocks = x.shape[0], x.shape[1] // BLOCK
    x_block, plane_bytes = tiles.shape[1] // n_blocks, AMX_TOKENS * BLOCK
    for i in range(tiles.shape[0]):
        t0 = min(i * AMX_TOKENS, n_tokens - AMX_TOKENS)
        tile = tiles[i]
        heads = tile.view(np.float32)
        for c in range(AMX_TOKENS):
            for b in range(n_blocks):
                head = (b * x_block + planes * plane_bytes) // 4 + c
                heads[head], heads[head + AMX_TOKENS], _, _ = int8.quantize_block(
                    x[t0 + c], tile, b, b * x_block + c * BLOCK, plane_bytes, planes)


@njit(cache=True, nogil=True)
def _amx_dequantize(x, tiles, planes):
    """x as the AMX tiles see it (``int8.dequantize`` of what ``_amx_quantize`` wrote to ``tiles``)."""
    n_tokens, n_blocks = x.shape[0], x.shape[1] // BLOCK
    x_block, plane_bytes = tiles.shape[1] // n_blocks, AMX_TOKENS * BLOCK
    seen = np.empty(x.shape, np.float32)
    for i in range(tiles.shape[0]):
        t0 = min(i * AMX_TOKENS, n_tokens - AMX_TOKENS)
        values, heads = tiles[i].view(np.int8), tiles[i].view(np.float32)
        for c in range(AMX_TOKENS):
            for b in range(n_blocks):
                scale = heads[(b * x_block + planes * plane_bytes) // 4 + c]
                for j in range(BLOCK):
                    at = b * x_block + c * BLOCK + j
                    xq = np.float32(values[at])
                    if planes == 2:
                        xq = np.float32(PLANE_SCALE) * xq + np.float32(values[at + plane_bytes])
                    seen[t0 + c, b * BLOCK + j] = scale * xq
    return seen


@njit(cache=True, nogil=True, inline="always")
def _amx_step(kind, n_tokens, row_invariant):
    """Whether x of n_tokens rows meets this weight in AMX tiles: GEMM steps of at least a tile's 16 tokens."""
    return AMX and n_tokens >= AMX_TOKENS and _gemm_step(kind, n_tokens, row_invariant)


@njit(cache=True, nogil=True, inline="always")
def _amx_groups(kinds, kind, planes, w, x, out, g0, g1, rows, scratch):
    """``_int8_groups`` in AMX tiles where x has a tile's 16 tokens: each pair of row groups unpacked once
    (``_AMX_UNPACK``), then met by every token tile of the activations ``quantize_activations`` laid out for
    them (``_amx_tiles``)."""
    n_tokens = x.shape[0]
    if n_tokens < AMX_TOKENS:
        _int8_groups(kinds, kind, planes, w, x, out, g0, g1, rows, scratch)
    else:
        x_tiles = _amx_tiles(scratch, x, planes)
        n_blocks = x.shape[1] // BLOCK
        panel = _from_a_line(np.empty(n_blocks * AMX_BLOCK + amx.ROW_BYTES, np.uint8), n_blocks, AMX_BLOCK)
        for g in range(g0, g1, AMX_GROUPS):
            _AMX_UNPACK(kinds, kind, w, g, g1 - 1, panel)
            for i in range(x_tiles.shape[0]):
                _amx_tile(kinds, kind, planes, panel, g, g1 - 1, x_tiles, i,
                          min(i * AMX_TOKENS, n_tokens - AMX_TOKENS), out)


# The GEMM tiles' driver: the AMX one only where the host has AMX (on others its IR could not be compiled)
_gemm_groups = _amx_groups if AMX else _int8_groups


# Inlined by numba (as _linear_pairs is): each linear_pairs_{kinds} holds the one copy of the tiles, optimized
# once. Compiled apart, _groups was optimized and emitted once per level of calls, and linear_pairs_{kinds} held
# two copies of its loops: a process that compiled it ran _groups' own, one that loaded it from the cache LLVM's
# inlined copy, scheduled otherwise (Qwen2.5-0.5B Q8_0 decode on AVX2, the Xeon: 24 against 35 ms a step).
@njit(cache=True, nogil=True, inline="always")
def _groups(kinds, kind, w, x, out, g0, g1, scratch, row_invariant=False, wide=WIDE_PREFILL):
    """Row groups g0 .. g1 - 1 against every token (see INT8_TOKENS), in the tiles of the kinds whose bits
    ``kinds`` sets (``_by_kind``):
    - GEMM tiles of GEMM_GROUPS groups x GEMM_TOKENS tokens (``_gemm_step``: the int8 kinds past
      ONE_TOKEN_PASSES tokens, the others past INT8_TOKENS), on the activations in scratch
      (``quantize_activations``), each pair of groups meeting every token tile while its weights are in
      cache;
    - one-token GEMM tiles up to ONE_TOKEN_PASSES tokens (``_gemv_step``), each group meeting every token
      while its weights are in L1;
    - Q8_0 (and Q6_K, Q5_K) register tiles of four tokens below PANEL_TOKENS, token tiles outer, so that the
      groups' weights stay in cache while the tiles pass;
    - or each pair of groups decoded once to a float32 panel (16 rows x n, in cache) that 4-token panel
      tiles multiply: Q8_0's (Q6_K's, Q5_K's) from PANEL_TOKENS to INT8_TOKENS tokens.
    Tiles past the last token are clamped to it. ``row_invariant``: every row as a one-token step computes
    it (GEMM tiles for the int8 kinds, one-token GEMM tiles for the others, at any step size), so a row's
    result does not depend on the step's other rows. ``wide``: the steps taking two planes (``_planes``)."""
    n_tokens, planes = x.shape[0], _planes(kind, x.shape[0], row_invariant, wide)
    if _gemm_step(kind, n_tokens, row_invariant):
        _gemm_groups(kinds, kind, planes, w, x, out, g0, g1, _scratch_rows(kind, scratch, x, row_invariant, wide),
                     scratch)
    elif _gemv_step(kind, n_tokens, row_invariant):
        rows = _scratch_rows(kind, scratch, x, row_invariant, wide)
        for g in range(g0, g1):
            for t in range(n_tokens):
                _gemv_tile(kinds, kind, planes, w, g, g1 - 1, rows, t, out)
    elif n_tokens < PANEL_TOKENS:
        for t in range(0, n_tokens, 4):
            for g in range(g0, g1):
                _FOUR_TOKENS(kinds, kind, w, g, g1 - 1, x, t, out)
    else:
        panel = np.empty((x.shape[1], PANEL_GROUPS * GROUP), np.float32)
        for g in range(g0, g1, PANEL_GROUPS):
            _UNPACK(kinds, kind, w, g, g1 - 1, panel)
            for t in range(0, n_tokens, 4):
                _panel_tile(panel, x, t, g, g1 - 1, out)


@njit(cache=True, nogil=True)
def activation_scratch(n_tokens: int, width: int) -> np.ndarray:
    """A thread's scratch (each thread quantizes what it multiplies) for ``quantize_activations`` of any
    step's products, x of up to n_tokens rows of up to ``width`` activations, in up to two planes."""
    size = n_tokens * int8.compact_width(width, 2)
    if AMX:   # or as AMX tiles read them, from a cache line (_amx_tiles)
        n_tiles = (n_tokens + AMX_TOKENS - 1) // AMX_TOKENS
        tiles = n_tiles * (width // BLOCK) * _amx_x_block(2) + amx.ROW_BYTES
        size = max(size, (tiles + 3) // 4)
    return np.empty(size, np.float32)


@njit(cache=True, nogil=True)
def _scratch_rows(kind, scratch, x, row_invariant, wide):
    """The rows of ``scratch`` that x's int8 activations take, where x meets this weight as int8."""
    n_tokens, width = x.shape
    per_row = int8.compact_width(width, _compact_planes(kind, n_tokens, row_invariant, wide))
    return scratch[:n_tokens * per_row].reshape(n_tokens, per_row)


@njit(cache=True, nogil=True)
def quantize_activations(kind: int, x: np.ndarray, scratch: np.ndarray, row_invariant: bool = False,
                         wide: int = WIDE_PREFILL) -> None:
    """What the GEMM tiles read: x as int8 in scratch (``activation_scratch``, ``int8.quantize_compact``, or
    in AMX steps ``_amx_quantize``) where it meets this weight in them. Other kinds and steps: nothing."""
    planes = _compact_planes(kind, x.shape[0], row_invariant, wide)
    if planes:
        if _amx_step(kind, x.shape[0], row_invariant):
            _amx_quantize(x, _amx_tiles(scratch, x, planes), planes)
        else:
            int8.quantize_compact(x, _scratch_rows(kind, scratch, x, row_invariant, wide), planes)


# Work items: a product splits into items of about ITEM_WORK block-rows x tokens, at most MAX_ITEMS of them
# (enough to balance two to eight threads), each a range of whole pairs of row groups, and a product of
# SPLIT_WORK or more into two at least (programs round that up to one per thread). 2048 (~5 us on Zen 3,
# whose two vCPUs share a core: claiming an item cost ~0.1 us, waking a thread ~1.2 us) made the Xeon's
# decode step, two cores whose counters and shared reference counts cross between them, 4-16 % slower than
# 8192 (Qwen2.5-0.5B Q4_0 22.4-23.8 -> 20.5-20.8 ms, Q8_0 31.8-32.9 -> 31.0-31.6, Llama-3.2-1B Q4_K_M
# 54.2 -> 51.9); 32768, with the small products still split at 8192, another 2-9 % faster (Qwen2.5-0.5B
# Q4_0 18.2-18.8 -> 16.8-17.2 ms, Llama-3.2-1B Q4_K_M 40.3-40.8 -> 37.0-39.3; 65536 measured alike). Steps
# of 16 tokens and more hit MAX_ITEMS on their large products either way.
ITEM_WORK = 32768
SPLIT_WORK = 8192
MAX_ITEMS = 64


@njit(cache=True, nogil=True)
def linear_items_most(n_rows: int) -> int:
    """The most work items a product with a weight of n_rows rows splits into: one per pair of row groups."""
    return max(1, (n_rows // GROUP + 1) // 2)


@njit(cache=True, nogil=True)
def linear_items(n_rows: int, x: np.ndarray) -> int:
    """How many work items ``linear`` splits x @ W.T into, for n_rows rows of W (or of several weights that
    x meets in one instruction, program.py)."""
    work = x.shape[0] * n_rows * (x.shape[1] // BLOCK)
    items = max(work // ITEM_WORK, 2 if work >= SPLIT_WORK else 1)
    return min(linear_items_most(n_rows), MAX_ITEMS, items)


@njit(cache=True, nogil=True, inline="always")
def _linear_pairs(kinds, kind, blocks, x, out, p0, p1, scratch, row_invariant, wide):
    """Pairs of row groups p0 .. p1 - 1 of out = x @ W.T (of ``linear_items_most`` pairs) and, in the range
    that ends with the last pair, the rows % 8 kept as GGUF stored them (dequantized and dotted one by one),
    in the tiles of the ``kinds`` mask. Returns the rows written. ``scratch``: what ``quantize_activations``
    wrote for x."""
    n_rows = blocks.shape[0]
    full_groups = n_rows // GROUP
    g0, g1 = min(full_groups, 2 * p0), min(full_groups, 2 * p1)
    _groups(kinds, kind, blocks, x, out, g0, g1, scratch, row_invariant, wide)
    if p1 < linear_items_most(n_rows) or n_rows % GROUP == 0:
        return g0 * GROUP, g1 * GROUP
    planes = _compact_planes(kind, x.shape[0], row_invariant, wide)
    if planes and _amx_step(kind, x.shape[0], row_invariant):  # as the tiles saw x
        x = _amx_dequantize(x, _amx_tiles(scratch, x, planes), planes)
    elif planes:
        x = int8.dequantize(x, _scratch_rows(kind, scratch, x, row_invariant, wide), planes)
    weights = np.empty(x.shape[1], np.float32)
    for row in range(full_groups * GROUP, n_rows):
        _dequantize_row(kind, blocks, row, weights)
        _dot_rows(x, weights, out[:, row])
    return g0 * GROUP, n_rows


@njit(cache=True, nogil=True)
def _without_quantized_weights(kind, blocks, x, out, p0, p1, scratch, row_invariant, wide):
    """linear_pairs of a model without quantized weights, which no program calls (7 s of a cold compile saved)."""
    return 0, 0


@functools.cache
def linear_pairs_for(kinds: int) -> Dispatcher:
    """``linear_pairs(kind, blocks, x, out, p0, p1, scratch, row_invariant, wide)``: pairs of row groups p0 ..
    p1 - 1 of out = x @ W.T (``_linear_pairs``) for weights of the kinds whose bits ``kinds`` sets, compiled
    with those kinds' tiles alone (``_by_kind``): programs call a model's through a pointer. Each mask's is a
    function of its own name, which numba's disk cache keeps apart."""
    if not kinds:
        return _without_quantized_weights

    def linear_pairs(kind, blocks, x, out, p0, p1, scratch, row_invariant, wide):
        return _linear_pairs(kinds, kind, blocks, x, out, p0, p1, scratch, row_invariant, wide)

    linear_pairs.__name__ = linear_pairs.__qualname__ = f"linear_pairs_{kinds}"
    return njit(cache=True, nogil=True)(linear_pairs)


@njit(cache=True, nogil=True)
def linear_item(kind: int, blocks: np.ndarray, x: np.ndarray, out: np.ndarray, item: int, n_items: int,
                scratch: np.ndarray, row_invariant: bool = False, wide: int = WIDE_PREFILL) -> tuple[int, int]:
    """Work item ``item`` of ``n_items`` of out = x @ W.T (``_linear_pairs`` of its share of the pairs), in
    every kind's tiles."""
    pairs = linear_items_most(blocks.shape[0])
    return _linear_pairs(ALL_KINDS, kind, blocks, x, out, pairs * item // n_items, pairs * (item + 1) // n_items,
                         scratch, row_invariant, wide)


@njit(cache=True, nogil=True, parallel=True)
def linear(kind: int, blocks: np.ndarray, x: np.ndarray, out: np.ndarray, row_invariant: bool = False,
           wide: int = WIDE_PREFILL) -> None:
    """out[T, rows] = x[T, n] @ W.T for W laid out by ``prepare`` (kind, blocks); x and out float32,
    C-contiguous, out not aliasing x. Its work items run in parallel (programs run them on their own
    threads instead, program.py). ``row_invariant``: each row of out as a one-row product gives it
    (``_groups``); ``wide``: the steps whose activations take two planes (``_planes``)."""
    if (blocks.shape[1] != row_bytes(kind, x.shape[1]) or x.shape[1] % BLOCK
            or out.shape != (x.shape[0], blocks.shape[0])):
        raise ValueError("linear: weight, activation and output shapes disagree")
    n_items = linear_items(blocks.shape[0], x)
    scratch = activation_scratch(x.shape[0], x.shape[1])
    quantize_activations(kind, x, scratch, row_invariant, wide)
    if n_items == 1:  # the calling thread alone beats waking the others
        linear_item(kind, blocks, x, out, 0, 1, scratch, row_invariant, wide)
    else:
        for item in prange(n_items):
            linear_item(kind, blocks, x, out, item, n_items, scratch, row_invariant, wide)


@njit(cache=True, nogil=True)
def _dot_rows(x, weights, out):
    """out[t] = x[t] . weights, in LANES partial sums of every LANES-th value, then added in a fixed order: LLVM
    vectorizes the lanes without reassociating, so a row's bits do not depend on the code this is compiled or
    inlined into (with reassociation LLVM chose the order by the context, and one-row and many-row calls
    differed in the last bit)."""
    n = weights.shape[0]
    whole = n // LANES * LANES
    lanes = np.empty(LANES, np.float32)
    for t in range(x.shape[0]):
        lanes[:] = 0
        for i in range(0, whole, LANES):
            for lane in range(LANES):
                lanes[lane] += x[t, i + lane] * weights[i + lane]
        total = np.float32(0.0)
        for lane in range(LANES):
            total += lanes[lane]
        for i in range(whole, n):
            total += x[t, i] * weights[i]
        out[t] = total


@njit(cache=True, nogil=True)
def _ieee(bits, mantissa_bits, exponent_bits):
    """float32 of the IEEE 754 number with these bits (f16: 10 and 5, float32: 23 and 8), exactly."""
    top, bias = (1 << exponent_bits) - 1, (1 << (exponent_bits - 1)) - 1
    exponent, mantissa = (bits >> mantissa_bits) & top, bits & ((1 << mantissa_bits) - 1)
    if exponent == top:
        value = np.float32(np.inf) if mantissa == 0 else np.float32(np.nan)
    elif exponent == 0:
        value = np.float32(math.ldexp(np.float64(mantissa), 1 - bias - mantissa_bits))
    else:
        value = np.float32(math.ldexp(np.float64(mantissa + (1 << mantissa_bits)), exponent - bias - mantissa_bits))
    return -value if bits >> (mantissa_bits + exponent_bits) & 1 else value


@njit(cache=True, nogil=True)
def _bits(flat, at, size):
    """The ``size`` bytes at byte ``at`` as a little-endian integer."""
    bits = np.int64(0)
    for i in range(size):
        bits |= np.int64(flat[at + i]) << (8 * i)
    return bits


@njit(cache=True, nogil=True)
def _field(flat, at, size):
    """A header field (d or m) of ``size`` bytes at byte ``at``, little-endian: float32 or f16."""
    bits = _bits(flat, at, size)
    return _ieee(bits, 23, 8) if size == 4 else _ieee(bits, 10, 5)


@njit(cache=True, nogil=True)
def _header_value(flat, at, fields_at, size, lane, kind, index):
    """Header value ``index`` of row ``lane`` of a group block of ``size`` rows at byte ``at``, its f16 fields at
    ``fields_at`` (a kernel's ``_scales``): an f16 field, or for the converted kinds an f16 field times an int8
    multiplier."""
    multiplier = np.int8(1)
    if MULTIPLIERS[kind]:
        in_header = 0 if SHARED[kind] else FIELDS[kind]
        multiplier = np.int8(flat[at + size * (FIELD * in_header + index) + lane])
        index = min(index, FIELDS[kind] - 1)
    return _field(flat, fields_at + FIELD * (size * index + lane), FIELD) * np.float32(multiplier)   # one _field


@njit(cache=True, nogil=True)
def _quant_at(j, size):
    """Where quant byte j of a row is in a group block of ``size`` rows, from the row's first (four bytes of
    a row together)."""
    return j // 4 * 4 * size + j % 4


@njit(cache=True, nogil=True)
def _packed_value(flat, quants, size, i, high_bits):
    """Element i of a block of Q6_K's, Q5_K's or Q5_1's (``_packed_values``) whose row's quant bytes start
    at ``quants``."""
    half, j = i // (BLOCK // 2), i % (BLOCK // 2)
    at = _high_bit_at(high_bits, half, j)
    nibble = np.int64(flat[quants + _quant_at(j, size)]) >> (4 * half) & 15
    high = np.int64(flat[quants + _quant_at(BLOCK // 2 + 4 * (at // 8) + j % 4, size)]) >> (at % 8)
    return nibble | (high & ((1 << high_bits) - 1)) << 4


@njit(cache=True, nogil=True)
def _dequantize_row(kind, blocks, row, y):
    """y[:] = row ``row`` of the weight laid out by ``prepare``, dequantized as gguf does."""
    header_bytes = LAYOUT[kind][1]
    n_rows, n_bytes = blocks.shape
    flat = blocks.reshape(-1)
    first = row // GROUP * GROUP
    size = GROUP if first + GROUP <= n_rows else 1  # rows in this group: the last rows % 8 stand alone
    if size == 1:
        first = row
    lane = row - first
    for b in range(y.shape[0] // BLOCK):
        at, fields_at = _block_at(kind, b, size)
        at, fields_at = at + first * n_bytes, fields_at + first * n_bytes
        d = _header_value(flat, at, fields_at, size, lane, kind, 0)
        quants = at + header_bytes * size + 4 * lane   # byte j of the row at quants + _quant_at(j, size)
        if kind == Q8_0:
            for i in range(BLOCK):
                y[b * BLOCK + i] = d * np.float32(np.int8(flat[quants + _quant_at(i, size)]))
            continue
        m = _header_value(flat, at, fields_at, size, lane, kind, 1)  # Q4_0: a quant byte, unused; Q6_K: d2; Q5_0: qh
        if kind == Q6_K:
            for i in range(BLOCK):
                q = _packed_value(flat, quants, size, i, HIGH_BITS[Q6_K]) - 32
                y[b * BLOCK + i] = (d if i < BLOCK // 2 else m) * np.float32(q)
            continue
        if kind == Q5_K or kind == Q5_1:
            for i in range(BLOCK):
                y[b * BLOCK + i] = d * np.float32(_packed_value(flat, quants, size, i, HIGH_BITS[kind])) + m
            continue
        fifth = 0   # Q5_0's fifth bits, bit i element i's
        if kind == Q5_0 and size == 1:
            fifth = _bits(flat, at + FIELD, 4)
        elif kind == Q5_0:   # as _q5_0_fifth_bits arranged them
            for i in range(BLOCK):
                j = i % (BLOCK // 2)
                fifth |= (np.int64(flat[at + GROUP * FIELD + 4 * lane + j % 4]) >> (2 * (j // 4) + i // 16)
                          & 1) << i
        for j in range(BLOCK // 2):
            byte = np.int64(flat[quants + _quant_at(j, size)])
            if kind == Q5_0:
                y[b * BLOCK + j] = d * np.float32((byte & 15 | (fifth >> j & 1) << 4) - 16)
                y[b * BLOCK + j + 16] = d * np.float32((byte >> 4 | (fifth >> (j + 16) & 1) << 4) - 16)
            elif kind == Q4_1 or kind == Q4_K:
                y[b * BLOCK + j] = d * np.float32(byte & 15) + m
                y[b * BLOCK + j + 16] = d * np.float32(byte >> 4) + m
            else:
                y[b * BLOCK + j] = d * np.float32((byte & 15) - 8)
                y[b * BLOCK + j + 16] = d * np.float32((byte >> 4) - 8)


@njit(cache=True, nogil=True)
def embed_rows(kind: int, blocks: np.ndarray, tokens: np.ndarray, scale: float, out: np.ndarray) -> None:
    """out[t] = row tokens[t] of the table laid out by ``prepare``, dequantized as gguf does, * scale."""
    scale = np.float32(scale)
    for t in range(tokens.shape[0]):
        _dequantize_row(kind, blocks, np.int64(tokens[t]), out[t])   # int64, as _linear_pairs': compiled once
        for i in range(out.shape[1]):
            out[t, i] *= scale


def _interleave(data: np.ndarray, kind: int) -> np.ndarray:
    """GGUF blocks of a multiple of GROUP rows in the group layout (see the module doc): each unit of a row
    (a block, or for the SHARED kinds a run of SUPER blocks after their fields) the group's eight rows' together,
    each piece of it (f16 fields, int8 multipliers, quants) as [element][row][byte], an element of the quants
    being four bytes."""
    block_bytes, header_bytes = LAYOUT[kind]
    fields_end = header_bytes - MULTIPLIERS[kind]
    pieces = [(0, fields_end, FIELD), (fields_end, header_bytes, 1), (header_bytes, block_bytes, 4)]
    unit = block_bytes
    if SHARED[kind]:
        shared = FIELD * SHARED[kind]
        pieces = [(0, shared, FIELD), *((shared + j * block_bytes + start, shared + j * block_bytes + end, size)
                                        for j in range(SUPER) for start, end, size in pieces)]
        unit = RUN_BYTES[kind]
    n_groups, n_units = data.shape[0] // GROUP, data.shape[1] // unit
    units = data.reshape(n_groups, GROUP, n_units, unit)
    parts = []   # each [group, unit, element, row, byte]
    for start, end, size in pieces:
        if end > start:
            part = units[..., start:end].reshape(n_groups, GROUP, n_units, (end - start) // size, size)
            parts.append(part.transpose(0, 2, 3, 1, 4).reshape(n_groups, n_units, -1))
    grouped = np.concatenate(parts, axis=2)
    if kind == Q5_0:
        grouped[..., GROUP * FIELD:GROUP * header_bytes] = _q5_0_fifth_bits(units)
    return grouped.reshape(data.shape)


def _q5_0_fifth_bits(blocks: np.ndarray) -> np.ndarray:
    """The fifth bits of GGUF Q5_0 blocks [groups, GROUP rows, blocks, 22] as a group block holds them,
    [groups, blocks, 32] bytes: byte 4 r + e holds at bit 2 p + h row r's fifth bit of element 16 h + 4 p + e
    (the low, h = 0, or high nibble of its byte 4 p + e, which quant load p holds in byte 4 r + e), so that a
    tile moves each load's bits into place with a shift and a mask."""
    qh = blocks[..., 2:6].copy().view("<u4")[..., 0]                              # [group, row, block]
    bits = ((qh[..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
    bits = bits.reshape(*qh.shape, 2, 4, 4)                                     # [.., h, p, e]
    at = (np.uint8(1) << (2 * np.arange(4, dtype=np.uint8) + np.arange(2, dtype=np.uint8)[:, None]))  # [h, p]
    packed = (bits * at[..., None]).sum(axis=(3, 4), dtype=np.uint8)           # [group, row, block, e]
    return packed.transpose(0, 2, 1, 3).reshape(qh.shape[0], qh.shape[2], 4 * GROUP)


def _super_blocks(data: np.ndarray, qtype: str, size: int) -> np.ndarray:
    """A weight's GGUF blocks of ``size`` bytes, one a row: [rows * n / block values, size]."""
    if data.ndim != 2 or data.shape[1] % size:
        raise ValueError(f"{qtype} blocks must be [rows, n / block values * {size}] bytes, not {data.shape}")
    return data.reshape(-1, size)


def _k_scales(super_blocks: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Q4_K's and Q5_K's header values (``_k_blocks``): f16 fields d and -dmin ([n] each, a super-block's) and
    multipliers sc and m ([n, 8] each, a block's), for d sc and -dmin m."""
    d, dmin = (super_blocks[:, at:at + 2].copy().view(np.float16)[:, 0] for at in (0, 2))
    sc, m = gguf_quants.Q4_K.get_scale_min(super_blocks[:, 4:16])
    return [d, -dmin], [sc, m]


def _packed_values(values: np.ndarray, high_bits: int) -> np.ndarray:
    """Blocks' values [n, 32] of 4 + ``high_bits`` bits as the tiles read them, [n, 16 + 4 high_bits] bytes:
    16 bytes of nibbles as Q4's (byte j: elements j and j + 16), then their high bits: element 4 p + e +
    16 h's at bit a % 8 of byte 4 (a // 8) + e, a = high_bits (2 p + h), so that a tile's quant load p
    (bytes 4 p .. 4 p + 3 of each row) and one load of high bytes give both nibbles' elements (``_bytes``)."""
    nibbles = (values[:, :16] & 15) | (values[:, 16:] << np.uint8(4))
    high = np.zeros((len(values), 4 * high_bits), np.uint8)
    for i in range(BLOCK):
        half, j = divmod(i, BLOCK // 2)
        at = _high_bit_at.py_func(high_bits, half, j)
        high[:, 4 * (at // 8) + j % 4] |= (values[:, i] >> np.uint8(4)) << np.uint8(at % 8)
    return np.concatenate([nibbles, high], axis=1)


def _k_blocks(rows: int, fields: list[np.ndarray], multipliers: list[np.ndarray], values: np.ndarray,
              shared: bool) -> np.ndarray:
    """Blocks of a converted kind (LAYOUT) as [rows, bytes]: each block its int8 multipliers, then its value
    bytes (``values``: [blocks, bytes]; ``multipliers``: one of each a block), and the f16 ``fields`` one of
    each per block, in its header first, or, ``shared``, one of each per SUPER blocks, before those blocks."""
    values = values.reshape(-1, values.shape[-1])
    as_f16 = [field.astype("<f2").reshape(-1, 1).view(np.uint8) for field in fields]
    ints = [multiplier.astype(np.int8).reshape(-1, 1).view(np.uint8) for multiplier in multipliers]
    if not shared:
        return np.concatenate([*as_f16, *ints, values], axis=1).reshape(rows, -1)
    blocks = np.concatenate([*ints, values], axis=1).reshape(-1, SUPER * (len(ints) + values.shape[1]))
    return np.concatenate([*as_f16, blocks], axis=1).reshape(rows, -1)


def _from_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks [rows, n / 256 * 144] as runs of eight Q4_1-style blocks whose d and m are d sc and
    -dmin m (``_k_blocks``; the f16 d and -dmin once a run): [rows, n / 256 * 148]. A Q4_K value is
    d sc q - dmin m for 6-bit sc and m per 32 values, so this is the same weight, not a requantization:
    0.578 bytes a value instead of 0.5625 (its 6-bit sc and m take a byte each), and the Q4_1 tiles read it."""
    super_blocks = _super_blocks(data, "Q4_K", 144)
    n = super_blocks.shape[0]
    # 32 bytes of quants per pair of sub-blocks: low nibbles the first, high nibbles the second
    values = ((super_blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1))
              & np.uint8(15)).reshape(n, 8, 32)
    return _k_blocks(data.shape[0], *_k_scales(super_blocks),
                     values[..., :16] | (values[..., 16:] << np.uint8(4)), True)   # Q4_1's byte j: elements j, j + 16


def _from_q5_k(data: np.ndarray) -> np.ndarray:
    """Q5_K super-blocks [rows, n / 256 * 176] as runs of eight blocks [rows, n / 256 * 180] with a d and an m
    (``_k_scales``: the f16 d and -dmin once a run, each block's sc and m) and the 5-bit values packed
    (``_packed_values``): a Q5_K value is d sc q - dmin m, with sc and m as in Q4_K. The same weight at 0.703
    bytes a value (GGUF's 0.6875), read by the byte kinds' tiles (``_bytes``)."""
    super_blocks = _super_blocks(data, "Q5_K", 176)
    n = super_blocks.shape[0]
    # low 4 bits: 32 bytes per pair of sub-blocks, low nibbles first; the 5th bit of sub-block j: bit j
    nibbles = (super_blocks[:, 48:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    fifth = (super_blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    values = (nibbles.reshape(n, 8, 32) | (fifth << np.uint8(4))).reshape(-1, BLOCK)
    return _k_blocks(data.shape[0], *_k_scales(super_blocks), _packed_values(values, HIGH_BITS[Q5_K]), True)


def _from_q6_k(data: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [rows, n / 256 * 210] as runs of eight blocks [rows, n / 256 * 210]: a d for each
    16 values (the f16 d, once a run, and the block's int8 sc0 and sc1 of ``_k_blocks``, d sc exact in
    float32) and the 32 6-bit values q packed (``_packed_values``), where a Q6_K value is d sc (q - 32). The
    same weight at GGUF's 0.82 bytes a value, read by the byte kinds' tiles as the int8 q - 32 (``_bytes``)."""
    super_blocks = _super_blocks(data, "Q6_K", 210)
    n = super_blocks.shape[0]
    d = super_blocks[:, 208:210].copy().view(np.float16)[:, 0]
    sc = super_blocks[:, 192:208].copy().view(np.int8)     # [n, 16]
    # low 4 bits: 64 bytes per 128 values, low nibbles first; high 2 bits: 32 bytes per 128, 2 bits apart
    low = (super_blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (super_blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    values = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).reshape(-1, BLOCK)
    return _k_blocks(data.shape[0], [d], [sc[:, 0::2], sc[:, 1::2]], _packed_values(values, HIGH_BITS[Q6_K]), True)


def _five_bits(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Q5_1's 32 values a block (0..31), from their 4 bytes of fifth bits (bit i: element i's)
    and 16 bytes of nibbles (byte j: elements j and j + 16)."""
    n = high.shape[0]
    fifth = (high.copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    nibbles = (low.reshape(n, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 15
    return nibbles.reshape(n, 32) | (fifth.astype(np.uint8) << np.uint8(4))


def _from_q5_1(data: np.ndarray) -> np.ndarray:
    """Q5_1 blocks [rows, n / 32 * 24] as blocks [rows, n / 32 * 26]: the f16 fields d and m, multipliers 1,
    the values q packed as Q5_K's; a Q5_1 value is d q + m, as Q5_K's are, and the same tiles read it."""
    blocks = _super_blocks(data, "Q5_1", 24)
    d, m = (blocks[:, at:at + 2].copy().view(np.float16) for at in (0, 2))
    one = np.ones(len(blocks), np.int8)
    return _k_blocks(data.shape[0], [d, m], [one, one],
                     _packed_values(_five_bits(blocks[:, 4:8], blocks[:, 8:]), HIGH_BITS[Q5_1]), False)


_CONVERSIONS = {"Q4_K": _from_q4_k, "Q6_K": _from_q6_k, "Q5_K": _from_q5_k, "Q5_1": _from_q5_1}
PREPARE_ROWS = 4096   # rows converted and laid out at a time: a large embedding's temporaries stay small


def prepare(qtype: str, data: np.ndarray,
            empty: Callable[[tuple[int, int]], np.ndarray] = lambda shape: np.empty(shape, np.uint8)
            ) -> tuple[int, np.ndarray]:
    """(kind, blocks) that ``linear`` and ``embed_rows`` read, from a GGUF weight's blocks of a type in
    KINDS: a new uint8 array from ``empty`` of the same shape and size (for the types in ``_CONVERSIONS``,
    of the converted blocks'; see the module doc)."""
    kind = KINDS[qtype]
    data = np.asarray(data, np.uint8)
    convert = _CONVERSIONS.get(qtype)
    if convert is None and (data.ndim != 2 or data.shape[1] % LAYOUT[kind][0]):
        raise ValueError(f"{qtype} blocks must be [rows, n / 32 * {LAYOUT[kind][0]}] bytes, not {data.shape}")
    blocks = None
    for start in range(0, data.shape[0], PREPARE_ROWS):
        part = data[start:start + PREPARE_ROWS]
        part = convert(part) if convert else part
        if blocks is None:
            blocks = empty((data.shape[0], part.shape[1]))
        grouped = part.shape[0] // GROUP * GROUP
        if grouped:
            blocks[start:start + grouped] = _interleave(part[:grouped], kind)
        blocks[start + grouped:start + len(part)] = part[grouped:]  # the last rows % 8 stay as they are
        release_file_pages(data[start:start + PREPARE_ROWS])
    return kind, blocks
