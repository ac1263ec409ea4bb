"""The OpenCL backend (pyopencl): generated kernels for fused elementwise groups, hand-written ones
for everything else, on any OpenCL device (PoCL on CPUs, GPU vendors' drivers). Importing this
module never fails: without pyopencl or a platform, ``devices()`` returns one declined entry."""

from __future__ import annotations

from typing import Any

from lse_core.devices.hookspec import Backend, Device, DeviceInfo, hookimpl

INSTALL_HINT = "install pocl-opencl-icd (CPU) or a GPU vendor's OpenCL driver"


def _kind(cl: Any, device: Any) -> str:
    if device.type & cl.device_type.GPU:
        return "gpu"
    if device.type & cl.device_type.CPU:
        return "cpu"
    return "accelerator"


class OpenCLBackend(Backend):
    name = "opencl"
    probe_in_child = True  # PoCL's LLVM, or a vendor's driver

    def __init__(self) -> None:
        self._found: list[tuple[DeviceInfo, Any]] | None = None

    def _enumerate(self) -> list[tuple[DeviceInfo, Any]]:
        """(info, pyopencl device) for every device of every platform, in platform order."""
        if self._found is not None:
            return self._found
        try:
            import pyopencl as cl
        except ImportError as e:
            reason = f"pyopencl is not installed ({e}); pip install pyopencl and {INSTALL_HINT}"
            self._found = [(DeviceInfo(self.name, 0, "gpu", True, declined=reason), None)]
            return self._found
        try:
            found = [(p, d) for p in cl.get_platforms() for d in p.get_devices()]
            if not found:
                raise RuntimeError("the platforms list no devices")
        except Exception as e:  # pyopencl raises LogicError/RuntimeError when the ICD loader finds nothing
            reason = f"no OpenCL platform: {e}; {INSTALL_HINT}"
            self._found = [(DeviceInfo(self.name, 0, "gpu", True, declined=reason), None)]
            return self._found
        self._found = [
            (DeviceInfo(self.name, i, _kind(cl, d), True, f"{d.name.strip()} ({p.name.strip()})"), d)
            for i, (p, d) in enumerate(found)
        ]
        return self._found

    def devices(self) -> list[DeviceInfo]:
        return [info for info, _ in self._enumerate()]

    def open(self, index: int) -> Device:
        found = self._enumerate()
        if not 0 <= index < len(found):
            raise ValueError(f"opencl:{index} does not exist; this machine has {len(found)} OpenCL device(s)")
        info, cl_device = found[index]
        if info.declined:
            raise RuntimeError(f"{info.name} is unavailable: {info.declined}")
        from .device import OpenCLDevice

        return OpenCLDevice(info, cl_device)


@hookimpl
def lse_backend() -> Backend:
    return OpenCLBackend()
