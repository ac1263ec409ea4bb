"""LLVM vector IR for the jit device's ``@intrinsic`` kernels (quant.py, attention.py): numba's own loops
vectorize badly where a kernel needs registers it controls (nibble unpacking, accumulators kept across a
loop, dot products reduced eight at a time), so those kernels emit <8 x float> IR through these helpers.
Loads and stores are unaligned: numba arrays promise no alignment.

The instruction set the kernels are written for (``ISA``) is chosen once, at import, from the host CPU's
features as LLVM reports them (``select_isa``): AMX (AVX-512 VNNI, and its GEMM steps in tile registers:
amx.py), AVX-512 VNNI or AVX-VNNI (vpdpbusd), AVX2 (pmaddubsw and pmaddwd, vcvtph2ps) or portable integer
vector IR any LLVM target lowers. ``LSE_JIT_ISA`` asks for one of
them (one the host has: a VNNI instruction on a CPU without it would not even compile); the disk cache keeps
each instruction set's code apart (cache.PackageLocator)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils

from . import amx

LANES = 8  # float32 lanes of an AVX2 register; LLVM splits or scalarizes vectors on narrower targets

i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
f16, f32 = ir.HalfType(), ir.FloatType()
v8i8, v8i16, v8i32, v8f16, v8f32 = (ir.VectorType(t, LANES) for t in (i8, i16, i32, f16, f32))
v32i8 = ir.VectorType(i8, 4 * LANES)  # a 256-bit register of bytes


# best first; each with the features LLVM must report for it (the VNNI ones run the AVX2 code around vpdpbusd;
# AVX-512 VNNI's 256-bit form needs AVX512VL; AMX runs the AVX-512 VNNI code, and its GEMM tiles in tile
# registers with 512-bit vectors around them)
ISA_FEATURES = {
    "amx": ("amx-int8", "amx-tile", "avx512f", "avx512bw", "avx512vnni", "avx512vl", "avx2", "f16c", "fma"),
    "avx512vnni": ("avx512vnni", "avx512vl", "avx2", "f16c", "fma"),
    "avxvnni": ("avxvnni", "avx2", "f16c", "fma"),
    "avx2": ("avx2", "f16c", "fma"),
    "portable": (),
}


def select_isa(features: Mapping[str, bool], requested: str | None = None) -> str:
    """The best instruction set of ISA_FEATURES that ``features`` (LLVM's host feature map) has, or
    ``requested`` (a name in ISA_FEATURES, or None or '') where the host has it."""
    usable = [isa for isa, needs in ISA_FEATURES.items() if all(features.get(f) for f in needs)]
    if not requested:
        return usable[0]
    if requested not in ISA_FEATURES:
        raise ValueError(f"LSE_JIT_ISA={requested!r}: not one of {', '.join(ISA_FEATURES)}")
    if requested not in usable:
        raise ValueError(f"LSE_JIT_ISA={requested!r}: this CPU lacks it (it has {', '.join(usable)})")
    return requested


def host_features() -> dict[str, bool]:
    """LLVM's host feature map, without AMX where Linux does not let this process use the tile registers."""
    features = dict(llvm.get_host_cpu_features())
    if features.get("amx-tile") and not amx.permitted():
        features["amx-tile"] = False
    return features


ISA = select_isa(host_features(), os.environ.get("LSE_JIT_ISA"))
AMX = ISA == "amx"
VNNI = ISA in ("amx", "avx512vnni", "avxvnni")
AVX2 = ISA != "portable"   # every ISA but the portable one has AVX2, F16C and FMA


def integer(value: int) -> ir.Constant:
    return ir.Constant(i64, value)


def vector(value: float | int, vtype: ir.VectorType = v8f32) -> ir.Constant:
    return ir.Constant(vtype, [value] * vtype.count)


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c, lane by lane, rounded once (float vectors of any width)."""
    vtype = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vtype, [vtype] * 3),
                                        f"llvm.fma.v{vtype.count}f32")
    return builder.call(fn, [a, b, c])


def splat(builder: ir.IRBuilder, value: ir.Value, vtype: ir.VectorType = v8f32) -> ir.Value:
    """A float in all lanes."""
    one = builder.insert_element(ir.Constant(vtype, None), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, vtype.count), None))


def load(builder: ir.IRBuilder, base: ir.Value, offset: int, vtype: ir.Type) -> ir.Value:
    """A ``vtype`` at byte pointer ``base`` + ``offset`` bytes."""
    return builder.load(builder.bitcast(builder.gep(base, [integer(offset)]), vtype.as_pointer()), align=1)


def load_floats(builder: ir.IRBuilder, floats: ir.Value, index: ir.Value) -> ir.Value:
    """<8 x float> from float pointer ``floats`` at element ``index`` (an i64 value)."""
    return builder.load(builder.bitcast(builder.gep(floats, [index]), v8f32.as_pointer()), align=4)


def store_floats(builder: ir.IRBuilder, value: ir.Value, floats: ir.Value, index: ir.Value) -> None:
    """<8 x float> ``value`` to float pointer ``floats`` at element ``index``."""
    builder.store(value, builder.bitcast(builder.gep(floats, [index]), v8f32.as_pointer()), align=4)


def prefetch(builder: ir.IRBuilder, at: ir.Value, write: bool = False) -> None:
    """Prefetch the cache line at ``at`` (a hint: no fault past the end of the array), to read or to write."""
    signature = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, signature, "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(at, i8.as_pointer()), ir.Constant(i32, int(write)), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])   # keep, data


def tree_sum(builder: ir.IRBuilder, values: list[ir.Value]) -> ir.Value:
    """The lane-by-lane sum of vectors, added pairwise."""
    while len(values) > 1:
        values = [builder.fadd(*values[i:i + 2]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _shuffled_sum(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, first: list[int], second: list[int]) -> ir.Value:
    def pick(lanes: list[int]) -> ir.Value:
        return builder.shuffle_vector(a, b, ir.Constant(v8i32, lanes))
    return builder.fadd(pick(first), pick(second))


def lane_sums(builder: ir.IRBuilder, vectors: list[ir.Value]) -> ir.Value:
    """<8 x float> whose lane i is the sum of the lanes of vectors[i] (eight of them): three rounds of
    adding shuffled pairs (LLVM emits vhaddps and one cross-half permute), never a scalar sum."""
    pairs = [_shuffled_sum(builder, vectors[i], vectors[i + 1], [0, 8, 2, 10, 4, 12, 6, 14],
                           [1, 9, 3, 11, 5, 13, 7, 15]) for i in range(0, LANES, 2)]
    quads = [_shuffled_sum(builder, pairs[i], pairs[i + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])
             for i in range(0, 4, 2)]
    return _shuffled_sum(builder, quads[0], quads[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])


def row_pointer(builder: ir.IRBuilder, array, index: ir.Value, etype: ir.Type) -> ir.Value:
    """Pointer to row ``index`` of a 2-D numba array, as ``etype*``."""
    start = builder.gep(builder.bitcast(array.data, i8.as_pointer()),
                        [builder.mul(index, builder.extract_value(array.strides, 0))])
    return builder.bitcast(start, etype.as_pointer())


def clamp(builder: ir.IRBuilder, value: ir.Value, last: ir.Value) -> ir.Value:
    return builder.select(builder.icmp_signed("<", value, last), value, last)


def store(builder: ir.IRBuilder, array, index: ir.Value, column: ir.Value, value: ir.Value) -> None:
    """Store <8 x float> ``value`` at [index, column .. column + 7] of a 2-D float32 numba array."""
    store_floats(builder, value, row_pointer(builder, array, index, f32), column)
