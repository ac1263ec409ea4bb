"""The jit device's quantized kernels (lse_backends/jit/quant.py) against gguf's own dequantization: linear
for every weight type, token count and row count that reaches a different tile or tail, on the serial
and the parallel path; embed_rows; the load-time layout; the instruction set's choice, and every one the
host has (AVX2 and the portable IR too on a VNNI host) in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from llvmlite import ir
from numba import types

import lse_backends.jit.quant as quant
from lse_backends.jit import amx, vector

QTYPES = ("Q4_0", "Q4_1", "Q8_0")
# K super-blocks hold 256 values: one, two and three of them a row, in the same row counts
K_SHAPES = ((8, 256), (24, 512), (37, 768), (5, 256), (200, 256), (2400, 256))
K_BLOCKS = {"Q4_K": (144, 0), "Q6_K": (210, 208), "Q5_K": (176, 0)}   # super-block bytes, where its f16 d
                                                                    # (and dmin, but Q6_K's) is
TOKENS = (1, 2, 3, 5, 16, 37)  # one-token passes, 4-token tiles, panels, GEMM tiles, and the remainders each
                               # leaves
# rows: one group (the two-group tile clamped), an odd number of groups, groups plus 5 rows kept as
# stored, only such rows; 200 rows split into several work items from 16 tokens, 2400 rows from 1. n: one
# block, odd and even numbers of blocks.
SHAPES = ((8, 32), (24, 96), (37, 320), (5, 64), (200, 320), (2400, 256))
RNG = np.random.default_rng(0)


def gguf_weight(qtype: str, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(GGUF blocks, their float32 dequantization by gguf) of a random matrix. gguf cannot quantize to
    K types, so their blocks are random: f16 d (and dmin) of the size real ones have, any other bytes."""
    if qtype in K_BLOCKS:
        size, at = K_BLOCKS[qtype]
        n_d = 1 if qtype == "Q6_K" else 2
        super_blocks = RNG.integers(0, 256, (rows, n // 256, size), dtype=np.uint8)
        super_blocks[..., at:at + 2 * n_d] = RNG.uniform(1e-3, 1e-2, (rows, n // 256, n_d)).astype(np.float16).view(
            np.uint8)
        blocks = super_blocks.reshape(rows, -1)
    else:
        blocks = quants.quantize(RNG.standard_normal((rows, n)).astype(np.float32), GGMLQuantizationType[qtype])
    return blocks, quants.dequantize(blocks, GGMLQuantizationType[qtype]).astype(np.float32)


def prepared(qtype: str, blocks: np.ndarray) -> tuple[int, np.ndarray]:
    """quant.prepare's (kind, blocks), read-only as the jit programs hold weights."""
    kind, laid_out = quant.prepare(qtype, blocks)
    laid_out.flags.writeable = False
    return kind, laid_out


def int8_activations(x: np.ndarray) -> np.ndarray:
    """x as llama.cpp's Q8_1 would carry it: per block of 32, round(x * 127 / max|x|) (half to even) times
    max|x| / 127, in float32 (numpy's own, not the kernels' code)."""
    blocks = x.reshape(len(x), -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    inverse = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    return (np.round(blocks * inverse) * (top / np.float32(127))).reshape(x.shape)


def two_plane_activations(x: np.ndarray) -> np.ndarray:
    """x as two int8 planes carry it (int8's module doc): per block of 32, t = x * 127 / max|x|, hi =
    round(t), lo = round(128 (t - hi)), times max|x| / (127 * 128) (numpy's own, not the kernels' code)."""
    blocks = x.reshape(len(x), -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)
    t = blocks * np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    hi = np.round(t)
    combined = np.float32(128) * hi + np.round((t - hi) * np.float32(128))
    return (combined * (top / np.float32(127 * 128))).reshape(x.shape)


def seen_by_kernels(qtype: str, x: np.ndarray, wide: int = quant.WIDE_PREFILL) -> np.ndarray:
    """The activations a product is exact for: for Q4 weights (Q4_K too) two int8 planes in the steps that
    ``wide`` names (WIDE_PREFILL: past INT8_TOKENS tokens; WIDE_DECODE: up to it), int8 ones in the others;
    for the byte kinds (Q8_0, Q6_K, Q5_K, Q5_1) two planes in steps of up to ONE_TOKEN_PASSES tokens, int8 ones in
    longer steps and float32 ones between; int8 ones for Q5_0."""
    kind, long_step = quant.KINDS[qtype], len(x) > quant.INT8_TOKENS
    if kind == quant.Q5_0:
        return int8_activations(x)
    if kind in (quant.Q8_0, quant.Q6_K, quant.Q5_K, quant.Q5_1):
        if len(x) <= quant.ONE_TOKEN_PASSES:
            return two_plane_activations(x)
        return int8_activations(x) if long_step else x
    two_planes = wide & (quant.WIDE_PREFILL if long_step else quant.WIDE_DECODE)
    return two_plane_activations(x) if two_planes else int8_activations(x)


def assert_close_to_reference(out: np.ndarray, x: np.ndarray, dense: np.ndarray) -> None:
    """Within float32 summation-order rounding of x @ dense.T (computed in float64)."""
    reference = x.astype(np.float64) @ dense.astype(np.float64).T
    assert np.abs(out - reference).max() <= 1e-5 * np.abs(reference).max()


def items(rows: int, n: int, tokens: int) -> int:
    return quant.linear_items(rows, np.empty((tokens, n), np.float32))


def test_the_shapes_reach_one_and_several_work_items():
    """SHAPES x TOKENS run as one item (on the calling thread) and as several (in parallel), for one token
    and for several; items hold whole pairs of row groups, so a shape never has more items than pairs."""
    counts = {(rows, n, tokens): items(rows, n, tokens) for rows, n in SHAPES for tokens in TOKENS}
    assert min(counts.values()) == 1 and max(counts.values()) > 2
    assert any(items(rows, n, 1) == 1 < items(rows, n, 37) for rows, n in SHAPES)
    assert any(items(rows, n, 1) > 1 for rows, n in SHAPES)  # decode in parallel too
    assert all(count <= max(1, (rows // quant.GROUP + 1) // 2) for (rows, _, _), count in counts.items())


def test_the_token_counts_reach_every_path():
    """Each path of quant._groups gets token counts: one-token passes (one-token GEMM tiles for Q4 and
    Q5_0); Q8_0's 4-token float32 tiles with and without a clamped remainder, and its panels from
    PANEL_TOKENS; the GEMM tiles (for Q4 and Q5_0 from ONE_TOKEN_PASSES, with one plane; two for Q4 past
    INT8_TOKENS) with a clamped remainder."""
    assert min(TOKENS) <= quant.ONE_TOKEN_PASSES
    assert any(quant.ONE_TOKEN_PASSES < t < quant.PANEL_TOKENS and t % 4 for t in TOKENS)
    assert any(quant.PANEL_TOKENS <= t <= quant.INT8_TOKENS and t % 4 == 0 for t in TOKENS)
    assert any(t > quant.INT8_TOKENS and t % quant.GEMM_TOKENS for t in TOKENS)
    assert any(quant.ONE_TOKEN_PASSES < t <= quant.INT8_TOKENS and t % quant.GEMM_TOKENS for t in TOKENS)


@pytest.mark.parametrize("qtype, rows, n", [(q, r, n) for q in QTYPES for r, n in SHAPES]
                         + [(q, r, n) for q in K_BLOCKS for r, n in K_SHAPES]
                         + [(q, r, n) for q in ("Q5_0", "Q5_1") for r, n in SHAPES])
def test_linear_is_x_times_the_dequantized_weight(qtype, rows, n):
    blocks, dense = gguf_weight(qtype, rows, n)
    kind, laid_out = prepared(qtype, blocks)
    for tokens in TOKENS:
        x = RNG.standard_normal((tokens, n)).astype(np.float32)
        out = np.full((tokens, rows), np.nan, np.float32)  # an entry the kernels miss stays NaN
        quant.linear(kind, laid_out, x, out)
        assert_close_to_reference(out, seen_by_kernels(qtype, x), dense)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("wide", [0, quant.WIDE_PREFILL, quant.WIDE_DECODE, quant.WIDE_PREFILL | quant.WIDE_DECODE])
def test_q4_activations_take_two_planes_in_the_steps_a_products_wide_names(qtype, wide):
    """Each path (one-token tiles, GEMM tiles in decode and prefill) with one plane or two as ``wide`` says:
    the product is exact for those activations only (one plane's rounding is ~1e-2 of a product, far over
    the check's 1e-5)."""
    rows, n = (37, 768) if qtype == "Q4_K" else (37, 320)
    blocks, dense = gguf_weight(qtype, rows, n)
    kind, laid_out = prepared(qtype, blocks)
    for tokens in TOKENS:
        x = RNG.standard_normal((tokens, n)).astype(np.float32)
        out = np.full((tokens, rows), np.nan, np.float32)
        quant.linear(kind, laid_out, x, out, False, wide)
        assert_close_to_reference(out, seen_by_kernels(qtype, x, wide), dense)


# A Q4_K_M model's kinds and two more (nibbles, packed bytes, bytes, fifth bits, and AMX's shared Q4_1 tiles);
# one kind alone, whose AMX tiles take one plane in prefill (its stack holds no other tile's buffers)
@pytest.mark.parametrize("plan_kinds", [("Q4_K", "Q6_K", "Q8_0", "Q5_0"), ("Q5_0",)])
def test_a_plans_linear_pairs_holds_its_kinds_tiles_alone_with_every_kinds_bits(plan_kinds):
    """quant.linear_pairs_for(mask), what a model's programs call: on every path (the token counts) and with
    rows kept as stored, each kind of the mask gives linear's bits (every kind's tiles); a kind outside it
    gets nothing from the row groups' tiles, which are not compiled in."""
    mask = quant.kinds_mask(plan_kinds)
    linear_pairs = quant.linear_pairs_for(mask)
    assert quant.linear_pairs_for(mask) is linear_pairs and mask == sum(1 << quant.KINDS[q] for q in plan_kinds)
    rows, n = 37, 512
    for qtype in (*plan_kinds, "Q4_0"):
        blocks, _ = gguf_weight(qtype, rows, n)
        kind, laid_out = prepared(qtype, blocks)
        for tokens in TOKENS:
            x = RNG.standard_normal((tokens, n)).astype(np.float32)
            expected, out = (np.full((tokens, rows), np.nan, np.float32) for _ in range(2))
            quant.linear(kind, laid_out, x, expected)
            scratch = quant.activation_scratch(tokens, n)
            quant.quantize_activations(kind, x, scratch)
            written = linear_pairs(kind, laid_out, x, out, 0, quant.linear_items_most(rows), scratch, False,
                                   quant.WIDE_PREFILL)
            assert written == (0, rows)
            if qtype in plan_kinds:
                np.testing.assert_array_equal(out, expected)
            else:
                assert np.isnan(out[:, :rows // quant.GROUP * quant.GROUP]).all()


def test_a_model_without_quantized_weights_compiles_no_tiles():
    """Its programs never call linear_pairs: the function they hold compiles none of _linear_pairs' code."""
    from lse_backends.jit import program

    quant.linear_pairs_for(0).compile(program._LINEAR_PAIRS.signature)
    assert not [s for s in quant._linear_pairs.signatures if s[0] == types.literal(0)]


def test_linear_reads_activation_rows_through_their_stride():
    """x and out may be the leading rows of larger buffers (how the jit programs pass them)."""
    blocks, dense = gguf_weight("Q4_1", 24, 96)
    x = RNG.standard_normal((10, 96)).astype(np.float32)
    out = np.full((10, 24), np.nan, np.float32)
    quant.linear(*prepared("Q4_1", blocks), x[:3], out[:3])
    assert_close_to_reference(out[:3], seen_by_kernels("Q4_1", x[:3]), dense)
    assert np.isnan(out[3:]).all()


@pytest.mark.parametrize("qtype, tokens", [("Q4_0", 2), ("Q4_1", 2), ("Q5_0", 2),
                                           *((q, 20) for q in ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_0", "Q4_K"))])
def test_int8_activations_keep_zero_blocks_exact_and_non_finite_ones_nan(qtype, tokens):
    """One-token Q4 passes and the GEMM tiles (of one plane or two) quantize each block of 32 activations on
    its own: an all-zero block adds nothing, a block of one large value keeps the others' scale; a NaN or
    an infinity makes its token's products NaN (not a wrong number), and the other tokens' stay right."""
    blocks, dense = gguf_weight(qtype, 24, 256 if qtype in K_BLOCKS else 128)
    kind, laid_out = prepared(qtype, blocks)
    x = RNG.standard_normal((tokens, dense.shape[1])).astype(np.float32)
    x[:, 32:64] = 0
    x[:, 64] = 1e4
    out = np.full((tokens, 24), np.nan, np.float32)
    quant.linear(kind, laid_out, x, out)
    assert_close_to_reference(out, seen_by_kernels(qtype, x), dense)
    for bad in (np.nan, np.inf, -np.inf):
        x[0, 100] = bad
        quant.linear(kind, laid_out, x, out)
        assert np.isnan(out[0]).all()
        assert_close_to_reference(out[1:], seen_by_kernels(qtype, x[1:]), dense)


def test_gemm_tiles_multiply_any_int8_weight_byte():
    """The GEMM tiles multiply a signed weight as |q| times the activation with q's sign: every byte of a Q8_0
    block is a weight, -128 too (gguf never writes it; a file may), exactly."""
    blocks = RNG.integers(0, 256, (40, 8, 34), dtype=np.uint8)
    blocks[:, :, :2] = RNG.uniform(1e-3, 1e-2, (40, 8, 1)).astype(np.float16).view(np.uint8)
    blocks[:, :, 2:4] = 0x80
    blocks = blocks.reshape(40, -1)
    dense = quants.dequantize(blocks, GGMLQuantizationType.Q8_0).astype(np.float32)
    x = RNG.standard_normal((quant.INT8_TOKENS + 3, 256)).astype(np.float32)
    out = np.full((len(x), 40), np.nan, np.float32)
    quant.linear(*prepared("Q8_0", blocks), x, out)
    assert_close_to_reference(out, int8_activations(x), dense)


def test_linear_rejects_mismatched_shapes():
    kind, laid_out = prepared("Q8_0", gguf_weight("Q8_0", 8, 64)[0])
    with pytest.raises(ValueError):
        quant.linear(kind, laid_out, np.zeros((1, 96), np.float32), np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError):
        quant.linear(kind, laid_out, np.zeros((1, 64), np.float32), np.zeros((1, 9), np.float32))


@pytest.mark.parametrize("qtype", [*QTYPES, *K_BLOCKS, "Q5_0", "Q5_1"])
def test_embed_rows_is_gguf_dequantization_times_the_scale(qtype):
    """Bit for bit: the same float32 operations as gguf's dequantization, then the scale."""
    blocks, dense = gguf_weight(qtype, 37, 256)
    kind, laid_out = prepared(qtype, blocks)
    tokens = np.array([0, 7, 8, 31, 32, 36, 9, 9], np.int64)  # group edges, the rows kept as stored, repeats
    out = np.empty((len(tokens), 256), np.float32)
    quant.embed_rows(kind, laid_out, tokens, 1.7, out)
    np.testing.assert_array_equal(out, dense[tokens] * np.float32(1.7))


@pytest.mark.parametrize("qtype", QTYPES)
def test_prepare_keeps_the_shape_and_the_bytes(qtype):
    blocks = gguf_weight(qtype, 37, 96)[0]
    kind, laid_out = quant.prepare(qtype, blocks)
    assert kind == quant.KINDS[qtype] and laid_out.shape == blocks.shape and laid_out.dtype == np.uint8
    assert not np.shares_memory(laid_out, blocks)
    np.testing.assert_array_equal(np.sort(laid_out, axis=None), np.sort(blocks, axis=None))
    np.testing.assert_array_equal(laid_out[32:], blocks[32:])  # the last rows % 8 stay as stored
    assert not np.array_equal(laid_out[:32], blocks[:32])
    with pytest.raises(ValueError):
        quant.prepare(qtype, blocks[:, 1:])


def k_header(fields: np.ndarray, multipliers: np.ndarray, rows: int = 1) -> list[np.ndarray]:
    """A converted kind's header values for ``rows`` rows, [value][row], in numpy: each int8 multiplier
    (``multipliers``' bytes, [multiplier][row]) times its f16 field (``fields``' bytes, [field][row]), the
    last field serving the multipliers past it (quant.LAYOUT's comment)."""
    f16 = fields.copy().view("<f2").astype(np.float32).reshape(-1, rows)
    ints = multipliers.view(np.int8).astype(np.float32).reshape(-1, rows)
    return [f16[min(i, len(f16) - 1)] * ints[i] for i in range(len(ints))]


def test_q4_k_is_laid_out_as_runs_of_q4_1_blocks_whose_scale_and_min_share_the_super_blocks_f16_fields():
    """Q4_K's 144-byte super-blocks become runs of 148 bytes: the super-block's f16 d and -dmin once, then
    eight 18-byte blocks (the block's 6-bit sc and m as int8, 16 quant bytes): 0.578 bytes a value, d sc q -
    dmin m as gguf's; in a row group the run's fields are its eight rows', then each block's multipliers
    byte by byte and its quants four bytes of a row at a time. Dequantized back (embed_rows above), gguf's
    bit for bit."""
    blocks, dense = gguf_weight("Q4_K", 37, 512)
    kind, laid_out = quant.prepare("Q4_K", blocks)
    assert kind == quant.KINDS["Q4_K"] and laid_out.shape == (37, 512 // 256 * 148) and laid_out.dtype == np.uint8
    for r, run in enumerate(laid_out[36].reshape(-1, 148)):   # a row kept as one-row runs
        for b, block in enumerate(run[4:].reshape(8, 18)):
            d, m = k_header(run[:4], block[:2])
            low = (block[2:] & 15).astype(np.float32)
            np.testing.assert_array_equal(d * low + m, dense[36, 256 * r + 32 * b:256 * r + 32 * b + 16])
    group = laid_out[:8].reshape(-1)
    for r in range(2):   # each run's third block, byte 0, eight rows
        run = group[r * 8 * 148:(r + 1) * 8 * 148]
        block = run[8 * 4 + 2 * 8 * 18:][:8 * 18]
        d, m = k_header(run[:8 * 4], block[:16], rows=8)
        np.testing.assert_array_equal(d * (block[16:48:4] & 15).astype(np.float32) + m, dense[:8, 256 * r + 64])
    with pytest.raises(ValueError):
        quant.prepare("Q4_K", blocks[:, 1:])


def packed_values(quants: np.ndarray, high_bits: int) -> np.ndarray:
    """A block's 32 values from its 16 bytes of nibbles (byte j: elements j and j + 16) and 4 high_bits bytes
    of high bits (element 4 p + e + 16 h's at bit a % 8 of byte 4 (a // 8) + e, a = high_bits (2 p + h)),
    as quant.LAYOUT's comment lays Q6_K and Q5_K out, in numpy."""
    values = np.empty(32, np.int64)
    for i in range(32):
        h, j = divmod(i, 16)
        a = high_bits * (2 * (j // 4) + h)
        high = int(quants[16 + 4 * (a // 8) + j % 4]) >> (a % 8) & ((1 << high_bits) - 1)
        values[i] = (int(quants[j]) >> (4 * h) & 15) | high << 4
    return values


def group_values(quants: np.ndarray, high_bits: int) -> np.ndarray:
    """A row group's block's values [8 rows, 32] from its quant bytes, four bytes of a row together (bytes
    4 p .. 4 p + 3 of row r at 32 p + 4 r)."""
    rows = quants.reshape(-1, 8, 4).transpose(1, 0, 2).reshape(8, -1)
    return np.array([packed_values(row, high_bits) for row in rows])


def test_q6_k_is_laid_out_as_runs_of_packed_blocks_with_a_scale_per_half_sharing_the_super_blocks_f16_d():
    """Q6_K's 210-byte super-blocks become runs of 210 bytes, GGUF's size: the super-block's f16 d once, then
    eight 26-byte blocks (the block's two int8 sc, the 6-bit values as 16 bytes of nibbles and 8 of high
    bits): d sc (q - 32) as gguf's; in a row group each block's quant bytes four bytes of a row at a time;
    dequantized back (embed_rows above), gguf's bit for bit."""
    blocks, dense = gguf_weight("Q6_K", 37, 512)
    kind, laid_out = quant.prepare("Q6_K", blocks)
    assert kind == quant.KINDS["Q6_K"] and laid_out.shape == (37, 512 // 256 * 210)
    for r, run in enumerate(laid_out[36].reshape(-1, 210)):   # a row kept as one-row runs
        for b, block in enumerate(run[2:].reshape(8, 26)):
            d, d2 = k_header(run[:2], block[:2])
            values = (packed_values(block[2:], 2) - 32).astype(np.float32)
            np.testing.assert_array_equal(np.concatenate([d * values[:16], d2 * values[16:]]),
                                          dense[36, 256 * r + 32 * b:256 * r + 32 * b + 32])
    run = laid_out[:8].reshape(-1)[8 * 210:2 * 8 * 210]        # the first group's second run
    block = run[8 * 2 + 5 * 8 * 26:][:8 * 26]                  # its sixth block
    d, d2 = k_header(run[:8 * 2], block[:16], rows=8)
    values = (group_values(block[16:], 2) - 32).astype(np.float32)
    np.testing.assert_array_equal(d[:, None] * values[:, :16], dense[:8, 256 + 160:256 + 176])
    np.testing.assert_array_equal(d2[:, None] * values[:, 16:], dense[:8, 256 + 176:256 + 192])
    with pytest.raises(ValueError):
        quant.prepare("Q6_K", blocks[:, 1:])


def test_q5_k_is_laid_out_as_runs_of_packed_blocks_whose_scale_and_min_share_the_super_blocks_f16_fields():
    """Q5_K's 176-byte super-blocks become runs of 180 bytes: the super-block's f16 d and -dmin once, then
    eight 22-byte blocks (the block's 6-bit sc and m as int8, the 5-bit values as 16 bytes of nibbles and 4 of
    fifth bits): d sc q - dmin m as gguf's; in a row group each piece eight rows' together, the quant bytes
    four of a row at a time."""
    blocks, dense = gguf_weight("Q5_K", 37, 512)
    kind, laid_out = quant.prepare("Q5_K", blocks)
    assert kind == quant.KINDS["Q5_K"] and laid_out.shape == (37, 512 // 256 * 180)
    for r, run in enumerate(laid_out[36].reshape(-1, 180)):   # a row kept as one-row runs
        for b, block in enumerate(run[4:].reshape(8, 22)):
            d, m = k_header(run[:4], block[:2])
            np.testing.assert_array_equal(d * packed_values(block[2:], 1).astype(np.float32) + m,
                                          dense[36, 256 * r + 32 * b:256 * r + 32 * b + 32])
    run = laid_out[:8].reshape(-1)[8 * 180:2 * 8 * 180]        # the first group's second run
    block = run[8 * 4 + 3 * 8 * 22:][:8 * 22]                  # its fourth block
    d, m = k_header(run[:8 * 4], block[:16], rows=8)
    values = group_values(block[16:], 1).astype(np.float32)
    np.testing.assert_array_equal(d[:, None] * values + m[:, None], dense[:8, 256 + 96:256 + 128])


def test_q5_1_is_laid_out_as_packed_blocks_with_their_own_scale_and_min():
    """Q5_1's 24-byte blocks become 26-byte ones: f16 d and m, int8 multipliers 1, then the 5-bit values as
    Q5_K's: d q + m as gguf's; in a row group each piece eight rows' together, the quant bytes four of a row
    at a time."""
    blocks, dense = gguf_weight("Q5_1", 37, 512)
    kind, laid_out = quant.prepare("Q5_1", blocks)
    assert kind == quant.KINDS["Q5_1"] and laid_out.shape == (37, 512 // 32 * 26)
    for b, block in enumerate(laid_out[36].reshape(-1, 26)):   # a row kept as one-row blocks
        d, m = k_header(block[:4], block[4:6])
        np.testing.assert_array_equal(d * packed_values(block[6:], 1).astype(np.float32) + m,
                                      dense[36, 32 * b:32 * b + 32])
    block = laid_out[:8].reshape(-1)[3 * 8 * 26:4 * 8 * 26]    # the first group's fourth block
    d, m = k_header(block[:8 * 4], block[8 * 4:8 * 6], rows=8)
    values = group_values(block[8 * 6:], 1).astype(np.float32)
    np.testing.assert_array_equal(d[:, None] * values + m[:, None], dense[:8, 96:128])


@pytest.mark.parametrize("qtype", [*QTYPES, *K_BLOCKS, "Q5_0", "Q5_1"])
def test_prepare_in_row_chunks_gives_the_same_layout(qtype, monkeypatch):
    """Large weights are converted and laid out PREPARE_ROWS rows at a time: 37 rows in chunks of 16
    (two whole chunks, then 5 rows kept as stored) come out as in one piece."""
    blocks = gguf_weight(qtype, 37, 256)[0]
    whole = quant.prepare(qtype, blocks)[1]
    monkeypatch.setattr(quant, "PREPARE_ROWS", 16)
    np.testing.assert_array_equal(quant.prepare(qtype, blocks)[1], whole)


def test_q5_0_is_read_in_its_own_22_byte_blocks():
    """Q5_0 keeps its 22 bytes a block (it is not widened): a group's block holds its eight rows' d, their
    fifth bits rearranged (bit 2 p + h of byte 4 r + e: row r's element 16 h + 4 p + e), then the nibbles
    as Q4_0's, four bytes of a row together (bytes 4 p .. 4 p + 3 of row r at 32 p + 4 r). Dequantized back
    (embed_rows above) it is gguf's weight bit for bit."""
    blocks, dense = gguf_weight("Q5_0", 37, 96)
    kind, laid_out = quant.prepare("Q5_0", blocks)
    assert kind == quant.Q5_0 and laid_out.shape == blocks.shape
    np.testing.assert_array_equal(laid_out[32:], blocks[32:])   # the last rows % 8 stay as stored
    group, stored = laid_out[:8].reshape(-1)[:8 * 22], blocks[:8, :22]   # the first group's first block
    np.testing.assert_array_equal(group[:16].reshape(8, 2), stored[:, 0:2])     # d
    np.testing.assert_array_equal(group[48:].reshape(4, 8, 4).transpose(1, 0, 2).reshape(8, 16), stored[:, 6:])
    for r in range(8):
        qh = int.from_bytes(stored[r, 2:6].tobytes(), "little")
        for i in range(32):
            h, p, e = i // 16, i % 16 // 4, i % 4
            assert group[16 + 4 * r + e] >> (2 * p + h) & 1 == qh >> i & 1


HOST_ISAS = [isa for isa in vector.ISA_FEATURES if isa != vector.ISA
             and all(llvm.get_host_cpu_features().get(f) for f in vector.ISA_FEATURES[isa])]


@pytest.mark.parametrize("isa", HOST_ISAS)
def test_every_instruction_set_the_host_has_gives_the_same_floats(tmp_path, isa):
    """LSE_JIT_ISA forces each instruction set the host has besides the one chosen (on an AVX-512 VNNI host:
    AVX2 and the portable IR) in a fresh numba cache: vpdpbusd, pmaddubsw and pmaddwd, or widened integer
    ops for the int8 products, vcvtph2ps or integer ops for the f16 scales, all exact; every other
    operation is the same IR, so the results are bit for bit the same (and so as close to the reference).
    The subprocess compiles the row-group driver only (every tile; linear adds no IR of its own)."""
    x = RNG.standard_normal((37, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    expected = {}
    for qtype in (*QTYPES, *K_BLOCKS, "Q5_0", "Q5_1"):
        blocks, dense = gguf_weight(qtype, 40, 256)
        kind, laid_out = prepared(qtype, blocks)
        np.save(tmp_path / f"{qtype}.npy", laid_out)
        for tokens in (1, 3, 16, 37):
            out = np.full((tokens, 40), np.nan, np.float32)
            scratch = quant.activation_scratch(tokens, 256)
            quant.quantize_activations(kind, x[:tokens], scratch)
            quant._groups(quant.ALL_KINDS, kind, laid_out, x[:tokens], out, 0, 5, scratch)
            assert_close_to_reference(out, seen_by_kernels(qtype, x[:tokens]), dense)
            expected[qtype, tokens] = out
    script = (
        "import sys, numpy as np\n"
        "import lse_backends.jit.quant as quant\n"
        "from lse_backends.jit import vector\n"
        f"assert vector.ISA == {isa!r}\n"
        "d = sys.argv[1]; x = np.load(d + '/x.npy')\n"
        "for q in ('Q4_0', 'Q4_1', 'Q8_0', 'Q4_K', 'Q6_K', 'Q5_K', 'Q5_0', 'Q5_1'):\n"
        "    for t in (1, 3, 16, 37):\n"
        "        out = np.full((t, 40), np.nan, np.float32)\n"
        "        w = np.load(f'{d}/{q}.npy'); w.flags.writeable = False\n"
        "        scratch = quant.activation_scratch(t, 256)\n"
        "        quant.quantize_activations(quant.KINDS[q], x[:t], scratch)\n"
        "        quant._groups(quant.ALL_KINDS, quant.KINDS[q], w, x[:t], out, 0, 5, scratch)\n"
        "        np.save(f'{d}/{q}.{t}.npy', out)\n"
    )
    env = dict(os.environ, LSE_JIT_ISA=isa, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=str(Path(__file__).parents[1]))
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True, timeout=600)
    for (qtype, tokens), out in expected.items():
        np.testing.assert_array_equal(np.load(tmp_path / f"{qtype}.{tokens}.npy"), out)


def test_the_disk_cache_keeps_each_instruction_sets_code_apart(tmp_path):
    """Code compiled for one instruction set is never loaded for another (LSE_JIT_ISA) from a shared cache:
    a process asking for the portable IR compiles its own, and each set's entries stay for the next run."""
    script = (
        "import json, numpy as np\n"
        "from lse_backends.jit import cache, quant\n"
        "scratch = quant.activation_scratch(1, 256)\n"
        "quant.quantize_activations(quant.Q4_0, np.ones((1, 256), np.float32), scratch)\n"
        "print(json.dumps([c.name for c in cache.COMPILED]))\n"
    )

    def compiled(**env: str) -> list[str]:
        environ = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(Path(__file__).parents[1]), **env)
        environ.pop("LSE_JIT_ISA", None)
        result = subprocess.run([sys.executable, "-c", script], env=environ | env, capture_output=True, text=True,
                                check=True, timeout=600)
        return json.loads(result.stdout.splitlines()[-1])

    assert "quant.quantize_activations" in compiled()
    assert "quant.quantize_activations" in compiled(LSE_JIT_ISA="portable")
    assert compiled() == [] and compiled(LSE_JIT_ISA="portable") == []
    names = {path.name for path in tmp_path.rglob("*.nbi")}
    assert any("-portable." in name for name in names) and any(f"-{vector.ISA}." in name for name in names)


def test_the_instruction_set_is_the_best_the_features_allow_or_the_one_asked_for():
    avx2 = {"avx2": True, "f16c": True, "fma": True}
    assert vector.select_isa({}) == "portable"
    assert vector.select_isa({"avx2": True, "fma": True}) == "portable"   # no F16C
    assert vector.select_isa(avx2) == "avx2"
    assert vector.select_isa({**avx2, "avxvnni": True}) == "avxvnni"
    assert vector.select_isa({**avx2, "avx512vnni": True}) == "avx2"      # its 256-bit form needs AVX512VL
    assert vector.select_isa({**avx2, "avx512vnni": True, "avx512vl": True, "avxvnni": True}) == "avx512vnni"
    assert vector.select_isa({**avx2, "avx512vnni": True, "avx512vl": True}, "avx2") == "avx2"
    amx = {**avx2, "avx512vnni": True, "avx512vl": True, "avx512f": True, "avx512bw": True}
    assert vector.select_isa({**amx, "amx-int8": True, "amx-tile": True}) == "amx"
    assert vector.select_isa({**amx, "amx-int8": True, "amx-tile": True}, "avx512vnni") == "avx512vnni"
    assert vector.select_isa({**amx, "amx-int8": True}) == "avx512vnni"   # no tiles (or Linux lent none)
    assert vector.select_isa(avx2, "portable") == "portable"
    for requested in ("avxvnni", "avx512vnni"):
        with pytest.raises(ValueError, match="lacks"):
            vector.select_isa(avx2, requested)
    with pytest.raises(ValueError, match="not one of"):
        vector.select_isa(avx2, "sse2")


def test_the_amx_instructions_lower_to_tile_instructions():
    """The AMX helpers (amx.py) the AMX tiles are made of, compiled for a CPU with AMX (whatever this host
    is: only assembly is made), configure the tiles, load, multiply signed by signed and signed by unsigned
    bytes, store and release them."""
    module = ir.Module()
    function = ir.Function(module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()] * 3), "tiles")
    builder = ir.IRBuilder(function.append_basic_block())
    a, b, c = function.args
    stride = ir.Constant(ir.IntType(64), 64)
    amx.configure(builder, {0: (16, 64), 1: (16, 64), 4: (16, 64), 6: (16, 64)})
    amx.load(builder, 4, a, stride)
    amx.load(builder, 6, b, stride)
    amx.zero(builder, 0)
    amx.zero(builder, 1)
    amx.dot(builder, 0, 4, 6, True)
    amx.dot(builder, 1, 4, 6, False)
    amx.store(builder, 0, c, stride)
    amx.release(builder)
    builder.ret_void()
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(cpu="sapphirerapids", opt=2)
    assembly = machine.emit_assembly(llvm.parse_assembly(str(module)))
    for instruction in ("ldtilecfg", "tileloadd", "tilezero", "tdpbssd", "tdpbsud", "tilestored", "tilerelease"):
        assert instruction in assembly, assembly


@pytest.mark.parametrize("isa, cpu, instructions", [
    ("avx512vnni", "icelake-server", ["vpdpbusd"]), ("avxvnni", "alderlake", ["{vex}", "vpdpbusd"]),
    ("avx2", "haswell", ["vpmaddubsw", "vpmaddwd"]), ("portable", "haswell", ["vpmullw"])])
def test_each_instruction_set_lowers_the_int8_products_to_its_instructions(monkeypatch, isa, cpu, instructions):
    """The int8 dot product (quant._dot4) written for each instruction set, compiled for a CPU that has it
    (whatever this host is: only assembly is made), is made of that set's instructions, and of no VNNI one
    where the set has none (a vpdpbusd would not run there)."""
    monkeypatch.setattr(quant, "VNNI", isa in ("avx512vnni", "avxvnni"))
    monkeypatch.setattr(quant, "AVX2", isa != "portable")
    module = ir.Module()
    v8i32, v32i8 = ir.VectorType(ir.IntType(32), 8), ir.VectorType(ir.IntType(8), 32)
    function = ir.Function(module, ir.FunctionType(v8i32, [v8i32, v32i8, v32i8]), "dot4")
    builder = ir.IRBuilder(function.append_basic_block())
    builder.ret(quant._dot4(builder, *function.args))
    llvm.initialize_native_asmprinter()
    machine = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(cpu=cpu, opt=2)
    assembly = machine.emit_assembly(llvm.parse_assembly(str(module)))
    assert all(name in assembly for name in instructions), assembly
    assert ("vpdpbusd" in assembly) == quant.VNNI
