"""The fused-group C generator: OpenCL kernels run on PoCL against numpy; CUDA source compiles with nvcc."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pyopencl as cl
import pytest

from lse_backends.cgen import elementwise_kernel, unsupported_op
from lse_core.graph.fuse import fuse
from lse_core.graph.ir import Graph, Node


def swiglu_graph() -> Graph:
    """gate, up -> silu(gate) * up, plus a scaled residual and a gelu branch read later."""
    nodes = [
        Node("linear", ("x",), "gate", ("w",)),
        Node("silu", ("gate",), "act"),
        Node("mul", ("act", "up"), "h"),
        Node("scale", ("h",), "hs", attrs={"factor": 0.125}),
        Node("add", ("hs", "resid"), "out"),
        Node("gelu", ("out",), "g"),
        Node("linear", ("out",), "y", ("w",)),
        Node("linear", ("g",), "logits", ("w",)),
    ]
    return Graph(nodes, {"w": np.zeros((1, 1), np.float32)})


def numpy_reference(gate, up, resid):
    act = gate / (1 + np.exp(-gate))
    out = act * up * np.float32(0.125) + resid
    g = 0.5 * out * (1 + np.tanh(np.sqrt(2 / np.pi) * (out + 0.044715 * out**3)))
    return out, g


def test_group_arguments_and_unsupported_ops():
    groups = fuse(swiglu_graph())
    fused = groups[1]
    assert fused.ops == ("silu", "mul", "scale", "add", "gelu")
    ks = elementwise_kernel(fused, "opencl", "g1")
    assert ks.inputs == ("gate", "up", "resid") and ks.outputs == ("out", "g")
    assert unsupported_op(groups[0]) == "linear"
    with pytest.raises(ValueError, match="no kernel for linear"):
        elementwise_kernel(groups[0], "opencl", "g0")


@pytest.mark.parametrize("shape", [(1, 1), (3, 577), (17, 1536)])
def test_opencl_kernel_matches_numpy(shape):
    fused = fuse(swiglu_graph())[1]
    ks = elementwise_kernel(fused, "opencl", "fused")
    ctx = cl.Context(cl.get_platforms()[0].get_devices())
    queue = cl.CommandQueue(ctx)
    kernel = cl.Program(ctx, ks.source).build().fused
    rng = np.random.default_rng(sum(shape))
    host = {v: rng.standard_normal(shape).astype(np.float32) * 4 for v in ks.inputs}
    mf = cl.mem_flags
    ins = [cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=host[v]) for v in ks.inputs]
    outs = [cl.Buffer(ctx, mf.WRITE_ONLY, host["gate"].nbytes) for _ in ks.outputs]
    n = host["gate"].size
    kernel(queue, (-(-n // 64) * 64,), None, *outs, *ins, np.int32(n))
    got = [np.empty(shape, np.float32) for _ in outs]
    for h, b in zip(got, outs, strict=True):
        cl.enqueue_copy(queue, h, b)
    want = numpy_reference(host["gate"], host["up"], host["resid"])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_source_compiles(tmp_path):
    ks = elementwise_kernel(fuse(swiglu_graph())[1], "cuda", "fused")
    src = tmp_path / "fused.cu"
    src.write_text(ks.source)
    result = subprocess.run(["nvcc", "--ptx", "-arch=sm_80", str(src), "-o", str(tmp_path / "fused.ptx")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert ".entry fused" in (tmp_path / "fused.ptx").read_text()
