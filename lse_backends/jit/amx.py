"""Intel AMX in LLVM IR, for the jit device's int8 GEMM tiles (quant.py) where the host has AMX-INT8.

AMX multiplies tiles, 2-D registers of up to 16 rows of 64 bytes: ``dot(c, a, b)`` adds to int32 tile c
[M x N] the products of int8 tile a [M x K] and tile b, K/4 rows of N x 4 bytes (each row four
consecutive k of every column n: the layout of the jit device's quant loads, ``32 p + 4 r``), exactly,
16 x 16 x 64 products in one instruction, eight times a 512-bit vpdpbusd's. The tiles' shapes are a
configuration (``configure``) loaded per call; the tiles are addressed by number (0-7). Linux hands the
tile registers' state to a process only when asked (``permitted``: arch_prctl ARCH_REQ_XCOMP_PERM);
without it the first tile instruction faults.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Sequence

from llvmlite import ir
from numba.core import cgutils

from lse_core.devices.host_memory import libc_function

i8, i16, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(64)
ROWS, ROW_BYTES = 16, 64   # a tile's most rows, and bytes a row
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18   # x86-64 Linux


@functools.cache
def permitted() -> bool:
    """Whether this process may use the tile registers (asked for once; Linux 5.16 and later on x86-64)."""
    syscall = libc_function("syscall", (ctypes.c_long, ctypes.c_long, ctypes.c_long), ctypes.c_long)
    if syscall is None or platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    return syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _call(builder: ir.IRBuilder, name: str, args: Sequence[ir.Value]) -> None:
    signature = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(cgutils.get_or_insert_function(builder.module, signature, name), list(args))


def _tile(number: int) -> ir.Constant:
    return ir.Constant(i8, number)


def configure(builder: ir.IRBuilder, shapes: dict[int, tuple[int, int]]) -> None:
    """Load a tile configuration (palette 1): tile number -> (rows, bytes a row); other tiles unused."""
    config = cgutils.alloca_once(builder, ir.ArrayType(i8, 64))
    builder.store(ir.Constant(ir.ArrayType(i8, 64), None), config)
    at = builder.bitcast(config, i8.as_pointer())
    builder.store(ir.Constant(i8, 1), at)
    for number, (rows, row_bytes) in shapes.items():
        column_bytes = builder.bitcast(builder.gep(at, [ir.Constant(i64, 16 + 2 * number)]), i16.as_pointer())
        builder.store(ir.Constant(i16, row_bytes), column_bytes)
        builder.store(ir.Constant(i8, rows), builder.gep(at, [ir.Constant(i64, 48 + number)]))
    _call(builder, "llvm.x86.ldtilecfg", [at])


def release(builder: ir.IRBuilder) -> None:
    """Return the tiles to their initial state (so a context switch saves none of them)."""
    _call(builder, "llvm.x86.tilerelease", [])


def zero(builder: ir.IRBuilder, tile: int) -> None:
    _call(builder, "llvm.x86.tilezero", [_tile(tile)])


def load(builder: ir.IRBuilder, tile: int, at: ir.Value, stride: ir.Value) -> None:
    """Tile rows from byte pointer ``at``, ``stride`` bytes apart (an i64)."""
    _call(builder, "llvm.x86.tileloadd64", [_tile(tile), at, stride])


def store(builder: ir.IRBuilder, tile: int, at: ir.Value, stride: ir.Value) -> None:
    _call(builder, "llvm.x86.tilestored64", [_tile(tile), at, stride])


def dot(builder: ir.IRBuilder, c: int, a: int, b: int, b_signed: bool) -> None:
    """c += a . b, a's bytes signed, b's signed or unsigned (tdpbssd, tdpbsud)."""
    _call(builder, "llvm.x86.tdpbssd" if b_signed else "llvm.x86.tdpbsud", [_tile(c), _tile(a), _tile(b)])
