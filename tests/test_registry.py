"""Backend discovery through entry points (one bad plugin never stops the others) and --pool parsing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lse_core.devices import probe
from lse_core.devices.registry import discover, parse_pool, resolve_pool
from lse_core.errors import StartupError

RAISING_PLUGIN = '''
from lse_core.devices.hookspec import hookimpl

@hookimpl
def lse_backend():
    raise RuntimeError("driver exploded")
'''


@pytest.fixture
def bad_plugins(tmp_path, monkeypatch):
    """Two installed plugins: one whose module does not import, one whose hook raises."""
    dist = tmp_path / "bad_lse_plugins-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-lse-plugins\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[lse.backends]\nbroken = lse_no_such_module_anywhere\nexploding = lse_exploding_plugin\n")
    (tmp_path / "lse_exploding_plugin.py").write_text(RAISING_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))


ODD_KIND_PLUGIN = '''
from lse_core.devices.hookspec import Backend, DeviceInfo, hookimpl


class OddBackend(Backend):
    name = "odd"

    def devices(self):
        return [DeviceInfo("odd", 0, "npu", True), DeviceInfo("odd", 1, "accelerator", True)]

    def open(self, index):
        raise AssertionError("a declined device is never opened")


@hookimpl
def lse_backend():
    return OddBackend()
'''


def test_a_device_of_a_kind_lse_does_not_know_is_declined_naming_it(tmp_path, monkeypatch):
    """A plugin's device of kind "npu": LSE's device objects say gpu, accelerator or cpu, so it does not come up,
    and asking for it fails startup with the reason; the plugin's other device is listed as given."""
    dist = tmp_path / "odd_lse_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: odd-lse-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[lse.backends]\nodd = lse_odd_kind_plugin\n")
    (tmp_path / "lse_odd_kind_plugin.py").write_text(ODD_KIND_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = discover()
    odd, fine = registry.devices("odd")
    assert "the kind 'npu', which is none of gpu, accelerator, cpu" in odd.declined
    assert (fine.kind, fine.declined) == ("accelerator", None)
    with pytest.raises(StartupError, match=r"device odd:0 did not come up: its backend gave it the kind 'npu'"):
        resolve_pool(registry, "odd:0", refuse_cpu=False)


def test_bad_plugins_are_reported_by_name_and_the_others_load(bad_plugins):
    registry = discover()
    assert set(registry.failures) == {"broken", "exploding"}
    assert "failed to import" in registry.failures["broken"]
    assert "lse_no_such_module_anywhere" in registry.failures["broken"]
    assert "driver exploded" in registry.failures["exploding"]
    assert "cpu" in registry.backends and registry.devices("cpu")[0].declined is None
    assert {"broken: ", "exploding: "} <= {line[: line.index(" ") + 1] for line in registry.declined()}


def test_pool_syntax_errors_name_the_bad_entry():
    assert parse_pool("gpu:0, opencl:1,cpu:0") == [("gpu", 0), ("opencl", 1), ("cpu", 0)]
    for text, bad in [("opencl", "opencl"), ("gpu:x", "gpu:x"), ("cuda:0,,cpu:0", ""), ("CPU:0", "CPU:0")]:
        with pytest.raises(StartupError, match=f"--pool entry '{bad}' is not <backend>:<index>"):
            parse_pool(text)
    with pytest.raises(StartupError, match="names a device twice"):
        parse_pool("cpu:0,cpu:0")


def test_unknown_backend_and_missing_gpu_fail_startup_naming_the_device(monkeypatch):
    monkeypatch.setenv("LSE_BACKENDS", "cuda")
    registry = discover()
    with pytest.raises(StartupError, match=r"device tpu:0 did not come up: no backend named 'tpu'"):
        resolve_pool(registry, "tpu:0", refuse_cpu=False)
    with pytest.raises(StartupError, match=r"device gpu:0 did not come up: 0 GPU\(s\) found; cuda: "):
        resolve_pool(registry, "gpu:0", refuse_cpu=False)
    with pytest.raises(StartupError, match=r"device cuda:0 did not come up: "):
        resolve_pool(registry, "cuda:0", refuse_cpu=False)


def test_default_pool_prefers_compiled_cpu_kernels_over_an_opencl_cpu_driver():
    registry = discover()
    up = {d.name for d in registry.all_devices() if d.declined is None}
    assert {"jit:0", "opencl:0", "cpu:0"} <= up, "this test needs numba and PoCL"
    chosen, warnings = resolve_pool(registry, None, refuse_cpu=True)
    assert [d.name for d in chosen] == ["jit:0"] and warnings == []
    several, _ = resolve_pool(registry, "opencl:0,jit:0", refuse_cpu=True)
    assert [d.name for d in several] == ["opencl:0", "jit:0"]


LIST_DEVICES = """
import json, sys
from lse_core.devices.registry import discover
registry = discover()
infos = [[d.name, d.kind, d.declined] for d in registry.all_devices()]
print(json.dumps({"infos": infos, "loaded": sorted({"pyopencl", "cupy"} & set(sys.modules))}))
"""


def test_opencl_and_cuda_devices_are_listed_by_a_child_so_no_driver_is_loaded_here():
    """Their drivers stay mapped once loaded (PoCL's LLVM, CuPy): an engine that opens neither must
    not carry them. The child's listing is the backend's own."""
    from lse_backends.opencl import OpenCLBackend

    run = subprocess.run([sys.executable, "-c", LIST_DEVICES], capture_output=True, text=True, check=True)
    listed = json.loads(run.stdout)
    assert listed["loaded"] == []
    opencl = [info for info in listed["infos"] if info[0].startswith("opencl:")]
    assert opencl == [[d.name, d.kind, d.declined] for d in OpenCLBackend().devices()]
    assert [info[0] for info in listed["infos"] if info[0].startswith("cuda:")] == ["cuda:0"]  # up or declined


def test_a_listing_child_that_crashes_or_hangs_declines_the_backend(monkeypatch):
    """The registry records the child's failure as it does a devices() that raises: one declined entry."""
    registry = discover()
    for started in registry._probes.values():  # the real listings, replaced below by failing ones
        started.communicate()
    registry._probes["opencl"] = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('driver segfaulted')"],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (info,) = registry.devices("opencl")
    assert info.name == "opencl:0" and info.declined == "listing its devices failed: driver segfaulted"
    monkeypatch.setattr(probe, "TIMEOUT_S", 0.5)
    hung = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    registry._probes["cuda"] = hung
    (info,) = registry.devices("cuda")
    assert info.declined == "listing its devices took over 0.5 s" and hung.returncode is not None
    assert {"opencl: listing its devices failed: driver segfaulted",
            "cuda: listing its devices took over 0.5 s"} <= set(registry.declined())
