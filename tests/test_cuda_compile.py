"""The CUDA backend without a GPU: every kernel source it would hand NVRTC compiles with nvcc for
sm_80, every launch the device makes while running whole models matches its kernel's C signature,
the backend declines with the real reason, and it registers through the hookspec. The kernels
themselves run in tests/cuda (benchmarks/cuda_check.sh, on a GPU machine)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import numpy as np
import pluggy
import pytest
from checkpoints import make_step, prompt_ids

import lse_backends.cuda as cuda_backend
from lse_backends.cuda.kernels import KERNEL_NAMES, QUANT_KINDS, SOURCE, STEP_ARRAYS, elementwise_source
from lse_core.devices.hookspec import BackendSpec, CompileContext, DeviceInfo
from lse_core.graph.fuse import fuse
from lse_core.graph.ir import ELEMENTWISE_OPS, PENALTY_WINDOW, Graph, Node, SamplingBatch
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.model import QUANT_BLOCKS, QuantTensor

ROOT = Path(__file__).resolve().parents[1]


NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def ptx_entries(source: str, tmp_path: Path) -> set[str]:
    """The kernels nvcc emits for ``source`` as sm_80 PTX (what cupy.cuda.compiler.compile_using_nvcc
    runs; called directly so that this test needs nvcc, not CuPy)."""
    (tmp_path / "kernel.cu").write_text(source)
    result = subprocess.run([NVCC, "--ptx", "-arch=compute_80", "-std=c++17", "kernel.cu", "-o", "kernel.ptx"],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"\.entry\s+(\w+)", (tmp_path / "kernel.ptx").read_text()))


def test_hand_kernels_compile(tmp_path):
    assert ptx_entries(SOURCE, tmp_path) == set(KERNEL_NAMES)


def test_quantized_kernels_read_the_gguf_block_sizes():
    for qtype, (suffix, _, block_bytes) in QUANT_KINDS.items():
        assert QUANT_BLOCKS[qtype] == (block_bytes, 32)
        assert {f"gemv_{suffix}", f"dequantize_rows_{suffix}"} <= set(KERNEL_NAMES)


def elementwise_groups(graph: Graph):
    return [g for g in fuse(graph) if all(op in ELEMENTWISE_OPS for op in g.ops)]


def mixed_graph() -> Graph:
    """Elementwise runs the shipped architectures don't have: gelu, scale, two outputs, three inputs."""
    nodes = [
        Node("linear", ("x",), "gate", ("w",)),
        Node("gelu", ("gate",), "act"),
        Node("mul", ("act", "up"), "h"),
        Node("scale", ("h",), "hs", attrs={"factor": 0.125}),
        Node("add", ("hs", "resid"), "out"),
        Node("silu", ("out",), "s"),
        Node("linear", ("out",), "y", ("w",)),
        Node("linear", ("s",), "logits", ("w",)),
    ]
    return Graph(nodes, {"w": np.zeros((1, 1), np.float32)})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generated_kernels_of_real_architectures_compile(tiny_checkpoint, arch, tmp_path):
    groups = elementwise_groups(build_graph(load_hf(str(tiny_checkpoint(arch)))))
    assert {g.ops for g in groups} == {("add",), ("silu", "mul")}
    # every layer's residual adds and swiglu share their source, so the model compiles two kernels
    sources = {elementwise_source(g).source for g in groups}
    assert len(groups) > 2 and len(sources) == 2
    for source in sources:
        assert ptx_entries(source, tmp_path) == {"fused"}


def test_generated_kernel_with_several_inputs_and_outputs_compiles(tmp_path):
    (group,) = [g for g in elementwise_groups(mixed_graph()) if len(g.nodes) > 1]
    assert group.ops == ("gelu", "mul", "scale", "add", "silu")
    generated = elementwise_source(group)
    assert generated.inputs == ("gate", "up", "resid") and generated.outputs == ("out", "s")
    assert ptx_entries(generated.source, tmp_path) == {"fused"}


def test_declines_with_the_real_reason_on_this_machine():
    """CI installs LSE without the cuda extra; a developer machine may have CuPy but no GPU."""
    infos = cuda_backend.lse_backend().devices()
    if importlib.util.find_spec("cupy") is None:
        (info,) = infos
        assert info.declined == "cupy is not installed (pip install lse[cuda])"
        return
    import cupy

    if cupy.is_available():   # a GPU machine: every device is up and described
        assert all(d.declined is None and d.kind == "gpu" and d.codegen and d.description for d in infos)
        return
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError) as raised:
        cupy.cuda.runtime.getDeviceCount()
    (info,) = infos
    assert (info.name, info.kind, info.codegen) == ("cuda:0", "gpu", True)
    assert info.declined == f"CUDA is not usable: {raised.value}"
    with pytest.raises(RuntimeError, match="CUDA is not usable"):
        cuda_backend.lse_backend().open(0)


def test_declines_when_cupy_is_not_installed(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "cupy" else real_find_spec(name, *args))
    (info,) = cuda_backend.lse_backend().devices()
    assert info.declined == "cupy is not installed (pip install lse[cuda])"


def test_registers_through_the_hookspec_and_entry_point():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["lse.backends"]
    assert declared["cuda"] == "lse_backends.cuda"
    pm = pluggy.PluginManager("lse")
    pm.add_hookspecs(BackendSpec)
    pm.register(cuda_backend, name="cuda")
    (backend,) = pm.hook.lse_backend()
    assert backend.name == "cuda"


def test_step_arrays_map_every_token_to_its_sequence_slot():
    step = make_step([(2, [5, 6, 7], 0), (0, [9], 4), (3, [1, 2], 10)])
    assert STEP_ARRAYS["token_slots"](step).tolist() == [2, 2, 2, 0, 3, 3]
    assert STEP_ARRAYS["positions"](step).tolist() == [0, 1, 2, 4, 10, 11]
    assert STEP_ARRAYS["sample_rows"](step).tolist() == [2, 3, 5]


def test_step_arrays_say_which_rows_each_sampling_op_applies_to():
    sampling = SamplingBatch(
        temperature=np.array([0.0, 0.7, 1.0], np.float32), top_k=np.array([40, 40, 0], np.int32),
        top_p=np.array([0.9, 1.0, 0.5], np.float32), min_p=np.zeros(3, np.float32),
        repetition_penalty=np.array([1.0, 1.1, 1.0], np.float32), presence_penalty=np.zeros(3, np.float32),
        recent=np.full((3, 64), -1, np.int32), uniform=np.zeros(3, np.float32))
    step = make_step([(0, [1], 0), (1, [1], 0), (2, [1], 0)], sampling)
    # greedy rows never truncate; temperature 1 divides by nothing; top_k 0 and top_p 1 are off
    assert STEP_ARRAYS["needed.temperature"](step).tolist() == [0, 1, 0]
    assert STEP_ARRAYS["needed.top_k"](step).tolist() == [0, 1, 0]
    assert STEP_ARRAYS["needed.top_p"](step).tolist() == [0, 0, 1]
    assert STEP_ARRAYS["needed.penalize"](step).tolist() == [0, 1, 0]
    assert STEP_ARRAYS["needed.sample"](step).tolist() == [1, 1, 1]


# --- every launch against its kernel's C signature, with CuPy replaced by a recording stand-in -------

POINTEE = {"float*": np.float32, "int*": np.int32, "unsigned char*": np.uint8}


@functools.cache
def c_signatures(source: str) -> dict[str, list[str]]:
    """Each kernel's parameter types, read after the C preprocessor (macros define some kernels)."""
    expanded = subprocess.run(["cpp", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True,
                              check=True).stdout
    kernels = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', expanded)
    qualifiers = re.compile(r"\b(const|__restrict__)\b")
    return {name: [" ".join(qualifiers.sub("", p).split()[:-1]) for p in params.split(",")]
            for name, params in kernels}


class CheckedKernel:
    """A compiled kernel's stand-in: checks each launch's arguments against the C parameter types."""

    def __init__(self, name: str, params: list[str], launches: list[str]) -> None:
        self.name, self.params, self.launches = name, params, launches

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments for {self.params}"
        for i, (param, arg) in enumerate(zip(self.params, args, strict=True)):
            where = f"{self.name} argument {i} ({param})"
            if param in POINTEE:
                assert isinstance(arg, np.ndarray) and arg.dtype == POINTEE[param], f"{where}: {arg!r:.80}"
                assert arg.flags.c_contiguous, f"{where} is not contiguous"
            else:
                assert type(arg) is {"int": np.int32, "float": np.float32}[param], f"{where}: {type(arg)}"
        assert all(type(n) is int and n >= 1 for n in (*grid, *block)), (self.name, grid, block)
        assert int(np.prod(block)) <= 1024, (self.name, block)
        self.launches.append(self.name)


class FakeGPU:
    def __init__(self, index: int) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *exc: object) -> None: ...
    def synchronize(self) -> None: ...


def recording_cupy(launches: list[str]) -> types.ModuleType:
    """CuPy as numpy, where kernels check their arguments instead of running: outputs stay zero."""
    cupy = types.ModuleType("cupy")
    for name in ("float32", "int32", "ndarray", "arange", "asarray", "zeros", "zeros_like"):
        setattr(cupy, name, getattr(np, name))
    cupy.empty, cupy.empty_like, cupy.asnumpy = np.zeros, np.zeros_like, np.asarray
    cupy.RawModule = lambda code, options: types.SimpleNamespace(
        get_function=lambda name: CheckedKernel(name, c_signatures(code)[name], launches))
    cupy.cuda = types.SimpleNamespace(Device=FakeGPU)
    cupy.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return cupy


def quantized(model, matrix_type: str):
    """The model with its 2-D weights in GGUF blocks: the embedding (tied head) Q8_0, the rest matrix_type."""
    from gguf import GGMLQuantizationType, quants

    def block(name: str, w: np.ndarray):
        if w.ndim != 2:
            return w
        qtype = "Q8_0" if "embed" in name else matrix_type
        return QuantTensor(qtype, quants.quantize(w, GGMLQuantizationType[qtype]), w.shape)

    model.weights = {name: block(name, w) for name, w in model.weights.items()}
    return model


def test_every_launch_matches_its_kernels_c_signature(monkeypatch, tiny_checkpoint):
    launches: list[str] = []
    monkeypatch.setitem(sys.modules, "cupy", recording_cupy(launches))
    monkeypatch.setitem(sys.modules, "lse_backends.cuda.device", None)   # undone after the test
    del sys.modules["lse_backends.cuda.device"]
    monkeypatch.setattr(cuda_backend, "device", None, raising=False)
    device = importlib.import_module("lse_backends.cuda.device").CUDADevice(DeviceInfo("cuda", 0, "gpu", True))
    sampling = SamplingBatch(
        temperature=np.array([0.7, 0.0], np.float32), top_k=np.array([20, 0], np.int32),
        top_p=np.array([0.9, 1.0], np.float32), min_p=np.array([0.05, 0.0], np.float32),
        repetition_penalty=np.array([1.1, 1.0], np.float32), presence_penalty=np.array([0.5, 0.0], np.float32),
        recent=np.full((2, PENALTY_WINDOW), 3, np.int32), uniform=np.array([0.5, 0.5], np.float32))
    ctx = CompileContext(kv_slots=4, kv_len=64, max_tokens=32)
    models = [("llama", None), ("qwen3", None), ("llama", "Q4_0"), ("llama", "Q4_1")]
    for arch, matrix_type in models:
        model = load_hf(str(tiny_checkpoint(arch)))
        if matrix_type:
            model = quantized(model, matrix_type)
        plan = Plan.build(build_graph(model), [device], ctx, fallback_device=None, allow_fallback=False)
        prompt = prompt_ids(tiny_checkpoint(arch))
        sampling.constrained = np.array([True, False])   # structured output on the first row
        sampling.token_mask = np.full((2, -(-model.config["vocab_size"] // 32)), -1, np.int32)
        plan.run(make_step([(1, prompt, 0)]), want_logits=True)                        # a long prefill: cuBLAS
        plan.run(make_step([(1, [5], len(prompt)), (2, [1, 2, 3], 0)], sampling))   # decode: the GEMV
    assert set(launches) == {*KERNEL_NAMES, "fused"}
