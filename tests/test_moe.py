"""Mixtures of experts: the routing and expert ops on the CPU interpreter against plain loops and on jit:0
against the interpreter (quantized experts read in place), Qwen3-MoE from a Hugging Face directory and from
GGUFs as llama.cpp writes them and gpt-oss from a directory giving transformers' greedy ids on cpu:0 and jit:0,
and a device without the expert kernels (the example plugin) falling back to the interpreter per group,
counted, or refusing under --no-cpu-fallback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from checkpoints import (
    greedy_sampling,
    hf_greedy,
    make_step,
    prompt_ids,
    write_gpt_oss_gguf,
    write_moe_gguf,
    write_mxfp4_checkpoint,
)

from lse_backends.cpu import CPUDevice
from lse_core.api import EVENT_END, EVENT_ERROR, lse_close, lse_open_or_raise, lse_request_iter, lse_status
from lse_core.config import LSEConfig
from lse_core.devices.hookspec import CompileContext
from lse_core.errors import StartupError
from lse_core.graph import ir
from lse_core.graph.fuse import FusedGroup
from lse_core.graph.plan import Plan
from lse_core.model.arch import build_graph
from lse_core.model.files import load_hf
from lse_core.model.gguf import load_gguf

CTX = CompileContext(kv_slots=4, kv_len=128, max_tokens=64)
N_NEW = 12
RNG = np.random.default_rng(0)


def run_node(node: ir.Node, inputs: list[np.ndarray], weights: dict | None = None,
             ctx: CompileContext = CTX) -> np.ndarray:
    kernel = CPUDevice().compile(FusedGroup(0, (node,), node.inputs, (node.output,), node.params), weights or {}, ctx)
    step = make_step([(0, [0] * inputs[0].shape[0], 0)])
    return np.array(kernel(inputs, step)[0])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# --- the ops on the interpreter ----------------------------------------------------------------


@pytest.mark.parametrize("mode, normalize", [("softmax_topk", False), ("softmax_topk", True),
                                             ("topk_softmax", False)])
def test_route_picks_the_top_k_and_weighs_them(mode, normalize):
    logits = RNG.standard_normal((5, 8)).astype(np.float32)
    logits[4] = 0.5   # a row of ties: the lower ids win
    routes = run_node(ir.Node("moe_route", ("l",), "r", (), {"k": 3, "mode": mode, "normalize": normalize}),
                      [logits])
    for row, route in zip(logits, routes):
        ids = sorted(range(8), key=lambda e: (-row[e], e))[:3]
        assert route[:3].tolist() == ids
        if mode == "topk_softmax":     # gpt-oss: softmax over the chosen logits
            expected = softmax(row[ids])
        else:                          # Qwen: softmax over every expert, renormalised or not
            expected = softmax(row)[ids]
            expected = expected / expected.sum() if normalize else expected
        np.testing.assert_allclose(route[3:], expected, rtol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("per_slot", [False, True])
def test_expert_linear_runs_each_rows_chosen_experts(per_slot, deterministic):
    """Against a loop over rows and slots: a shared input (gate, up) or one per slot (down), with biases;
    grouped by expert, or a GEMV per (row, slot) under the deterministic mode."""
    n, k, n_experts, width, in_width = 7, 2, 6, 5, 8
    weight = RNG.standard_normal((n_experts, width, in_width)).astype(np.float32)
    bias = RNG.standard_normal((n_experts, width)).astype(np.float32)
    ids = np.array([[0, 3], [3, 0], [5, 1], [1, 5], [2, 3], [3, 2], [4, 0]])
    routes = np.concatenate([ids, RNG.random((n, k))], axis=1).astype(np.float32)
    x = RNG.standard_normal((n, k * in_width if per_slot else in_width)).astype(np.float32)
    node = ir.Node("expert_linear", ("x", "routes"), "y", ("w", "b"), {"k": k})
    ctx = CompileContext(4, 16, 16, deterministic=deterministic)
    got = run_node(node, [x, routes], {"w": weight, "b": bias}, ctx).reshape(n, k, width)
    for t in range(n):
        for j in range(k):
            row = x[t, j * in_width:(j + 1) * in_width] if per_slot else x[t]
            np.testing.assert_allclose(got[t, j], weight[ids[t, j]] @ row + bias[ids[t, j]], rtol=1e-5, atol=1e-5)


def test_combine_weighs_and_sums_the_slots():
    n, k, width = 4, 3, 6
    y = RNG.standard_normal((n, k * width)).astype(np.float32)
    routes = np.concatenate([np.zeros((n, k)), RNG.random((n, k))], axis=1).astype(np.float32)
    got = run_node(ir.Node("moe_combine", ("y", "routes"), "out"), [y, routes])
    expected = np.einsum("tk,tkw->tw", routes[:, k:], y.reshape(n, k, width))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("per_slot", [False, True])
def test_jit_expert_linear_reads_quantized_experts_in_place(qtype, per_slot):
    """Each chosen expert's rows of the laid-out blocks meet the rows routed to it, as jit:0's quantized linears
    do (test_quant_kernels: exact for the activations as the tiles see them), plus the expert's bias: steps of
    one token, a few, and a prefill's. MXFP4 experts are read as the Q8_0 blocks of their exact values."""
    from test_quant_kernels import gguf_weight, seen_by_kernels

    from lse_backends.jit import JitDevice, quant
    from lse_core.model.model import QuantTensor

    n_experts, width, in_width, k = 6, 16, 256, 2
    blocks, dense = gguf_weight(qtype, n_experts * width, in_width)
    weights = {"w": QuantTensor(qtype, blocks, (n_experts, width, in_width)),
               "b": RNG.standard_normal((n_experts, width)).astype(np.float32)}
    dense = dense.reshape(n_experts, width, in_width)
    node = ir.Node("expert_linear", ("x", "routes"), "y", ("w", "b"), {"k": k, "mlp": "down"})
    # a Q4_K_M model's types: the linear_pairs test_quant_kernels compiles too
    ctx = CompileContext(4, 64, 40, weight_types=frozenset({"Q4_K", "Q6_K", "Q8_0", "Q5_0"}))
    kernel = JitDevice().compile(FusedGroup(0, (node,), node.inputs, (node.output,), node.params), weights, ctx)
    for n in (1, 3, 20):
        ids = np.array([[2, 5], [5, 2]] * n)[:n]   # slots swap row by row: expert 2 meets every row
        routes = np.concatenate([ids, np.full((n, k), 0.5)], axis=1).astype(np.float32)
        x = RNG.standard_normal((n, k * in_width if per_slot else in_width)).astype(np.float32)
        got = kernel([x, routes], make_step([(0, [0] * n, 0)]))[0].reshape(n, k, width)
        x3 = x.reshape(n, -1, in_width)
        for e in (2, 5):
            rows, slots = np.nonzero(ids == e)
            routed = x3[rows, slots if per_slot else 0]
            seen = seen_by_kernels("Q8_0" if qtype == "MXFP4" else qtype, routed,
                                   quant.WIDE_PREFILL | quant.WIDE_DECODE).astype(np.float64)
            expected = seen @ dense[e].T.astype(np.float64) + weights["b"][e]
            assert np.abs(got[rows, slots] - expected).max() <= 1e-5 * np.abs(expected).max(), (n, e)


def test_mxfp4_becomes_the_q8_0_blocks_of_its_exact_values():
    """jit:0 keeps MXFP4 as Q8_0 (d = 2^(e - 128) in f16, q the doubled e2m1 value), exactly; a zero block may
    have any exponent, and an exponent f16 cannot hold elsewhere leaves the weight to float32."""
    import gguf
    from gguf import GGMLQuantizationType as QT

    from lse_backends.jit.moe import mxfp4_as_q8_0

    x = RNG.standard_normal((16, 128)).astype(np.float32) * 0.05
    x[3, 32:64] = 0   # gguf gives this block the exponent 0, 2^-128
    blocks = gguf.quants.quantize(x, QT.MXFP4)
    as_q8_0 = mxfp4_as_q8_0(blocks)
    assert as_q8_0.shape == (16, 4 * 34) and blocks.reshape(16, 4, 17)[3, 1, 0] == 0
    np.testing.assert_array_equal(gguf.quants.dequantize(as_q8_0, QT.Q8_0), gguf.quants.dequantize(blocks, QT.MXFP4))
    blocks.reshape(16, 4, 17)[5, 2, 0] = 200   # 2^72
    assert mxfp4_as_q8_0(blocks) is None


# --- Qwen3-MoE against transformers ------------------------------------------------------------


def moe_layers(model) -> list[int]:
    return sorted({n.layer for n in build_graph(model).nodes if n.op == "moe_route"})


@pytest.mark.parametrize("options, layers", [({}, [0, 2]), (dict(mlp_only_layers=[], decoder_sparse_step=2), [1])])
def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step(tiny_checkpoint, options, layers):
    assert moe_layers(load_hf(str(tiny_checkpoint("qwen3_moe", **options)))) == layers


def greedy(plan: Plan, prompt: list[int], n_new: int, chunk: int) -> list[int]:
    """Greedy ids, the prompt in chunks of ``chunk`` rows, then a decode row per step."""
    for start in range(0, len(prompt), chunk):
        out = plan.run(make_step([(1, prompt[start:start + chunk], start)]))
    ids = [int(out.next_tokens[0])]
    for position in range(len(prompt), len(prompt) + n_new - 1):
        ids.append(int(plan.run(make_step([(1, [ids[-1]], position)])).next_tokens[0]))
    return ids


def plan_on(model, device_name: str, causes: list[str] | None = None) -> Plan:
    """cpu:0 alone, or jit:0 with the interpreter taking (and counting, in ``causes``) any group it has no
    kernel for."""
    cpu = CPUDevice()
    if device_name == "cpu:0":
        return Plan.build(build_graph(model), [cpu], CTX, fallback_device=cpu)
    from lse_backends.jit import JitDevice

    return Plan.build(build_graph(model), [JitDevice()], CTX, fallback_device=cpu,
                      on_fallback=(causes if causes is not None else []).append)


@pytest.mark.parametrize("seed, options", [(0, {}), (1, dict(norm_topk_prob=False)),
                                           (2, dict(num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[]))])
def test_greedy_ids_equal_transformers_on_cpu_and_jit(tiny_checkpoint, seed, options):
    path = tiny_checkpoint("qwen3_moe", seed=seed, **options)
    prompt = prompt_ids(path)
    expected, _ = hf_greedy(path, prompt, N_NEW)
    model = load_hf(str(path))
    for device in ("cpu:0", "jit:0"):
        for chunk in (len(prompt), 5):
            assert greedy(plan_on(model, device), prompt, N_NEW, chunk) == expected, (device, chunk)


@pytest.mark.parametrize("seed, options", [(0, {}), (1, dict(swiglu_limit=0.5, sliding_window=6))])
def test_gpt_oss_greedy_ids_equal_transformers_on_cpu_and_jit(tiny_checkpoint, seed, options):
    """Sinks, biases, YaRN, the clamped SwiGLU (its limit reached in seed 1) and sliding windows far shorter than
    the prompt; jit:0 runs every group itself."""
    path = tiny_checkpoint("gpt_oss", seed=seed, **options)
    prompt = prompt_ids(path, "The quick brown fox jumps over the lazy dog. " * 4)
    expected, _ = hf_greedy(path, prompt, N_NEW)
    model = load_hf(str(path))
    assert greedy(plan_on(model, "cpu:0"), prompt, N_NEW, 7) == expected
    causes: list[str] = []
    assert greedy(plan_on(model, "jit:0", causes), prompt, N_NEW, 7) == expected
    assert causes == []


def test_gpt_oss_mxfp4_experts_give_transformers_ids_on_their_values(tiny_checkpoint, tmp_path):
    """OpenAI's MXFP4 blocks and scales become GGUF MXFP4 experts ([experts, out, in], gate and up apart), whose
    values are the dequantized checkpoint's that transformers runs."""
    path = tiny_checkpoint("gpt_oss", seed=2)
    mxfp4, reference = write_mxfp4_checkpoint(path, tmp_path)
    model = load_hf(str(mxfp4))
    graph = build_graph(model)
    up = graph.weights["model.layers.1.mlp.experts.up"]
    assert (up.qtype, up.shape) == ("MXFP4", (8, 32, 64))
    prompt = prompt_ids(path, "The quick brown fox jumps over the lazy dog. " * 2)
    expected, _ = hf_greedy(reference, prompt, N_NEW)
    for device in ("cpu:0", "jit:0"):
        assert greedy(plan_on(model, device), prompt, N_NEW, 7) == expected, device


def test_gpt_oss_gguf_as_llama_cpp_writes_it_gives_transformers_ids(tiny_checkpoint, tmp_path):
    """gpt-oss with MXFP4 ffn_*_exps, their biases, attn_sinks and YaRN keys: the ids transformers gives on the
    values the file stores, on cpu:0 and jit:0."""
    path = tiny_checkpoint("gpt_oss", seed=3)
    gguf_file, reference = write_gpt_oss_gguf(path, tmp_path)
    model = load_gguf(str(gguf_file))
    assert (model.config["layer_types"], model.config["sliding_window"]) == (
        ["sliding_attention", "full_attention", "sliding_attention"], 4)
    assert model.weights["model.layers.2.mlp.experts.down_proj.weight"].qtype == "MXFP4"
    prompt = prompt_ids(path, "The quick brown fox jumps over the lazy dog. " * 2)
    expected, _ = hf_greedy(reference, prompt, N_NEW)
    for device in ("cpu:0", "jit:0"):
        assert greedy(plan_on(model, device), prompt, N_NEW, 7) == expected, device


def test_yarn_frequencies_and_attention_factor_are_transformers(tiny_checkpoint):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = tiny_checkpoint("gpt_oss")
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(path))
    rope = next(n.attrs for n in build_graph(load_hf(str(path))).nodes if n.op == "rope")
    np.testing.assert_allclose(ir.rope_inv_freq(rope), inv_freq.numpy(), rtol=1e-6)
    assert ir.rope_attention_factor(rope) == pytest.approx(factor)


def test_clamped_swiglu_is_gpt_oss_activation():
    gate, up = (RNG.standard_normal((3, 40)).astype(np.float32) * 6 for _ in range(2))
    got = run_node(ir.Node("clamped_swiglu", ("g", "u"), "y", (), {"alpha": 1.702, "limit": 7.0}), [gate, up])
    g = np.minimum(gate, 7.0)
    np.testing.assert_allclose(got, (np.clip(up, -7, 7) + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF imports go to a cache of this run only."""
    monkeypatch.setenv("LSE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "lse-cache"))


@pytest.mark.parametrize("expert_type", ["F32", "Q8_0", "Q4_0"])
def test_gguf_as_llama_cpp_writes_it_gives_transformers_ids(tiny_checkpoint, tmp_path, expert_type):
    """qwen3moe with 3-D ffn_*_exps tensors (every layer a mixture, as llama.cpp requires): the experts stay
    in their blocks, [experts, out, in], and the greedy ids equal transformers' on the weights the file
    stores, on cpu:0 and jit:0."""
    path = tiny_checkpoint("qwen3_moe", seed=3, mlp_only_layers=[])
    gguf_file, reference = write_moe_gguf(path, tmp_path, expert_type)
    model = load_gguf(str(gguf_file))
    experts = model.weights["model.layers.0.mlp.experts.down_proj.weight"]
    assert tuple(experts.shape) == (8, 64, 32)
    assert getattr(experts, "qtype", "F32") == expert_type
    assert (model.config["num_experts"], model.config["num_experts_per_tok"], model.config["norm_topk_prob"],
            model.config["mlp_only_layers"]) == (8, 2, True, [])
    prompt = prompt_ids(path)
    expected, _ = hf_greedy(reference, prompt, N_NEW)
    for device in ("cpu:0", "jit:0"):
        assert greedy(plan_on(model, device), prompt, N_NEW, 6) == expected, device


def test_more_experts_per_token_than_experts_is_a_startup_error(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3_moe")
    model = load_hf(str(path))
    model.config = {**model.config, "num_experts_per_tok": 9}
    with pytest.raises(StartupError, match="9 experts per token of 8 experts"):
        build_graph(model)


# --- devices without the expert kernels --------------------------------------------------------


def test_jit_runs_every_expert_group_itself(tiny_checkpoint):
    model = load_hf(str(tiny_checkpoint("qwen3_moe")))
    causes: list[str] = []
    plan = plan_on(model, "jit:0", causes)
    expert_groups = [p for p in plan.placements if p.group.ops[0] in ir.MOE_OPS]
    assert len(expert_groups) == 10   # five a mixture, layers 0 and 2
    assert all(p.device.info.name == "jit:0" and p.fallback_cause is None for p in expert_groups)
    plan.run(make_step([(0, [5, 6, 7], 0)], greedy_sampling(1)))
    assert causes == []


@pytest.fixture
def hrx_with_every_other_kernel(monkeypatch):
    """The example plugin's simulated device with every model kernel it has: it lacks the expert ops."""
    monkeypatch.setenv("HRX_DEVICES", "1")
    monkeypatch.setenv("HRX_MISSING", "")
    monkeypatch.delenv("LSE_REQUIRE_DEVICE_KERNELS", raising=False)


BODY = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


def test_plugin_device_falls_back_for_expert_groups_counted(tiny_checkpoint, hrx_with_every_other_kernel):
    path = tiny_checkpoint("qwen3_moe")
    lse = lse_open_or_raise(LSEConfig(model=str(path), kv_len=64, parallel=2, pool="hrx:0"))
    try:
        events = list(lse_request_iter(lse, BODY, "completion"))
        assert events[-1].kind == EVENT_END
        fallback = lse_status(lse)["engine"]["cpu_fallback"]
        assert fallback["allowed"] and fallback["total"] > 0
        # of the model's groups, the expert ones alone (the plugin has no logits processors either)
        assert {p.group.ops for p in lse.plan.placements if p.fallback_cause and p.group.sampling_op is None} == {
            ("moe_route",), ("expert_linear",), ("moe_combine",)}
    finally:
        lse_close(lse)


def test_plugin_device_refuses_expert_groups_under_no_cpu_fallback(tiny_checkpoint, hrx_with_every_other_kernel):
    path = tiny_checkpoint("qwen3_moe")
    lse = lse_open_or_raise(LSEConfig(model=str(path), kv_len=64, parallel=2, pool="hrx:0",
                                      disable_cpu_fallback=True))
    try:
        error = list(lse_request_iter(lse, BODY, "completion"))[-1]
        assert error.kind == EVENT_ERROR and error.status == 500
        message = error.data["error"]["message"]
        assert message.startswith("CPU fallback disabled: fused group ") and "no kernel for moe_route" in message
    finally:
        lse_close(lse)


def test_hf_and_gguf_tensor_layouts_agree(tiny_checkpoint, tmp_path: Path):
    """The stacked experts built from a directory's per-expert matrices equal the GGUF's 3-D tensor."""
    path = tiny_checkpoint("qwen3_moe", seed=3, mlp_only_layers=[])
    gguf_file, _ = write_moe_gguf(path, tmp_path)
    name = "model.layers.2.mlp.experts.gate_proj.weight"
    from_dir = build_graph(load_hf(str(path))).weights[name]
    np.testing.assert_array_equal(build_graph(load_gguf(str(gguf_file))).weights[name], from_dir)
