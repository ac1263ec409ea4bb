"""The numpy CPU interpreter: runs every op of the IR in float32. It is the reference the other
backends are tested against and the device that runs a group no pool device can (CPU fallback).
It has no device code generator: a fused group runs node by node."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lse_core.devices.hookspec import Backend, CompileContext, Device, DeviceInfo, Kernel, hookimpl
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Step

from .kernels import MODEL_KERNELS
from .sampling import SAMPLING_KERNELS

KERNELS = {**MODEL_KERNELS, **SAMPLING_KERNELS}


class CPUDevice(Device):
    info = DeviceInfo("cpu", 0, "cpu", codegen=False, description="numpy interpreter (float32)")

    def __init__(self) -> None:
        # id(source weight) -> (source, float32 array): a tensor read by several groups (tied
        # embeddings) is laid out once; the source is kept so its id stays unique.
        self._host_weights: dict[int, tuple[Any, np.ndarray]] = {}

    def _host_weight(self, weight: Any) -> np.ndarray:
        entry = self._host_weights.get(id(weight))
        if entry is None:
            array = weight.dequantize() if hasattr(weight, "dequantize") else weight
            entry = self._host_weights[id(weight)] = (weight, np.ascontiguousarray(array, dtype=np.float32))
        return entry[1]

    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        missing = [n.op for n in group.nodes if n.op not in KERNELS]
        if missing:
            return f"no kernel for {missing[0]}"
        steps = [(node, KERNELS[node.op](node, [self._host_weight(weights[p]) for p in node.params], ctx))
                 for node in group.nodes]

        def run(inputs: Sequence[np.ndarray], step: Step) -> list[np.ndarray]:
            values = dict(zip(group.inputs, inputs, strict=True))
            for node, kernel in steps:
                values[node.output] = kernel([values[name] for name in node.inputs], step)
            return [values[name] for name in group.outputs]

        return run

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
