"""The numba JIT CPU device, jit:0: quantized linears that read GGUF blocks in place (quant.py),
compiled kernels for the other ops (kernels.py, sampling.py), a code generator for fused elementwise
groups (codegen.py), and programs that run many groups in one compiled call (program.py). Arrays live
in host memory, so moving to and from it is free."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import Backend, CompileContext, Device, DeviceInfo, Kernel, hookimpl
from lse_core.devices.host_memory import HugePageArena, sparse_zeros
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import MOE_OPS, SAMPLING_OP_NEEDED, Node, Step, rope_cos_sin

try:
    import numba
except ImportError as e:  # the backend declines; lse_core reports the reason
    numba = None
    _MISSING = f"numba is not installed ({e})"
else:
    from . import cache

    cache.install()  # before any function of the package is cached: keyed by all of its sources
    from . import attention, codegen, moe, program, quant, vector
    from .program import ATTENTION, EMBED, EMBED_Q, FUSED, LAST_ROWS, LINEAR, LINEAR_Q, RMS_NORM, ROPE, Instruction

log = logging.getLogger("lse")


class JitDevice(Device):
    """jit:0. Every model group compiles to a Program (program.py): instructions that one @njit call runs,
    with generated functions for elementwise groups; the planner links consecutive groups into one
    program. Sampling groups are kernels of their own (sampling.py). Deterministic: the kernels are
    row-independent but for the quantized linears' paths, which then follow one row's (quant._groups)."""

    deterministic = True
    kv_cache_types = ("f16", "q8_0", "f32")

    def __init__(self) -> None:
        self.info = DeviceInfo("jit", 0, "cpu", codegen=True, description=(
            f"numba {numba.__version__} on {llvm_host_cpu()}, {numba.get_num_threads()} threads; "
            f"int8 activations ({vector.ISA}) for every weight in prefill (two planes, 15 bits a value, for Q4 "
            "ones), for Q4 and Q5_0 ones in steps of up to 16 tokens, and in two planes for Q8_0, Q6_K and Q5_K "
            "ones in steps of one or two"))
        # id(weight) -> (weight, laid-out form): a weight read by several groups (tied embeddings) is
        # prepared once; the source is kept so its id stays unique
        self._prepared: dict[int, tuple[Any, Any]] = {}
        self._decoded_types: set[str] = set()   # GGUF types decoded to float32, each reported once
        self._arena = HugePageArena()   # the quantized layouts, in huge pages

    def _weight(self, weight: Any) -> tuple[int, np.ndarray] | np.ndarray:
        """(kind, blocks) for a GGUF type the quantized kernels read in place, else a float32 array."""
        entry = self._prepared.get(id(weight))
        if entry is None:
            qtype = getattr(weight, "qtype", None)
            as_q8_0 = moe.mxfp4_as_q8_0(weight.data) if qtype == "MXFP4" else None
            if as_q8_0 is not None:   # exactly, in 34 bytes a block against float32's 128
                form: Any = quant.prepare("Q8_0", as_q8_0, self._arena.empty)
            elif qtype in quant.KINDS and weight.shape[-1] % quant.BLOCK == 0:
                form = quant.prepare(qtype, weight.data, self._arena.empty)
            else:  # other types decode once, exactly, to float32
                array = weight.dequantize() if hasattr(weight, "dequantize") else weight
                form = np.ascontiguousarray(array, np.float32)
                if form.ndim == 1:   # norms and biases: a vector read in the mapped file would fault its
                    form = form.copy()   # neighbours' pages in too (fault-around), 63 MiB on Qwen2.5-0.5B
                if qtype is not None and qtype not in self._decoded_types:
                    self._decoded_types.add(qtype)
                    log.warning("lse: jit:0 decodes %s weights to float32 at load (%.1fx the bytes the file "
                                "stores); it reads %s in place", qtype, form.nbytes / weight.data.nbytes,
                                ", ".join(quant.KINDS))
            entry = self._prepared[id(weight)] = (weight, form)
        return entry[1]

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        if group.sampling_op is not None:
            return _sampling_kernel(group, ctx)
        if group.nodes[0].op in MOE_OPS:
            return moe.compile_group(self, group, weights, ctx)
        kinds = quant.kinds_mask(ctx.weight_types)   # the model's: one linear_pairs for all its programs
        program.second_compile(kinds)   # a cold cache: the program kernels' share of a second process starts now
        if codegen.unsupported(group) is None:
            fused = codegen.compile_elementwise(group)
            instructions = [Instruction(FUSED, group.outputs, group.inputs, (fused,))]
        elif len(group.nodes) != 1:
            return f"{codegen.unsupported(group)} inside a fused group"
        elif (factory := _INSTRUCTIONS.get(group.nodes[0].op)) is None:
            return f"no kernel for {group.nodes[0].op}"
        else:
            node = group.nodes[0]
            instructions = [factory(self, node, [weights[p] for p in node.params], ctx)]
        return program.Program(instructions, group.inputs, group.outputs, ctx.max_tokens, ctx.kv_len, ctx.kv_slots,
                               ctx.deterministic, kinds)

    def can_link(self, kernel: Kernel) -> bool:
        return isinstance(kernel, program.Program)

    def link(self, kernels: Sequence[Kernel], inputs: Sequence[str], outputs: Sequence[str]) -> Kernel:
        return program.link(kernels, inputs, outputs)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array, np.float32)

    def to_host(self, buffer: np.ndarray) -> np.ndarray:
        # programs reuse their buffers every step; the caller gets its own copy
        return np.array(buffer, copy=True)

    def close(self) -> None:
        self._prepared.clear()
        self._arena = HugePageArena()


def llvm_host_cpu() -> str:
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name()


def _embedding(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    table = device._weight(params[0])
    scale = float(node.attrs.get("scale", 1.0))
    vocab, width = params[0].shape
    if isinstance(table, tuple):  # the step's rows decoded from the blocks as stored
        kind, blocks = table
        return Instruction(EMBED_Q, (node.output,), (), (blocks, kind), scale, width=width, vocab=vocab)
    return Instruction(EMBED, (node.output,), (), (table,), scale, width=width, vocab=vocab)


def _rms_norm(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    return Instruction(RMS_NORM, (node.output,), node.inputs, (device._weight(params[0]), int(node.attrs["group"])),
                       float(node.attrs["eps"]))


def _linear(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    weight = device._weight(params[0])
    bias = device._weight(params[1]) if len(params) > 1 else -1
    if isinstance(weight, tuple):
        kind, blocks = weight
        # the steps whose activations take two planes where the weights are Q4: by the product's role (quant._planes)
        wide = quant.WIDE_PREFILL | (quant.WIDE_DECODE if node.attrs.get("mlp") == "down" else 0)
        return Instruction(LINEAR_Q, (node.output,), node.inputs, (blocks, kind, wide, bias), width=params[0].shape[0])
    return Instruction(LINEAR, (node.output,), node.inputs, (weight, -1, bias), width=weight.shape[0])


def _rope(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    cos, sin = rope_cos_sin(node.attrs, ctx.kv_len)  # every position the cache can hold
    return Instruction(ROPE, (node.output,), node.inputs, (cos, sin, int(node.attrs["head_dim"])), uses_cache=True)


NO_SINKS = np.zeros(0, np.float32)   # plain attention's sinks: one array, so every program lists it once


def _attention(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    """attention, and sink_attention (its sinks, a logit per query head, are its one weight)."""
    n_heads, n_kv, head_dim = (int(node.attrs[k]) for k in ("n_heads", "n_kv_heads", "head_dim"))
    k_kind, v_kind = attention.KV_KINDS[ctx.cache_type_k], attention.KV_KINDS[ctx.cache_type_v]
    # head-major rows of bytes; the OS commits a slot's pages as its positions are first written
    k_cache, v_cache = (sparse_zeros((ctx.kv_slots, n_kv, ctx.kv_len, attention.row_bytes(kind, head_dim)), np.uint8)
                        for kind in (k_kind, v_kind))
    window = int(node.attrs.get("window") or 0)
    sinks = device._weight(params[0]) if params else NO_SINKS
    return Instruction(ATTENTION, (node.output,), node.inputs,
                       (k_cache, v_cache, n_heads, window, k_kind, v_kind, sinks),
                       float(node.attrs["scale"]), width=n_heads * head_dim, uses_cache=True)


def _last_rows(device: JitDevice, node: Node, params: list[Any], ctx: CompileContext) -> Instruction:
    return Instruction(LAST_ROWS, (node.output,), node.inputs)


_INSTRUCTIONS = {
    "embedding": _embedding,
    "rms_norm": _rms_norm,
    "linear": _linear,
    "rope": _rope,
    "attention": _attention,
    "sink_attention": _attention,
    "last_rows": _last_rows,
}


def _sampling_kernel(group: FusedGroup, ctx: CompileContext) -> Kernel:
    from . import sampling

    op = group.sampling_op
    if op == "sample":
        def run_sample(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
            (logits,) = inputs
            out = np.empty(logits.shape[0], np.int32)
            s = step.sampling
            sampling.sample(logits, s.temperature, s.uniform, out)
            return [out]

        return run_sample

    kernel = getattr(sampling, op)
    needed = SAMPLING_OP_NEEDED[op]

    def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        (logits,) = inputs
        out = np.empty_like(logits)
        s = step.sampling
        parameters = {"mask": (s.token_mask,), "penalize": (s.repetition_penalty, s.presence_penalty, s.recent),
                      "temperature": (s.temperature,), "top_k": (s.top_k,), "top_p": (s.top_p,),
                      "min_p": (s.min_p,)}[op]
        kernel(logits, needed(s), *parameters, out)
        return [out]

    return run


class JitBackend(Backend):
    name = "jit"

    def devices(self) -> list[DeviceInfo]:
        if numba is None:
            return [DeviceInfo("jit", 0, "cpu", codegen=True, declined=_MISSING)]
        return [DeviceInfo("jit", 0, "cpu", codegen=True, description=f"numba {numba.__version__} CPU kernels")]

    def open(self, index: int) -> Device:
        if numba is None:
            raise RuntimeError(_MISSING)
        if index != 0:
            raise ValueError(f"the jit backend has one device, jit:0 (asked for jit:{index})")
        return JitDevice()


@hookimpl
def lse_backend() -> Backend:
    return JitBackend()
