"""Atomic counters and spin-waiting for the threads of one program run (program.py): numba has no atomics
of its own, so these are LLVM ``atomicrmw`` and atomic loads on an int64 array's elements, emitted through
``@intrinsic``; and the cycle counter that times a program's tasks."""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _element(context, builder, signature, args):
    array_type = signature.args[0]
    array = context.make_array(array_type)(context, builder, args[0])
    index = context.cast(builder, args[1], signature.args[1], types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, array, [index])


def _check(array) -> None:
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.dtype == types.int64):
        raise TypingError("atomics take a 1-D int64 array")


@intrinsic
def fetch_add(typingctx, array, index, value):
    """array[index] += value atomically; returns the value before."""
    _check(array)

    def codegen(context, builder, signature, args):
        amount = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", _element(context, builder, signature, args), amount, "seq_cst")

    return types.int64(array, index, value), codegen


@intrinsic
def load(typingctx, array, index):
    """array[index], read atomically (acquire: what was written before it was stored is visible)."""
    _check(array)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature, args), "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def pause(typingctx):
    """A spin-wait hint to the core (x86 ``pause``); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def nap(typingctx, microseconds):
    """Sleep (POSIX ``usleep``, linked by name, so cached code stays valid), giving the core to whatever
    else is runnable: a thread that has waited long may be waiting for one the OS has descheduled."""

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                            "usleep")
        builder.call(fn, [context.cast(builder, args[0], signature.args[0], types.int32)])
        return context.get_dummy_value()

    return types.void(microseconds), codegen


@intrinsic
def cycles(typingctx):
    """The x86 time-stamp counter (rdtsc, at a constant rate on current CPUs); 0 elsewhere (LLVM's
    readcyclecounter reads a performance counter on some targets that user code may not)."""

    def codegen(context, builder, signature, args):
        if not _X86:
            return ir.Constant(ir.IntType(64), 0)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen
