"""lse-hrx: the example a vendor copies to add a device to LSE.

The module is named by the ``lse.backends`` entry point in pyproject.toml; LSE loads it, calls its
``lse_backend`` hook and gets the Backend below. It imports only LSE's contract (lse_core.devices.hookspec)
and IR (lse_core.graph), never LSE's own backends.

"hrx" is a simulated accelerator: its memory and kernels are numpy, and its kernel set is
deliberately partial (no scale, and of the sampling ops only mask and sample; silu and gelu left out unless
HRX_MISSING says otherwise), so groups it cannot run go to LSE's CPU interpreter and are reported as
CPU fallback. Being a simulator, it finds devices only when asked: HRX_DEVICES=N simulates N devices;
unset or 0, it finds none and the backend declines.
"""

from __future__ import annotations

import os

from lse_core.devices.hookspec import Backend, Device, DeviceInfo, hookimpl

from .device import HrxDevice


class HrxBackend(Backend):
    name = "hrx"

    def devices(self) -> list[DeviceInfo]:
        count = int(os.environ.get("HRX_DEVICES", "0"))
        if count <= 0:  # a real plugin would ask its driver here; declining is an answer, not an error
            return [DeviceInfo("hrx", 0, "accelerator", True,
                               declined="no hrx device found (HRX_DEVICES=N simulates N devices)")]
        return [DeviceInfo("hrx", i, "accelerator", True, f"HRX simulated accelerator {i} (numpy)")
                for i in range(count)]

    def open(self, index: int) -> Device:
        for info in self.devices():
            if info.declined is not None:
                raise RuntimeError(info.declined)
            if info.index == index:
                return HrxDevice(info)
        raise RuntimeError(f"no device hrx:{index} (HRX_DEVICES={os.environ.get('HRX_DEVICES', '0')})")


@hookimpl
def lse_backend() -> Backend:
    return HrxBackend()
