"""The CUDA backend, through CuPy: NVRTC-compiled kernels (generated for fused elementwise groups,
hand-written for the rest), cuBLAS for linear. CuPy is an optional dependency (``lse[cuda]``) and
imports without a GPU, so both its absence and a machine without a usable GPU are a declined device,
never an import error."""

from __future__ import annotations

import importlib.util

from lse_core.devices.hookspec import Backend, Device, DeviceInfo, hookimpl


def _declined(reason: str) -> list[DeviceInfo]:
    return [DeviceInfo("cuda", 0, "gpu", True, declined=reason)]


class CUDABackend(Backend):
    name = "cuda"
    probe_in_child = True  # CuPy and the CUDA runtime

    def devices(self) -> list[DeviceInfo]:
        if importlib.util.find_spec("cupy") is None:
            return _declined("cupy is not installed (pip install lse[cuda])")
        try:
            import cupy
        except Exception as e:  # a broken CuPy install (mismatched CUDA libraries) is a reason, not a crash
            return _declined(f"cupy failed to import: {e!r}")
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except cupy.cuda.runtime.CUDARuntimeError as e:
            return _declined(f"CUDA is not usable: {e}")
        if count == 0:
            return _declined("no CUDA GPU found")
        try:
            cupy.cuda.nvrtc.getVersion()
        except Exception as e:
            return _declined(f"NVRTC (the CUDA runtime compiler) is not available: {e} (pip install cupy-cuda12x[ctk])")
        infos = []
        for index in range(count):
            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            gib = props["totalGlobalMem"] / 2**30
            infos.append(DeviceInfo("cuda", index, "gpu", True,
                                    f"{name} (sm_{props['major']}{props['minor']}, {gib:.0f} GiB)"))
        return infos

    def open(self, index: int) -> Device:
        from .device import CUDADevice

        for info in self.devices():
            if info.index == index and info.declined is None:
                return CUDADevice(info)
            if info.declined is not None:
                raise RuntimeError(info.declined)
        raise RuntimeError(f"no CUDA device {index}")


@hookimpl
def lse_backend() -> Backend:
    return CUDABackend()
