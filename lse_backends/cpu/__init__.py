"""The numpy CPU interpreter: runs every op of the IR in float32. It is the reference the other
backends are tested against and the device that runs a group no pool device can (CPU fallback).
It has no device code generator: a fused group, or a linked run of groups, runs node by node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import Backend, CompileContext, Device, DeviceInfo, Kernel, hookimpl
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Node, Step

from .kernels import MODEL_KERNELS, NodeKernel, reads_transposed
from .moe import MOE_KERNELS
from .sampling import SAMPLING_KERNELS

KERNELS = {**MODEL_KERNELS, **MOE_KERNELS, **SAMPLING_KERNELS}


class Program:
    """Node kernels run in order, a fused group's or (linked) several consecutive groups': one call
    per step for all of them. Values are numbered once, here -- the inputs, then each node's output --
    so a call appends each output to a list and reads arguments by index, building no dict."""

    def __init__(self, nodes: Sequence[tuple[Node, NodeKernel]], inputs: Sequence[str], outputs: Sequence[str]) -> None:
        self.nodes = list(nodes)
        index = {name: i for i, name in enumerate([*inputs, *(node.output for node, _ in self.nodes)])}
        self._schedule = [(kernel, [index[name] for name in node.inputs]) for node, kernel in self.nodes]
        self._outputs = [index[name] for name in outputs]

    def __call__(self, inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
        values = list(inputs)
        for kernel, arguments in self._schedule:
            values.append(kernel([values[i] for i in arguments], step))
        return [values[i] for i in self._outputs]


class CPUDevice(Device):
    info = DeviceInfo("cpu", 0, "cpu", codegen=False, description="numpy interpreter (float32)")
    deterministic = True   # its linears and attention then go a row at a time (kernels.py)
    kv_cache_types = ("f16", "q8_0", "f32")

    def __init__(self) -> None:
        # (id(source weight), transposed) -> (source, float32 array): a tensor read by several groups
        # (tied embeddings) is laid out once per layout; the source is kept so its id stays unique.
        self._host_weights: dict[tuple[int, bool], tuple[Any, np.ndarray]] = {}

    def _host_weight(self, weight: Any, transposed: bool = False) -> np.ndarray:
        key = (id(weight), transposed)
        entry = self._host_weights.get(key)
        if entry is None:
            array = np.asarray(weight.dequantize() if hasattr(weight, "dequantize") else weight, dtype=np.float32)
            entry = self._host_weights[key] = (weight, np.ascontiguousarray(array.T if transposed else array))
        return entry[1]

    def _param(self, node: Node, index: int, weight: Any) -> np.ndarray:
        """A node's weight as its kernel reads it fastest: a linear's matrix of a wide output (and
        an embedding table, which a tied output projection shares) is stored [in, out] and handed
        over as its .T view, so the kernel still sees [out, in]."""
        if node.op in ("linear", "embedding") and index == 0 and reads_transposed(tuple(weight.shape)):
            return self._host_weight(weight, transposed=True).T
        return self._host_weight(weight)

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        missing = [n.op for n in group.nodes if n.op not in KERNELS]
        if missing:
            return f"no kernel for {missing[0]}"
        nodes = []
        for node in group.nodes:
            params = [self._param(node, i, weights[name]) for i, name in enumerate(node.params)]
            nodes.append((node, KERNELS[node.op](node, params, ctx)))
        return Program(nodes, group.inputs, group.outputs)

    def can_link(self, kernel: Kernel) -> bool:
        return isinstance(kernel, Program)

    def link(self, kernels: Sequence[Kernel], inputs: Sequence[str], outputs: Sequence[str]) -> Kernel:
        return Program([entry for program in kernels for entry in program.nodes], inputs, outputs)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def to_host(self, buffer: np.ndarray) -> np.ndarray:
        # kernels reuse their output buffers every step; the caller gets its own copy
        return np.array(buffer, copy=True)

    def close(self) -> None:
        self._host_weights.clear()


class CPUBackend(Backend):
    name = "cpu"

    def devices(self) -> list[DeviceInfo]:
        return [CPUDevice.info]

    def open(self, index: int) -> Device:
        if index != 0:
            raise ValueError(f"the cpu backend has one device, cpu:0 (asked for cpu:{index})")
        return CPUDevice()


@hookimpl
def lse_backend() -> Backend:
    return CPUBackend()
