"""Backend discovery through the ``lse.backends`` entry points, --pool parsing and opening the pool.

pluggy's load_setuptools_entrypoints stops at the first plugin that fails, and a hook call stops at
the first implementation that raises; so each entry point is loaded, registered and called on its
own, and a failure is recorded under the plugin's name while the others load."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import subprocess
from dataclasses import dataclass, field, replace

import pluggy

from lse_core.devices import probe
from lse_core.devices.hookspec import Backend, BackendSpec, Device, DeviceInfo
from lse_core.errors import StartupError

log = logging.getLogger("lse")

INTERPRETER = "cpu"   # the numpy interpreter: the fallback, never a device backend
KIND_ORDER = {"gpu": 0, "accelerator": 1, "cpu": 2}
# Among CPU-kind devices, compiled kernels before an OpenCL CPU driver.
CPU_BACKEND_ORDER = {"jit": 0, "opencl": 1}
_POOL_ENTRY = re.compile(r"^([a-z][a-z0-9_\-]*):(\d+)$")


@dataclass
class Registry:
    backends: dict[str, Backend] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)      # plugin name -> why it failed
    _infos: dict[str, list[DeviceInfo]] = field(default_factory=dict)
    _probes: dict[str, subprocess.Popen] = field(default_factory=dict)  # listings running in children

    def devices(self, backend: str) -> list[DeviceInfo]:
        """The backend's devices, probed once (here or by its child; one that fails is recorded as declined)."""
        if backend not in self._infos:
            child = self._probes.pop(backend, None)
            try:
                self._infos[backend] = probe.result(child) if child else list(self.backends[backend].devices())
            except Exception as e:  # a plugin's bug, or its driver's crash in the child, must not stop the engine
                reason = str(e) if isinstance(e, probe.ProbeFailed) else f"devices() raised: {e!r}"
                self._infos[backend] = [DeviceInfo(backend, 0, "cpu", False, declined=reason)]
            self._infos[backend] = [_checked_kind(info) for info in self._infos[backend]]
        return self._infos[backend]

    def all_devices(self) -> list[DeviceInfo]:
        return [d for name in self.backends for d in self.devices(name)]

    def declined(self) -> list[str]:
        """'backend: reason' for every device backend that brought no device up, and every failed plugin."""
        out = [f"{name}: {reason}" for name, reason in self.failures.items()]
        for name in self.backends:
            if name == INTERPRETER:
                continue
            infos = self.devices(name)
            if not any(d.declined is None for d in infos):
                reasons = "; ".join(dict.fromkeys(d.declined or "" for d in infos)) or "no devices"
                out.append(f"{name}: {reasons}")
        return out


def _checked_kind(info: DeviceInfo) -> DeviceInfo:
    """The device as listed, or declined when its kind is none that LSE ranks and reports (a plugin's bug:
    the API's device objects say gpu, accelerator or cpu)."""
    if info.kind in KIND_ORDER or info.declined is not None:
        return info
    return replace(info, kind="accelerator", declined=f"its backend gave it the kind {info.kind!r}, which is "
                                                      f"none of {', '.join(KIND_ORDER)}")


def discover(group: str = "lse.backends", children: bool = True) -> Registry:
    """Load every backend plugin, or only those LSE_BACKENDS names (comma-separated), as vLLM's
    VLLM_PLUGINS does; the CPU interpreter always loads, being the fallback. ``children``: start
    listing the devices of backends that ``probe_in_child`` (False in that child)."""
    registry = Registry()
    pm = pluggy.PluginManager("lse")
    pm.add_hookspecs(BackendSpec)
    wanted = os.environ.get("LSE_BACKENDS")
    allowed = None if wanted is None else {n.strip() for n in wanted.split(",")} | {INTERPRETER}
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in registry.backends or ep.name in registry.failures:
            continue
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            module = ep.load()
            pm.register(module, name=ep.name)
        except Exception as e:
            registry.failures[ep.name] = f"failed to import: {e!r}"
            continue
        for impl in pm.hook.lse_backend.get_hookimpls():
            if impl.plugin_name != ep.name:
                continue
            try:
                backend = impl.function()
            except Exception as e:
                registry.failures[ep.name] = f"lse_backend() raised: {e!r}"
                continue
            registry.backends[backend.name] = backend
            if children and backend.probe_in_child:  # started now: the children list devices while this process goes on
                try:
                    registry._probes[backend.name] = probe.start(group, backend.name)
                except OSError as e:  # no interpreter to start: list them here
                    log.warning("lse: listing %s devices in this process: %s", backend.name, e)
    for name, reason in registry.failures.items():
        log.warning("lse: backend plugin %s did not load: %s", name, reason)
    return registry


def parse_pool(text: str) -> list[tuple[str, int]]:
    """``"gpu:0,opencl:1"`` -> [("gpu", 0), ("opencl", 1)]; errors name the bad entry."""
    entries = []
    for raw in text.split(","):
        entry = raw.strip()
        m = _POOL_ENTRY.match(entry)
        if not m:
            raise StartupError(f"--pool entry {entry!r} is not <backend>:<index> (e.g. gpu:0, opencl:0, cpu:0)")
        entries.append((m.group(1), int(m.group(2))))
    if not entries:
        raise StartupError("--pool is empty")
    if len(set(entries)) != len(entries):
        raise StartupError(f"--pool names a device twice: {text!r}")
    return entries


def _ranked(infos: list[DeviceInfo]) -> list[DeviceInfo]:
    return sorted(infos, key=lambda d: (KIND_ORDER.get(d.kind, 3), CPU_BACKEND_ORDER.get(d.backend, 2)))


def resolve_pool(registry: Registry, pool: str | None, refuse_cpu: bool) -> tuple[list[DeviceInfo], list[str]]:
    """The devices to open, in pool order, and startup warnings; StartupError per the spec's table."""
    if pool is None:
        up = [d for d in registry.all_devices() if d.declined is None and d.backend != INTERPRETER and d.codegen]
        gpus = [d for d in up if d.kind == "gpu"]
        chosen = gpus or _ranked(up)[:1]
        if chosen:
            return chosen, []
        declined = registry.declined()
        if refuse_cpu:
            raise StartupError("no device backend came up and CPU fallback is disabled (--no-cpu-fallback): "
                               + "; ".join(declined))
        return [_interpreter(registry)], ["no device backend came up, running on the CPU interpreter: "
                                          + "; ".join(declined)]
    chosen = []
    for backend, index in parse_pool(pool):
        info = _find(registry, backend, index)
        if not info.codegen and refuse_cpu:
            raise StartupError(f"device {info.name} is refused: it has no device code generator and CPU "
                               "fallback is disabled (--no-cpu-fallback)")
        chosen.append(info)
    return chosen, []


def _find(registry: Registry, backend: str, index: int) -> DeviceInfo:
    if backend == "gpu":
        gpus = [d for d in _ranked(registry.all_devices()) if d.kind == "gpu" and d.declined is None]
        if index >= len(gpus):
            raise StartupError(f"device gpu:{index} did not come up: {len(gpus)} GPU(s) found; "
                               + "; ".join(registry.declined()))
        return gpus[index]
    if backend not in registry.backends:
        why = registry.failures.get(backend)
        known = ", ".join(["gpu", *registry.backends])
        raise StartupError(f"device {backend}:{index} did not come up: "
                           + (f"backend {backend} failed to load: {why}" if why else
                              f"no backend named {backend!r} (known: {known})"))
    for info in registry.devices(backend):
        if info.index == index:
            if info.declined is not None:
                raise StartupError(f"device {info.name} did not come up: {info.declined}")
            return info
    declined = "; ".join(d.declined for d in registry.devices(backend) if d.declined) or "no such device"
    raise StartupError(f"device {backend}:{index} did not come up: {declined}")


def _interpreter(registry: Registry) -> DeviceInfo:
    if INTERPRETER not in registry.backends:
        raise StartupError("the CPU interpreter backend (lse_backends.cpu) is not installed: "
                           + registry.failures.get(INTERPRETER, "entry point missing"))
    return registry.devices(INTERPRETER)[0]


def open_devices(registry: Registry, infos: list[DeviceInfo]) -> list[Device]:
    devices = []
    for info in infos:
        try:
            devices.append(registry.backends[info.backend].open(info.index))
        except Exception as e:
            raise StartupError(f"device {info.name} did not come up: {e}") from e
    return devices


def open_interpreter(registry: Registry) -> Device:
    info = _interpreter(registry)
    return registry.backends[INTERPRETER].open(info.index)
