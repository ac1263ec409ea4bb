"""C code generation for fused elementwise groups, shared by the OpenCL and CUDA backends.

A fused group of elementwise nodes (silu, gelu, add, mul, scale; see lse_core.graph.ir) becomes one
kernel in which each work-item computes element ``i`` of every value: it loads the group's inputs
once, keeps intermediates in registers, and stores only the group's outputs. The kernel's
arguments are the output buffers (``group.outputs`` order), then the input buffers
(``group.inputs`` order), then ``int n``, the element count of each [T, width] value; launch at
least ``n`` work-items (extra ones return at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import ELEMENTWISE_OPS


@dataclass(frozen=True)
class Dialect:
    kernel: str        # the kernel qualifier and return type
    out_ptr: str       # a writable float buffer parameter, ``{}`` is the name
    in_ptr: str        # a read-only float buffer parameter
    index: str         # this work-item's global index
    exp: str           # float exp / tanh function names
    tanh: str


DIALECTS = {
    "opencl": Dialect(
        kernel="__kernel void",
        out_ptr="__global float* restrict {}",
        in_ptr="__global const float* restrict {}",
        index="get_global_id(0)",
        exp="exp",
        tanh="tanh",
    ),
    "cuda": Dialect(
        kernel='extern "C" __global__ void',
        out_ptr="float* __restrict__ {}",
        in_ptr="const float* __restrict__ {}",
        index="blockIdx.x * blockDim.x + threadIdx.x",
        exp="expf",
        tanh="tanhf",
    ),
}


@dataclass(frozen=True)
class KernelSource:
    """One generated kernel: ``source`` defines ``name`` taking buffers for ``outputs``, then
    buffers for ``inputs``, then ``int n``."""

    name: str
    source: str
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]


def float_literal(value: float) -> str:
    """A C float literal that round-trips float32 (9 significant digits)."""
    return f"{float(value):.9e}f"


def _expression(op: str, args: list[str], attrs: dict, d: Dialect) -> str:
    if op == "add":
        return f"{args[0]} + {args[1]}"
    if op == "mul":
        return f"{args[0]} * {args[1]}"
    if op == "scale":
        return f"{args[0]} * {float_literal(attrs['factor'])}"
    if op == "silu":
        return f"{args[0]} / (1.0f + {d.exp}(-{args[0]}))"
    if op == "gelu":  # the tanh approximation; sqrt(2 / pi) = 0.7978845608
        x = args[0]
        return f"0.5f * {x} * (1.0f + {d.tanh}(0.7978845608f * ({x} + 0.044715f * {x} * {x} * {x})))"
    raise ValueError(f"no C expression for {op}")


def unsupported_op(group: FusedGroup) -> str | None:
    """The first op of the group this generator cannot express, or None."""
    return next((op for op in group.ops if op not in ELEMENTWISE_OPS), None)


def elementwise_kernel(group: FusedGroup, dialect: str, name: str) -> KernelSource:
    """The C source of one kernel computing every node of an elementwise fused group."""
    if (op := unsupported_op(group)) is not None:
        raise ValueError(f"{group.describe()}: no kernel for {op}")
    d = DIALECTS[dialect]
    local = {value: f"in{i}" for i, value in enumerate(group.inputs)}
    params = [d.out_ptr.format(f"out{i}") for i in range(len(group.outputs))]
    params += [d.in_ptr.format(f"in{i}_p") for i in range(len(group.inputs))]
    body = [f"const float in{i} = in{i}_p[i];" for i in range(len(group.inputs))]
    for j, node in enumerate(group.nodes):
        local[node.output] = f"v{j}"
        expr = _expression(node.op, [local[v] for v in node.inputs], node.attrs, d)
        body.append(f"const float v{j} = {expr};")
    body += [f"out{i}[i] = {local[value]};" for i, value in enumerate(group.outputs)]
    lines = [
        f"{d.kernel} {name}({', '.join(params + ['const int n'])}) {{",
        f"  const int i = {d.index};",
        "  if (i >= n) return;",
        *(f"  {line}" for line in body),
        "}",
    ]
    return KernelSource(name, "\n".join(lines) + "\n", tuple(group.outputs), tuple(group.inputs))
