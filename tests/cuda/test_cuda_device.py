"""The CUDA device on a real GPU, against the numpy CPU interpreter (the reference every backend is held
to): each kernel on its own, then whole tiny models through the plan. Collected only with
LSE_RUN_CUDA=1 (tests/cuda/conftest.py); benchmarks/cuda_check.sh runs them on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
from checkpoints import cpu_plan, greedy_sampling, make_step, prompt_ids
from gguf import GGMLQuantizationType, quants
from test_cuda_compile import quantized

import lse_backends.cuda as cuda_backend
from lse_backends.cpu import CPUDevice
from lse_core.devices.hookspec import CompileContext
from lse_core.graph import ir
from lse_core.graph.fuse import FusedGroup, fuse
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.model import QuantTensor

pytestmark = pytest.mark.cuda

CTX = CompileContext(kv_slots=4, kv_len=128, max_tokens=64)


@pytest.fixture(scope="module")
def gpu():
    device = cuda_backend.lse_backend().open(0)
    yield device
    device.close()


def node_group(node: ir.Node) -> FusedGroup:
    return FusedGroup(0, (node,), node.inputs, (node.output,), node.params)


def run_both(gpu, group: FusedGroup, weights: dict, inputs: list[np.ndarray], steps: list[ir.Step]):
    """The group's outputs for each step on the GPU and on the interpreter (each compiled once, so a
    KV cache carries over from step to step)."""
    results = []
    for device in (gpu, CPUDevice()):
        kernel = device.compile(group, weights, CTX)
        assert not isinstance(kernel, str), kernel
        per_step = []
        for step in steps:
            outs = kernel([device.to_device(np.ascontiguousarray(x)) for x in inputs], step)
            per_step.append([device.to_host(o) for o in outs])
        results.append(per_step)
    return results


def assert_same(gpu, node: ir.Node, weights: dict, inputs: list[np.ndarray], step: ir.Step, tol: float = 1e-5):
    ((got,),), ((want,),) = run_both(gpu, node_group(node), weights, inputs, [step])
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=node.op)
    return got


rng = np.random.default_rng(0)


def randn(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_the_device_is_up_and_described():
    (info, *_) = cuda_backend.lse_backend().devices()
    assert info.declined is None and info.kind == "gpu" and info.codegen and "sm_" in info.description


@pytest.mark.parametrize("scale", [1.0, 24.0 ** 0.5])
def test_embedding(gpu, scale):
    step = make_step([(0, [3, 1, 4], 0), (1, [0, 9], 7)])
    assert_same(gpu, ir.Node("embedding", (), "e", ("t",), {"scale": scale}), {"t": randn(10, 24)}, [], step)
    quant = QuantTensor("Q8_0", quants.quantize(randn(10, 64), GGMLQuantizationType.Q8_0), (10, 64))
    assert_same(gpu, ir.Node("embedding", (), "e", ("t",), {"scale": scale}), {"t": quant}, [], step)


@pytest.mark.parametrize("width,group", [(576, 576), (256, 64), (8192, 8192)])
def test_rms_norm(gpu, width, group):
    step = make_step([(0, list(range(5)), 0)])
    node = ir.Node("rms_norm", ("x",), "y", ("w",), {"eps": 1e-6, "group": group})
    assert_same(gpu, node, {"w": randn(group)}, [randn(5, width) * 3], step, tol=1e-4)


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_1", "Q4_0", "Q5_1"])
@pytest.mark.parametrize("rows", [1, 7, 20])   # GEMV up to 8 rows, then cuBLAS; Q5_1 is dequantized at upload
def test_linear(gpu, qtype, rows):
    dense = randn(96, 256)
    weight = dense if qtype is None else QuantTensor(
        qtype, quants.quantize(dense, GGMLQuantizationType[qtype]), dense.shape)
    step = make_step([(0, list(range(rows)), 0)])
    node = ir.Node("linear", ("x",), "y", ("w", "b"))
    assert_same(gpu, node, {"w": weight, "b": randn(96)}, [randn(rows, 256)], step, tol=1e-4)


@pytest.mark.parametrize("attrs", [
    {"head_dim": 64, "theta": 100000.0},
    {"head_dim": 128, "theta": 1e6, "rotary_dim": 64},   # partial rotary: the rest passes through
    {"head_dim": 64, "theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64}},
])
def test_rope(gpu, attrs):
    step = make_step([(0, list(range(6)), 0), (1, [1, 2], 120)])
    head_dim = attrs["head_dim"]
    assert_same(gpu, ir.Node("rope", ("x",), "y", (), attrs), {}, [randn(8, 3 * head_dim)], step, tol=2e-5)


@pytest.mark.parametrize("n_heads,n_kv,head_dim,window", [(9, 3, 64, 0), (8, 2, 128, 0), (4, 4, 32, 5),
                                                          (16, 8, 256, 0)])
def test_attention_over_steps_and_slots(gpu, n_heads, n_kv, head_dim, window):
    """A prefill in chunks for slot 1, then a batch mixing its decode with a fresh prompt in slot 3."""
    node = ir.Node("attention", ("q", "k", "v"), "o", (), {"n_heads": n_heads, "n_kv_heads": n_kv,
                                                         "head_dim": head_dim, "scale": head_dim ** -0.5,
                                                         "window": window})
    steps = [make_step([(1, list(range(11)), 0)]), make_step([(1, list(range(6)), 11)]),
             make_step([(1, [7], 17), (3, list(range(9)), 0)])]
    per_step_inputs = [[randn(s.n_tokens, n_heads * head_dim), randn(s.n_tokens, n_kv * head_dim),
                        randn(s.n_tokens, n_kv * head_dim)] for s in steps]
    got, want = [], []
    for device, sink in ((gpu, got), (CPUDevice(), want)):
        kernel = device.compile(node_group(node), {}, CTX)
        for step, inputs in zip(steps, per_step_inputs, strict=True):
            (out,) = kernel([device.to_device(x) for x in inputs], step)
            sink.append(device.to_host(out))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_last_rows_and_fused_groups(gpu):
    step = make_step([(0, [1, 2, 3], 0), (2, [4], 5)])
    assert_same(gpu, ir.Node("last_rows", ("x",), "y"), {}, [randn(4, 50)], step)
    nodes = [ir.Node("linear", ("x",), "gate", ("w",)), ir.Node("gelu", ("gate",), "act"),
             ir.Node("mul", ("act", "up"), "h"), ir.Node("scale", ("h",), "hs", attrs={"factor": 0.125}),
             ir.Node("add", ("hs", "resid"), "out"), ir.Node("silu", ("out",), "s"),
             ir.Node("linear", ("out",), "y", ("w",)), ir.Node("linear", ("s",), "logits", ("w",))]
    fused = fuse(ir.Graph(nodes, {"w": randn(4, 4)}))[1]
    assert fused.ops == ("gelu", "mul", "scale", "add", "silu")
    (got_outs,), (want_outs,) = run_both(gpu, fused, {}, [randn(33, 577) * 4 for _ in fused.inputs], [step])
    for g, w in zip(got_outs, want_outs, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


VOCAB = 50_003   # not a multiple of any block size


def sampling_step(**fields) -> ir.Step:
    n = len(next(iter(fields.values())))
    sampling = greedy_sampling(n)
    for name, value in fields.items():
        setattr(sampling, name, np.asarray(value, dtype=getattr(sampling, name).dtype))
    return make_step([(i, [0], 0) for i in range(n)], sampling)


def logits_rows(n: int) -> np.ndarray:
    rows = randn(n, VOCAB) * 3
    rows[:, 17] = rows.max() + 1   # a clear top token
    rows[-1, 100:110] = rows[-1].max() + 2   # ties at the top of the last row
    return rows


def test_sampling_processors(gpu):
    recent = np.full((4, ir.PENALTY_WINDOW), -1, np.int32)
    recent[0, :5] = [17, 3, 17, 4000, 50_002]
    recent[2, :3] = [100, 101, 5]
    step = sampling_step(temperature=[0.7, 1.3, 0.0, 1.0], top_k=[40, 1, 5, 0], top_p=[0.9, 0.5, 1.0, 0.3],
                         min_p=[0.05, 0.0, 0.1, 0.2], repetition_penalty=[1.3, 1.0, 1.2, 1.0],
                         presence_penalty=[0.5, 0.0, 0.0, 1.0], recent=recent,
                         uniform=[0.3, 0.9, 0.5, 0.99])
    step.sampling.constrained = np.array([True, False, True, False])     # structured output's mask
    bits = np.random.default_rng(3).random((4, -(-VOCAB // 32) * 32)) < 0.5
    bits[:, 17] = True
    step.sampling.token_mask = np.packbits(bits, axis=1, bitorder="little").view("<i4").astype(np.int32)
    logits = logits_rows(4)
    for op in ir.SAMPLING_OPS[:-1]:
        got = assert_same(gpu, ir.Node(op, ("logits",), "out"), {}, [logits], step)
        assert np.isneginf(got).any() or op in ("penalize", "temperature")
        logits = got


@pytest.mark.parametrize("seed", range(5))
def test_sample_draws_the_interpreters_token(gpu, seed):
    draw = np.random.default_rng(seed)
    n = 6
    logits = logits_rows(n) / 2
    logits[1, 2000:] = -np.inf      # a truncated row
    step = sampling_step(temperature=[0.0, 0.8, 1.0, 0.0, 1.5, 1.0], uniform=draw.random(n))
    ((tokens,),), ((want,),) = run_both(gpu, node_group(ir.Node("sample", ("logits",), "next_tokens")), {},
                                        [logits], [step])
    assert tokens[0] == 17 and tokens[3] == 17   # greedy rows
    assert tokens[1] < 2000
    for row, u, got, expected in zip(logits, step.sampling.uniform, tokens, want):
        if got != expected:   # only a draw within float32 rounding of the two tokens' boundary may differ
            cumulative = np.cumsum(np.exp(row.astype(np.float64) - row.max()))
            boundary = cumulative[min(got, expected)]
            assert abs(boundary - u * cumulative[-1]) <= 1e-5 * cumulative[-1], (got, expected)


@pytest.mark.parametrize("arch,matrix_type", [("llama", None), ("qwen2", None), ("qwen3", None),
                                               ("llama", "Q4_1"), ("qwen3", "Q4_0")])
def test_tiny_model_logits_and_greedy_ids_match_the_interpreter(tiny_checkpoint, arch, matrix_type):
    model = load_hf(str(tiny_checkpoint(arch)))
    if matrix_type:   # GGUF blocks on the device (GEMV, dequantize + cuBLAS); the interpreter dequantizes
        model = quantized(model, matrix_type)
    gpu = cuda_backend.lse_backend().open(0)
    plan = Plan.build(build_graph(model), [gpu], CTX, fallback_device=None, allow_fallback=False)
    assert all(p.device is gpu for p in plan.placements), plan.describe()
    reference = cpu_plan(model, CTX.kv_slots, CTX.kv_len, CTX.max_tokens)
    prompt = prompt_ids(tiny_checkpoint(arch))
    n = len(prompt)

    def check(step: ir.Step) -> list[int]:
        got, want = plan.run(step, want_logits=True), reference.run(step, want_logits=True)
        np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        assert got.next_tokens.tolist() == want.next_tokens.tolist()
        return want.next_tokens.tolist()

    # the prompt in two chunks in slot 2; then its decode batched with the same prompt whole in slot 0 (the
    # two slots may part on a near-tie of the random weights, as they do on the interpreter: each is checked)
    check(make_step([(2, prompt[:7], 0)]))
    (a,) = check(make_step([(2, prompt[7:], 7)]))
    a, b = check(make_step([(2, [a], n), (0, prompt, 0)]))
    for i in range(1, 8):
        a, b = check(make_step([(2, [a], n + i), (0, [b], n + i - 1)]))
    gpu.close()
