"""The backend contract. A backend is a module registered under the entry-point group
``lse.backends`` whose ``lse_backend`` hook returns a ``Backend``. Built-in backends
(lse_backends.*) and third-party plugins register the same way.

A backend lists its devices, each up or declined with a reason. An open ``Device`` compiles a
fused group into a ``Kernel`` (or answers why it cannot, e.g. ``"no kernel for silu"``), moves
arrays between the host and itself, and synchronizes. Weights are handed to ``compile`` and
uploaded then, once. A kernel takes the group's input buffers (in ``group.inputs`` order, already
on this device) and the host-side ``Step``, and returns its output buffers (``group.outputs``
order) on this device. A device may also link kernels of consecutive groups into one kernel (one
call per step instead of one per group); the planner asks it for every run of its kernels.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pluggy

from lse_core.config import KV_CACHE_TYPES  # noqa: F401  (the contract names them; defined with the options)
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.ir import Step

hookspec = pluggy.HookspecMarker("lse")
hookimpl = pluggy.HookimplMarker("lse")

Kernel = Callable[[Sequence[Any], Step], list[Any]]


@dataclass(frozen=True)
class DeviceInfo:
    backend: str                  # "opencl"
    index: int                    # 0
    kind: str                     # "gpu", "cpu" or "accelerator"
    codegen: bool                 # has a device code generator for fused groups
    description: str = ""         # e.g. "pthread-AMD EPYC (PoCL 5.0)"
    declined: str | None = None   # why the device did not come up; None when it is up

    @property
    def name(self) -> str:
        return f"{self.backend}:{self.index}"


@dataclass(frozen=True)
class CompileContext:
    kv_slots: int      # sequences held at once (KV-cache slots)
    kv_len: int        # positions per slot (the context length)
    max_tokens: int    # most rows (tokens) in one step
    # every row computed by the same arithmetic whatever else the step holds (its row count, the other
    # sequences, where a prefill chunk starts): only devices whose ``deterministic`` is True are given it
    deterministic: bool = False
    # what an attention kernel's KV cache stores keys and values as (one of KV_CACHE_TYPES, always one of the
    # device's ``kv_cache_types``: see ``on``)
    cache_type_k: str = "f32"
    cache_type_v: str = "f32"
    # the GGUF types of the model's weights (set by Plan.build): a device may compile its kernels for these alone
    weight_types: frozenset[str] = frozenset()

    def on(self, device: Device) -> CompileContext:
        """The context ``device`` compiles with: a cache type it lacks becomes f32, which every device stores
        (lse_open refuses a type asked for by name that a device lacks, and reports every such change)."""
        k, v = (t if t in device.kv_cache_types else "f32" for t in (self.cache_type_k, self.cache_type_v))
        return replace(self, cache_type_k=k, cache_type_v=v)


class Device(ABC):
    info: DeviceInfo
    # whether its kernels honour CompileContext.deterministic (lse_open refuses the mode otherwise)
    deterministic: bool = False
    # the KV_CACHE_TYPES its attention kernels store (CompileContext.cache_type_k/_v); f32 at least
    kv_cache_types: tuple[str, ...] = ("f32",)

    @abstractmethod
    def compile(self, group: FusedGroup, weights: Mapping[str, Any], ctx: CompileContext) -> Kernel | str:
        """A kernel for the group, or the reason there is none (``"no kernel for silu"``)."""

    @abstractmethod
    def to_device(self, array: np.ndarray) -> Any: ...

    @abstractmethod
    def to_host(self, buffer: Any) -> np.ndarray: ...

    def can_link(self, kernel: Kernel) -> bool:
        """Whether ``link`` takes this kernel (one this device compiled)."""
        return False

    def link(self, kernels: Sequence[Kernel], inputs: Sequence[str], outputs: Sequence[str]) -> Kernel:
        """One kernel running ``kernels`` (of consecutive groups) in order: it takes the values named
        ``inputs`` (read by the groups, produced before them) and returns those named ``outputs``
        (produced by the groups, read after them)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued work; kernels may run asynchronously until ``to_host``."""

    def close(self) -> None:
        """Release the device's memory."""


class Backend(ABC):
    name: str
    # listing devices loads libraries that stay mapped (drivers, their compilers): the registry lists
    # them from a child process, so only a device the engine opens costs memory (probe.py)
    probe_in_child: bool = False

    @abstractmethod
    def devices(self) -> list[DeviceInfo]:
        """Every device this backend sees, up or declined; an unusable backend returns one
        declined entry saying why (no driver, no GPU, library missing)."""

    @abstractmethod
    def open(self, index: int) -> Device: ...


class BackendSpec:
    @hookspec
    def lse_backend(self) -> Backend:
        """Return this plugin's backend."""
